-- A list literal of 10,000 strings over a table: a copy in every row of each batch.
-- expect: resources_exhausted
SELECT count(x) FROM (SELECT make_array({{10000*'aaaaaaaaaaaaaaaa', }}'a') AS x, value FROM generate_series(1, 8192))
