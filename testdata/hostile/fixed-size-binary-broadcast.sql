-- A type a gigabyte wide, broadcast to a batch of rows (this aborted the process).
-- expect: resources_exhausted
SELECT count(x) FROM (SELECT arrow_cast(NULL, 'FixedSizeBinary(1000000000)') AS x FROM generate_series(1, 8192))
