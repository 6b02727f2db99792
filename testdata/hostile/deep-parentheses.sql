-- Expressions nested past the depth limit.
-- expect: statement_too_complex
SELECT {{5000*(}}1{{5000*)}}
