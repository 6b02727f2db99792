-- A start index whose predecessor overflows (DataFusion subtracts one unchecked).
-- expect: query_error
SELECT array_position(make_array(1, 2, 3), 2, -9223372036854775808)
