-- A long format string, expanded per row.
-- expect: finished
SELECT length(to_char(TIMESTAMP '2020-01-01T00:00:00', repeat('%A %B ', 10000)))
