-- A scalar generate_series of timestamps a nanosecond apart over two centuries.
-- expect: resources_exhausted
SELECT cardinality(generate_series(TIMESTAMP '1970-01-01', TIMESTAMP '2200-01-01', INTERVAL '1 nanosecond'))
