-- A list type of two billion elements per row.
-- expect: resources_exhausted
SELECT count(x) FROM (SELECT arrow_cast(NULL, 'FixedSizeList(2147483647, Int64)') AS x FROM generate_series(1, 10))
