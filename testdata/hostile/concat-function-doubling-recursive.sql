-- The same doubling with concat().
-- expect: resources_exhausted
WITH RECURSIVE r(s, n) AS (SELECT 'a', 1 UNION ALL SELECT concat(s, s), n + 1 FROM r WHERE n < 40) SELECT max(length(s)) FROM r
