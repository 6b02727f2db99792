-- A 10 kB separator repeated between 100,000 elements.
-- expect: resources_exhausted
SELECT length(array_to_string(range(1, 100000), repeat('x', 10000)))
