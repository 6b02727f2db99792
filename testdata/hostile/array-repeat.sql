-- array_repeat to a billion elements.
-- expect: resources_exhausted
SELECT cardinality(array_repeat(1, 1000000000))
