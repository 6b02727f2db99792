-- Doubling hidden in nested WITHs that reuse one name.
-- expect: statement_too_complex
{{16*WITH a AS (}}SELECT 1 AS x{{15*) SELECT x FROM a UNION ALL SELECT x FROM a}}) SELECT count(*) FROM a
