-- ntile with the largest count.
-- expect: any
SELECT ntile(9223372036854775807) OVER () FROM generate_series(1, 10)
