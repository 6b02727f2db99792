-- lead with the smallest i64 offset.
-- expect: any
SELECT lead(value, -9223372036854775808) OVER () FROM generate_series(1, 3)
