-- A sort that needs more than the statement memory (operators are counted as before), or more time.
-- expect: refused
SELECT v FROM (SELECT repeat(CAST(value AS VARCHAR), 100) AS v FROM generate_series(1, 3000000)) ORDER BY v DESC LIMIT 1 OFFSET 2000000
