//! Timestamps (RFC 3339) and intervals (fixed ISO 8601 durations) as signed 64-bit nanoseconds.
//!
//! Both are parsed by hand: the grammar is small, the checks are exact (calendar days, offset
//! ranges, nine fractional digits, i64 range), and the hot ingest path must not allocate.

use std::fmt::Write as _;

use super::ValueError;

const NANOS_PER_SECOND: i128 = 1_000_000_000;
const SECONDS_PER_DAY: i64 = 86_400;

fn ts_err(text: &[u8], problem: &'static str) -> ValueError {
    ValueError::InvalidTimestamp {
        text: String::from_utf8_lossy(text).into_owned(),
        problem,
    }
}

fn iv_err(text: &[u8], problem: &'static str) -> ValueError {
    ValueError::InvalidInterval {
        text: String::from_utf8_lossy(text).into_owned(),
        problem,
    }
}

/// Reads exactly `N` ASCII digits at `pos`.
fn digits<const N: usize>(s: &[u8], pos: usize) -> Option<u32> {
    let bytes = s.get(pos..pos + N)?;
    let mut value = 0u32;
    for &b in bytes {
        if !b.is_ascii_digit() {
            return None;
        }
        value = value * 10 + u32::from(b - b'0');
    }
    Some(value)
}

fn is_leap_year(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: u32) -> u32 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        _ if is_leap_year(year) => 29,
        _ => 28,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(month);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day number since 1970-01-01 (inverse of [`days_from_civil`]).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Parses up to nine fractional digits after a `.` at `pos`; returns (nanos, next position).
fn fraction(s: &[u8], pos: usize) -> Result<(i128, usize), &'static str> {
    let run = s[pos.min(s.len())..]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .count();
    if run == 0 {
        return Err("a decimal point must be followed by digits");
    }
    if run > 9 {
        return Err("more than nine fractional second digits");
    }
    let mut nanos: u32 = 0;
    for &b in &s[pos..pos + run] {
        nanos = nanos * 10 + u32::from(b - b'0');
    }
    const SCALE: [u32; 10] = [
        1_000_000_000,
        100_000_000,
        10_000_000,
        1_000_000,
        100_000,
        10_000,
        1_000,
        100,
        10,
        1,
    ];
    Ok((i128::from(nanos * SCALE[run]), pos + run))
}

/// Parses an RFC 3339 timestamp into nanoseconds since the Unix epoch (UTC).
///
/// The form is `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)`: the `T` (or `t`) separator and an
/// explicit offset are required, at most nine fractional digits are allowed, the date must exist
/// in the calendar, leap seconds (`:60`) are refused because they have no nanosecond value, and
/// the instant must fit signed 64-bit nanoseconds (1677-09-21 to 2262-04-11).
pub(crate) fn parse_timestamp(s: &[u8]) -> Result<i64, ValueError> {
    let err = |problem| ts_err(s, problem);
    if s.len() < 19 {
        if s.len() == 10 && digits::<4>(s, 0).is_some() && s.get(4) == Some(&b'-') {
            return Err(err("a date without a time is not a timestamp"));
        }
        if !s.is_empty() && s.iter().all(u8::is_ascii_digit) {
            return Err(err("numeric epochs are not accepted"));
        }
        return Err(err("too short for RFC 3339"));
    }
    let year = digits::<4>(s, 0).ok_or_else(|| err("expected a four-digit year"))?;
    if s[4] != b'-' || s[7] != b'-' {
        return Err(err("expected a date as YYYY-MM-DD"));
    }
    let month = digits::<2>(s, 5).ok_or_else(|| err("expected a two-digit month"))?;
    let day = digits::<2>(s, 8).ok_or_else(|| err("expected a two-digit day"))?;
    if !(1..=12).contains(&month) {
        return Err(err("month must be 01 to 12"));
    }
    let year = i64::from(year);
    if day == 0 || day > days_in_month(year, month) {
        return Err(err("day does not exist in that month"));
    }
    match s[10] {
        b'T' | b't' => {}
        b' ' => return Err(err("the date and time must be separated by 'T'")),
        _ => return Err(err("expected 'T' after the date")),
    }
    let hour = digits::<2>(s, 11).ok_or_else(|| err("expected a two-digit hour"))?;
    if s[13] != b':' || s[16] != b':' {
        return Err(err("expected a time as HH:MM:SS"));
    }
    let minute = digits::<2>(s, 14).ok_or_else(|| err("expected two-digit minutes"))?;
    let second = digits::<2>(s, 17).ok_or_else(|| err("expected two-digit seconds"))?;
    if hour > 23 {
        return Err(err("hour must be 00 to 23"));
    }
    if minute > 59 {
        return Err(err("minutes must be 00 to 59"));
    }
    if second == 60 {
        return Err(err("leap seconds cannot be stored"));
    }
    if second > 59 {
        return Err(err("seconds must be 00 to 59"));
    }
    let mut pos = 19;
    let mut nanos: i128 = 0;
    if s.get(pos) == Some(&b'.') {
        let (n, next) = fraction(s, pos + 1).map_err(err)?;
        nanos = n;
        pos = next;
    }
    let offset_seconds: i64 = match s.get(pos) {
        Some(b'Z' | b'z') if pos + 1 == s.len() => 0,
        Some(&sign @ (b'+' | b'-')) if pos + 6 == s.len() => {
            let oh = digits::<2>(s, pos + 1).ok_or_else(|| err("expected an offset as ±HH:MM"))?;
            let om = digits::<2>(s, pos + 4).ok_or_else(|| err("expected an offset as ±HH:MM"))?;
            if s[pos + 3] != b':' {
                return Err(err("expected an offset as ±HH:MM"));
            }
            if oh > 23 || om > 59 {
                return Err(err("offset out of range"));
            }
            let magnitude = i64::from(oh * 3600 + om * 60);
            if sign == b'-' { -magnitude } else { magnitude }
        }
        None => return Err(err("missing time zone offset ('Z' or ±HH:MM)")),
        Some(_) => return Err(err("expected 'Z' or ±HH:MM at the end")),
    };
    let seconds = days_from_civil(year, month, day) * SECONDS_PER_DAY
        + i64::from(hour * 3600 + minute * 60 + second)
        - offset_seconds;
    let total = i128::from(seconds) * NANOS_PER_SECOND + nanos;
    i64::try_from(total)
        .map_err(|_| err("outside the range of 64-bit nanoseconds (1677-09-21 to 2262-04-11)"))
}

