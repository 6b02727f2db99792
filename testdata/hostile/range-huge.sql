-- A range of every i64.
-- expect: resources_exhausted
SELECT cardinality(range(-9223372036854775808, 9223372036854775807))
