-- A pattern that compiles to more than the regex size limit allows.
-- expect: resources_exhausted
SELECT regexp_like('a', '((((x{100}){100}){100}){100})')
