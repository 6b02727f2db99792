-- A type string nested 150,000 deep (parsed recursively).
-- expect: refused
SELECT arrow_cast(NULL, '{{150000*List(}}Int64{{150000*)}}')
