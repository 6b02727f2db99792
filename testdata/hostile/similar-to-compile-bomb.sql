-- SIMILAR TO is a regular expression too.
-- expect: resources_exhausted
SELECT 'a' SIMILAR TO '((((x{100}){100}){100}){100})'
