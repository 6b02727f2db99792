-- A SQL cast to an array type of a billion elements per value (DataFusion makes a null of it to fold the cast).
-- expect: resources_exhausted
SELECT CAST(NULL AS INT[1000000000]) IS NULL
