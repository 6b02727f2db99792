-- levenshtein is quadratic: two 100,000-character strings are ten billion steps in one call.
-- expect: resources_exhausted
SELECT levenshtein(repeat('a', 100000), repeat('b', 100000))
