-- nth_value with the largest offset.
-- expect: any
SELECT nth_value(value, 9223372036854775807) OVER () FROM generate_series(1, 10)
