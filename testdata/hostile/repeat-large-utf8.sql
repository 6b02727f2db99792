-- The issue's abort: a count that sizes a LargeUtf8 result far past memory, folded while planning.
-- expect: resources_exhausted
SELECT length(repeat(arrow_cast('a', 'LargeUtf8'), 200000000000000))
