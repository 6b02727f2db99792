-- The table function over every i64: it streams, and the statement timeout ends it.
-- expect: statement_timeout
SELECT count(*) FROM generate_series(1, 9223372036854775807)
