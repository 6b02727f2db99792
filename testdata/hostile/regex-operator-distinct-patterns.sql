-- Five thousand distinct patterns from a column through the ~ operator (all compiled and kept at once).
-- expect: resources_exhausted
SELECT count(*) FROM generate_series(1, 5000) WHERE 'x' ~ ('(x{50}){50}' || CAST(value AS VARCHAR))
