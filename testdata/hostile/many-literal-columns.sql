-- A list literal of 2,000 strings of 80 bytes over a table: a copy in every row of each batch.
-- expect: resources_exhausted
SELECT count(x) FROM (SELECT make_array({{2000*'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa', }}'a') AS x, value FROM generate_series(1, 8192))