/// Formats nanoseconds since the epoch as RFC 3339 in UTC: `YYYY-MM-DDTHH:MM:SS[.f]Z`, with the
/// fraction's trailing zeros dropped. This is the statements API's cell form.
///
/// ```
/// use sluice::types::temporal::format_timestamp;
/// assert_eq!(format_timestamp(1_500_000_000), "1970-01-01T00:00:01.5Z");
/// assert_eq!(format_timestamp(-1), "1969-12-31T23:59:59.999999999Z");
/// ```
pub fn format_timestamp(nanos: i64) -> String {
    let mut out = String::with_capacity(30);
    write_timestamp(&mut out, nanos);
    out
}

/// Appends [`format_timestamp`]'s text to `out`.
pub(crate) fn write_timestamp(out: &mut String, nanos: i64) {
    let seconds = nanos.div_euclid(1_000_000_000);
    let sub = nanos.rem_euclid(1_000_000_000) as u32;
    let days = seconds.div_euclid(SECONDS_PER_DAY);
    let secs_of_day = seconds.rem_euclid(SECONDS_PER_DAY);
    let (year, month, day) = civil_from_days(days);
    let _ = write!(
        out,
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}",
        secs_of_day / 3600,
        secs_of_day / 60 % 60,
        secs_of_day % 60
    );
    write_fraction(out, sub);
    out.push('Z');
}

/// Appends `.ddd` with trailing zeros trimmed, or nothing for zero.
fn write_fraction(out: &mut String, nanos: u32) {
    if nanos == 0 {
        return;
    }
    let mut digits = format!("{nanos:09}");
    while digits.ends_with('0') {
        digits.pop();
    }
    out.push('.');
    out.push_str(&digits);
}

/// Parses a fixed ISO 8601 duration into signed nanoseconds.
///
/// The form is `[+|-]PT[nH][nM][n[.fraction]S]` with at least one component, in that order.
/// Years, months, weeks and days are calendar units and are refused; only seconds may carry a
/// fraction (at most nine digits); the total must fit signed 64-bit nanoseconds.
pub(crate) fn parse_interval(s: &[u8]) -> Result<i64, ValueError> {
    let err = |problem| iv_err(s, problem);
    let mut pos = 0;
    let negative = match s.first() {
        Some(b'-') => {
            pos += 1;
            true
        }
        Some(b'+') => {
            pos += 1;
            false
        }
        _ => false,
    };
    if s.get(pos) != Some(&b'P') {
        return Err(err("a duration starts with 'P'"));
    }
    pos += 1;
    if s.get(pos) != Some(&b'T') {
        return match s.get(pos) {
            None => Err(err("a duration needs at least one component")),
            Some(b) if b.is_ascii_digit() => Err(err(
                "years, months, weeks and days are calendar units and are not accepted; use hours, minutes and seconds after 'PT'",
            )),
            Some(_) => Err(err("expected 'T' after 'P'")),
        };
    }
    pos += 1;
    let mut total: i128 = 0;
    // Designators must come in this order, each at most once.
    let mut next_unit = 0usize;
    let mut components = 0;
    while pos < s.len() {
        let start = pos;
        let mut whole: i128 = 0;
        while let Some(&b) = s.get(pos) {
            if !b.is_ascii_digit() {
                break;
            }
            whole = whole * 10 + i128::from(b - b'0');
            if whole > i128::from(i64::MAX) {
                return Err(err("outside the range of 64-bit nanoseconds"));
            }
            pos += 1;
        }
        if pos == start {
            return Err(err("expected digits before a unit designator"));
        }
        let mut frac: Option<i128> = None;
        if matches!(s.get(pos), Some(b'.' | b',')) {
            if s[pos] == b',' {
                return Err(err("use '.' as the decimal separator"));
            }
            let (n, next) = fraction(s, pos + 1).map_err(err)?;
            frac = Some(n);
            pos = next;
        }
        let (unit_index, scale) = match s.get(pos) {
            Some(b'H') => (0, 3600 * NANOS_PER_SECOND),
            Some(b'M') => (1, 60 * NANOS_PER_SECOND),
            Some(b'S') => (2, NANOS_PER_SECOND),
            Some(b'D' | b'W' | b'Y') => {
                return Err(err(
                    "days, weeks and years are calendar units and are not accepted",
                ));
            }
            Some(b'h' | b'm' | b's') => return Err(err("unit designators must be upper case")),
            None => return Err(err("a number must end with a unit designator (H, M or S)")),
            Some(_) => return Err(err("unknown unit designator; expected H, M or S")),
        };
        if unit_index < next_unit {
            return Err(err(
                "components must be in the order H, M, S, each at most once",
            ));
        }
        if frac.is_some() && unit_index != 2 {
            return Err(err("only seconds may have a fraction"));
        }
        next_unit = unit_index + 1;
        components += 1;
        total += whole * scale + frac.unwrap_or(0);
        if total > i128::from(i64::MAX) + 1 {
            return Err(err("outside the range of 64-bit nanoseconds"));
        }
        pos += 1;
    }
    if components == 0 {
        return Err(err("a duration needs at least one component after 'PT'"));
    }
    let signed = if negative { -total } else { total };
    i64::try_from(signed).map_err(|_| err("outside the range of 64-bit nanoseconds"))
}

