-- replace with an empty pattern puts the replacement between every character.
-- expect: resources_exhausted
SELECT length(replace(repeat('a', 100000), '', repeat('b', 100000)))
