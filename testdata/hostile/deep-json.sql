-- JSON nested 50,000 deep into a JSON function.
-- expect: any
SELECT json_get('{{50000*[}}1{{50000*]}}', 0)