/// Formats signed nanoseconds as an ISO 8601 duration: `[-]PT[nH][nM][n[.f]S]`, minutes and
/// seconds below 60, zero components left out, `PT0S` for zero. This is the statements API's
/// cell form.
///
/// ```
/// use sluice::types::temporal::format_interval;
/// assert_eq!(format_interval(3_723_000_000_004), "PT1H2M3.000000004S");
/// assert_eq!(format_interval(0), "PT0S");
/// ```
pub fn format_interval(nanos: i64) -> String {
    let mut out = String::with_capacity(24);
    write_interval(&mut out, nanos);
    out
}

/// Appends [`format_interval`]'s text to `out`.
pub(crate) fn write_interval(out: &mut String, nanos: i64) {
    if nanos < 0 {
        out.push('-');
    }
    let magnitude = nanos.unsigned_abs();
    let total_seconds = magnitude / 1_000_000_000;
    let sub = (magnitude % 1_000_000_000) as u32;
    let (hours, minutes, seconds) = (
        total_seconds / 3600,
        total_seconds / 60 % 60,
        total_seconds % 60,
    );
    out.push_str("PT");
    if hours > 0 {
        let _ = write!(out, "{hours}H");
    }
    if minutes > 0 {
        let _ = write!(out, "{minutes}M");
    }
    if seconds > 0 || sub > 0 || (hours == 0 && minutes == 0) {
        let _ = write!(out, "{seconds}");
        write_fraction(out, sub);
        out.push('S');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn intervals_are_hours_minutes_seconds() {
        assert_eq!(
            parse_interval(b"PT1H2M3.000000004S").unwrap(),
            3_723_000_000_004
        );
        assert_eq!(parse_interval(b"-PT0.5S").unwrap(), -500_000_000);
        assert!(parse_interval(b"P1D").is_err());
    }

    #[test]
    fn timestamps_are_rfc3339_with_an_offset() {
        assert_eq!(
            parse_timestamp(b"1970-01-01T00:00:01.5Z").unwrap(),
            1_500_000_000
        );
        assert_eq!(parse_timestamp(b"1970-01-01T01:00:00+01:00").unwrap(), 0);
        assert!(parse_timestamp(b"2026-10-23").is_err());
    }

    #[test]
    fn civil_round_trip() {
        for days in [-106_752, -719_468, -1, 0, 1, 59, 365, 20_000, 106_751] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
        }
    }

    #[test]
    fn extremes() {
        assert_eq!(
            parse_timestamp(b"2262-04-11T23:47:16.854775807Z").unwrap(),
            i64::MAX
        );
        assert!(parse_timestamp(b"2262-04-11T23:47:16.854775808Z").is_err());
        assert_eq!(
            parse_timestamp(b"1677-09-21T00:12:43.145224192Z").unwrap(),
            i64::MIN
        );
        assert!(parse_timestamp(b"1677-09-21T00:12:43.145224191Z").is_err());
        assert_eq!(format_timestamp(i64::MIN), "1677-09-21T00:12:43.145224192Z");
        assert_eq!(format_timestamp(i64::MAX), "2262-04-11T23:47:16.854775807Z");
        assert_eq!(
            parse_interval(b"PT9223372036.854775807S").unwrap(),
            i64::MAX
        );
        assert_eq!(
            parse_interval(b"-PT9223372036.854775808S").unwrap(),
            i64::MIN
        );
        assert!(parse_interval(b"PT9223372036.854775808S").is_err());
        assert_eq!(format_interval(i64::MIN), "-PT2562047H47M16.854775808S");
    }
}
