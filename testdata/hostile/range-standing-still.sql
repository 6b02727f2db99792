-- A date range whose step pulls both ways (it can stand still, and DataFusion then adds dates until they overflow).
-- expect: resources_exhausted
SELECT cardinality(range(DATE '2000-01-31', DATE '1990-01-01', INTERVAL '1 month -29 days'))
