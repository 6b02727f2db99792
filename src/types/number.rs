//! Number tokens: the int, uint and float rules of the ingest contract.
//!
//! The JSON scanner hands over a token that already matches the JSON number grammar and says
//! whether it is an integer token (no fraction, no exponent). These functions apply the column
//! rules to it.

use super::ValueError;

fn token_string(token: &[u8]) -> String {
    String::from_utf8_lossy(token).into_owned()
}

/// Parses an integer token (`-?(0|[1-9][0-9]*)`) as `i64`, or `None` when it is out of range.
pub(crate) fn parse_i64(token: &[u8]) -> Option<i64> {
    let (negative, digits) = match token.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, token),
    };
    if digits.is_empty() || digits.len() > 19 {
        return None;
    }
    // Up to 19 digits fit in u64 without overflow checks.
    let mut magnitude: u64 = 0;
    for &d in digits {
        magnitude = magnitude * 10 + u64::from(d.wrapping_sub(b'0'));
    }
    if negative {
        if magnitude <= i64::MAX as u64 + 1 {
            Some((magnitude as i64).wrapping_neg())
        } else {
            None
        }
    } else {
        i64::try_from(magnitude).ok()
    }
}

/// Checks an `int` column's number token.
pub(crate) fn int_value(token: &[u8], is_integer: bool) -> Result<i64, ValueError> {
    if !is_integer {
        return Err(ValueError::NotAnIntegerToken {
            token: token_string(token),
        });
    }
    parse_i64(token).ok_or_else(|| ValueError::IntegerOutOfRange {
        token: token_string(token),
        min: i128::from(i64::MIN),
        max: i128::from(i64::MAX),
    })
}

/// Checks a `uint` column's number token: an integer from 0 through 9223372036854775807.
pub(crate) fn uint_value(token: &[u8], is_integer: bool) -> Result<u64, ValueError> {
    if !is_integer {
        return Err(ValueError::NotAnIntegerToken {
            token: token_string(token),
        });
    }
    match parse_i64(token) {
        Some(v) if v >= 0 => Ok(v as u64),
        _ => Err(ValueError::IntegerOutOfRange {
            token: token_string(token),
            min: 0,
            max: i128::from(i64::MAX),
        }),
    }
}

/// Checks a `float` column's number token.
///
/// The value must be finite; a non-zero token must not round to zero; an integer token must be
/// exactly representable (so `9007199254740993` is refused while `9007199254740992` is not).
pub(crate) fn float_value(token: &[u8], is_integer: bool) -> Result<f64, ValueError> {
    let problem = |problem| ValueError::FloatNotRepresentable {
        token: token_string(token),
        problem,
    };
    // The scanner only hands over ASCII number tokens.
    let text = std::str::from_utf8(token).map_err(|_| problem("is not a number"))?;
    let value: f64 = text.parse().map_err(|_| problem("is not a number"))?;
    if !value.is_finite() {
        return Err(problem("overflows a 64-bit float"));
    }
    if value == 0.0 && token_has_nonzero_digit(token) {
        return Err(problem("underflows to zero as a 64-bit float"));
    }
    if is_integer && !integer_is_exact(text, value) {
        return Err(problem(
            "is an integer that a 64-bit float cannot represent exactly",
        ));
    }
    Ok(value)
}

/// Whether the mantissa of a number token (before any exponent) has a non-zero digit.
fn token_has_nonzero_digit(token: &[u8]) -> bool {
    token
        .iter()
        .take_while(|&&b| b != b'e' && b != b'E')
        .any(|&b| (b'1'..=b'9').contains(&b))
}

/// Whether `value` is exactly the integer written in `text`.
fn integer_is_exact(text: &str, value: f64) -> bool {
    const EXACT_LIMIT: f64 = 9_007_199_254_740_992.0; // 2^53
    if value.abs() <= EXACT_LIMIT {
        // Every integer of magnitude <= 2^53 is a float, and parsing rounds correctly, so the
        // value is exact when it round-trips through i64.
        return parse_i64(text.as_bytes()) == Some(value as i64);
    }
    // Rust prints a float's exact decimal expansion with `{:.0}`.
    let exact = format!("{value:.0}");
    exact == text.strip_prefix('+').unwrap_or(text)
}

/// Formats a float the way the statements API prints it: the shortest text that reads back as
/// the same value, in plain notation from 1e-7 up to 2^53 and in exponent notation outside.
///
/// Plain notation stops at 2^53 because above it the shortest digits padded with zeros form an
/// integer token that is usually not the float's exact value, which the `float` input rule
/// refuses; exponent notation reads back as the same float.
///
/// ```
/// use sluice::types::number::format_float;
/// assert_eq!(format_float(1.5), "1.5");
/// assert_eq!(format_float(1e300), "1e300");
/// assert_eq!(format_float(-0.0), "-0");
/// ```
pub fn format_float(value: f64) -> String {
    let magnitude = value.abs();
    if magnitude == 0.0 || (1e-7..=9_007_199_254_740_992.0).contains(&magnitude) {
        format!("{value}")
    } else {
        format!("{value:e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_values_are_finite_and_exact() {
        assert_eq!(float_value(b"1.5", false).unwrap(), 1.5);
        assert!(float_value(b"1e400", false).is_err());
        assert!(float_value(b"1e-400", false).is_err());
        assert!(float_value(b"9007199254740993", true).is_err());
    }

    #[test]
    fn i64_edges() {
        assert_eq!(parse_i64(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(parse_i64(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(parse_i64(b"9223372036854775808"), None);
        assert_eq!(parse_i64(b"-9223372036854775809"), None);
        assert_eq!(parse_i64(b"99999999999999999999"), None);
        assert_eq!(parse_i64(b"-0"), Some(0));
    }

    #[test]
    fn float_exactness() {
        assert!(float_value(b"9007199254740992", true).is_ok());
        assert!(float_value(b"-9007199254740993", true).is_err());
        assert!(float_value(b"18446744073709551616", true).is_ok()); // 2^64
        assert!(float_value(b"100000000000000000000000", true).is_err()); // 1e23
        assert!(float_value(b"0e-999", false).is_ok());
        assert!(float_value(b"0.0", false).is_ok());
        assert!(float_value(b"-0", true).is_ok());
    }
}
