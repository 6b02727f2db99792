-- approx_percentile_cont with two billion centroids.
-- expect: any
SELECT approx_percentile_cont(value, 0.5, 2000000000) FROM generate_series(1, 1000)
