-- Three results of 100 MB that fit alone but not together, made while the statement runs: each is held in the statement's memory while it lives.
-- expect: resources_exhausted
SELECT max(length(a)) + max(length(b)) + max(length(c)) FROM (SELECT repeat('a', 100000000 + v - v) AS a, repeat('b', 100000000 + v - v) AS b, repeat('c', 100000000 + v - v) AS c FROM (VALUES (1)) AS t(v))
