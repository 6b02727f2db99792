-- A type whose width overflows: two billion lists of two billion values each.
-- expect: resources_exhausted
SELECT arrow_cast(NULL, 'FixedSizeList(2147483647, FixedSizeList(2147483647, Int64))') IS NULL
