-- A recursive query doubling a string each step (the || operator).
-- expect: resources_exhausted
WITH RECURSIVE r(s, n) AS (SELECT 'a', 1 UNION ALL SELECT s || s, n + 1 FROM r WHERE n < 40) SELECT max(length(s)) FROM r
