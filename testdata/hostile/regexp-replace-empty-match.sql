-- regexp_replace with a pattern that matches the empty string everywhere.
-- expect: resources_exhausted
SELECT length(regexp_replace(repeat('a', 100000), 'x*', repeat('b', 10000), 'g'))
