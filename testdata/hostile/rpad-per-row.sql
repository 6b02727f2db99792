-- rpad with a count from a column: checked per row, while running.
-- expect: resources_exhausted
SELECT max(length(rpad('a', 100000000 + value))) FROM generate_series(1, 10)
