-- A 100 kB literal in a projection over a table: a copy per row of each batch.
-- expect: resources_exhausted
SELECT max(length(x || CAST(value AS VARCHAR))) FROM (SELECT '{{100000*a}}' AS x, value FROM generate_series(1, 8192))
