-- A constant folded while planning is copied with the plan: one may take an eighth of the statement memory.
-- expect: resources_exhausted
SELECT length(repeat('a', 150000000))
