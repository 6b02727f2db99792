-- lpad to the longest string a Utf8 array can hold.
-- expect: resources_exhausted
SELECT length(lpad('a', 2147483647, 'é'))
