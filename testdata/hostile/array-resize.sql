-- array_resize to a billion elements.
-- expect: resources_exhausted
SELECT cardinality(array_resize(make_array(1), 1000000000, 7))
