-- unnest of a range past memory.
-- expect: resources_exhausted
SELECT count(*) FROM (SELECT unnest(range(1, 1000000000)))
