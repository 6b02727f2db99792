-- Deep JSON from a column, per row.
-- expect: any
SELECT json_get_str(x, 'a') FROM (VALUES ('{{50000*[}}1{{50000*]}}'), ('{"a":"b"}')) AS t(x)
