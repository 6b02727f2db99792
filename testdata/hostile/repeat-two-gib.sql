-- Two results of a GiB each: each alone is past the statement memory.
-- expect: resources_exhausted
SELECT length(repeat('a', 1073741824)) + length(repeat('b', 1073741824))
