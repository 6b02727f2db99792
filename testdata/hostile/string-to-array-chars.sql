-- A string split into an element per character.
-- expect: finished
SELECT cardinality(string_to_array(repeat('a', 1000000), ''))
