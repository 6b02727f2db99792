-- Eight doubling CTEs (256 copies): within the caps, planned on a thread of its own, from several clients at once.
-- copies: 4
-- expect: any
WITH c0 AS (SELECT 1 AS x), c1 AS (SELECT x FROM c0 UNION ALL SELECT x FROM c0), c2 AS (SELECT x FROM c1 UNION ALL SELECT x FROM c1), c3 AS (SELECT x FROM c2 UNION ALL SELECT x FROM c2), c4 AS (SELECT x FROM c3 UNION ALL SELECT x FROM c3), c5 AS (SELECT x FROM c4 UNION ALL SELECT x FROM c4), c6 AS (SELECT x FROM c5 UNION ALL SELECT x FROM c5), c7 AS (SELECT x FROM c6 UNION ALL SELECT x FROM c6), c8 AS (SELECT x FROM c7 UNION ALL SELECT x FROM c7) SELECT count(*) FROM c8
