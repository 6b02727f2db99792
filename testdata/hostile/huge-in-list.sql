-- An IN list of 100,000 values.
-- expect: any
SELECT count(*) FROM generate_series(1, 1000) WHERE value IN ({{100000*7, }}7)
