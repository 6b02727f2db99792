-- string_agg with a 10 kB separator over 100,000 rows: a gigabyte once joined.
-- expect: resources_exhausted
SELECT length(string_agg(CAST(value AS VARCHAR), '{{10000*x}}')) FROM generate_series(1, 100000)
