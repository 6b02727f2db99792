-- The same, grouped (a separator appended per row as rows arrive).
-- expect: resources_exhausted
SELECT max(length(s)) FROM (SELECT value % 2 AS g, string_agg(CAST(value AS VARCHAR), '{{10000*x}}') AS s FROM generate_series(1, 100000) GROUP BY 1)
