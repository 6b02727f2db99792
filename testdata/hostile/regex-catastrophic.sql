-- A pattern that backtracks exponentially elsewhere; the regex crate is linear.
-- expect: finished
SELECT regexp_like(repeat('a', 100000), '(a*)*b')
