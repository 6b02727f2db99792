-- Each of 100,000 elements replaced by a 10 kB string.
-- expect: resources_exhausted
SELECT cardinality(array_replace_all(array_repeat('', 100000), '', repeat('x', 10000)))
