-- A window function's 10 kB default value copied into every row of a 100,000-row partition (as Utf8, a copy each).
-- expect: resources_exhausted
SELECT count(x) FROM (SELECT lag(arrow_cast(CAST(value AS VARCHAR), 'Utf8'), 200000, arrow_cast('{{10000*x}}', 'Utf8')) OVER () AS x FROM generate_series(1, 100000))
