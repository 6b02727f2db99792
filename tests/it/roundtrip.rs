//! Round-trip properties: any accepted row, read back from the batch and printed in the
//! statements API's cell form, equals the canonical form of its input.
//!
//! Each generator yields a value's canonical form and one of the many JSON spellings that
//! denote it (other offsets, padded fractions, escapes, whitespace); the decoder must map every
//! spelling to the canonical form.

use proptest::prelude::*;
use sluice::ingest::{Decoder, Limits};
use sluice::types::cell::format_cell;
use sluice::types::number::format_float;
use sluice::types::temporal::{format_interval, format_timestamp};
use sluice::types::{Column, ColumnType, encode_base64};

/// A JSON spelling of a value and the cell form it must come back as.
#[derive(Debug, Clone)]
struct Case {
    json: String,
    cell: String,
}

/// Writes a JSON string literal for `s`, escaping some characters that need no escape when
/// `escape_mask` says so (a different spelling of the same string).
fn json_string(s: &str, escape_mask: u64) -> String {
    let mut out = String::from("\"");
    for (i, c) in s.chars().enumerate() {
        let force = escape_mask >> (i % 64) & 1 == 1;
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 || force => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn int_case() -> impl Strategy<Value = Case> {
    any::<i64>().prop_map(|v| Case {
        json: v.to_string(),
        cell: v.to_string(),
    })
}

fn uint_case() -> impl Strategy<Value = Case> {
    (0..=i64::MAX).prop_map(|v| Case {
        json: v.to_string(),
        cell: v.to_string(),
    })
}

fn float_case() -> impl Strategy<Value = Case> {
    (
        any::<f64>().prop_filter("finite", |f| f.is_finite()),
        any::<bool>(),
    )
        .prop_map(|(f, exp)| {
            // Two spellings: the canonical one and exponent notation.
            let json = if exp {
                format!("{f:e}")
            } else {
                format_float(f)
            };
            Case {
                json,
                cell: format_float(f),
            }
        })
}

fn bool_case() -> impl Strategy<Value = Case> {
    any::<bool>().prop_map(|b| Case {
        json: b.to_string(),
        cell: b.to_string(),
    })
}

fn string_case() -> impl Strategy<Value = Case> {
    (any::<String>(), any::<u64>()).prop_map(|(s, mask)| Case {
        json: json_string(&s, mask),
        cell: s,
    })
}

fn timestamp_case() -> impl Strategy<Value = Case> {
    // Keep clear of the range ends by a day so that every offset stays representable.
    let day = 86_400_000_000_000i64;
    (
        i64::MIN + day..i64::MAX - day,
        -(23 * 60 + 59)..=(23 * 60 + 59i64),
        0usize..=9,
        any::<bool>(),
    )
        .prop_map(|(nanos, offset_minutes, extra_zeros, lower)| {
            // Spell the instant in local time at the offset, with the fraction padded.
            let local = nanos + offset_minutes * 60_000_000_000;
            let utc_text = format_timestamp(local);
            let (base, frac) = match utc_text.trim_end_matches('Z').split_once('.') {
                Some((b, f)) => (b.to_owned(), f.to_owned()),
                None => (utc_text.trim_end_matches('Z').to_owned(), String::new()),
            };
            let mut frac = frac;
            while !frac.is_empty() && frac.len() < 9 && frac.len() < extra_zeros {
                frac.push('0');
            }
            let sign = if offset_minutes < 0 { '-' } else { '+' };
            let m = offset_minutes.abs();
            let mut text = base;
            if !frac.is_empty() {
                text.push('.');
                text.push_str(&frac);
            }
            if offset_minutes == 0 && lower {
                text.push('Z');
            } else {
                text.push_str(&format!("{sign}{:02}:{:02}", m / 60, m % 60));
            }
            Case {
                json: format!("\"{text}\""),
                cell: format_timestamp(nanos),
            }
        })
}

fn interval_case() -> impl Strategy<Value = Case> {
    (any::<i64>(), any::<bool>()).prop_map(|(nanos, as_seconds)| {
        let canonical = format_interval(nanos);
        let json = if as_seconds {
            // Another spelling: everything in seconds.
            let sign = if nanos < 0 { "-" } else { "" };
            let m = nanos.unsigned_abs();
            format!(
                "\"{sign}PT{}.{:09}S\"",
                m / 1_000_000_000,
                m % 1_000_000_000
            )
        } else {
            format!("\"{canonical}\"")
        };
        Case {
            json,
            cell: canonical,
        }
    })
}

fn binary_case() -> impl Strategy<Value = Case> {
    proptest::collection::vec(any::<u8>(), 0..64).prop_map(|bytes| Case {
        json: format!("\"{}\"", encode_base64(&bytes)),
        cell: bytes.iter().map(|b| format!("{b:02x}")).collect(),
    })
}

/// A JSON value as (spelling with random whitespace, compact canonical text).
fn json_value() -> impl Strategy<Value = (String, String)> {
    let ws = prop_oneof![Just(""), Just(" "), Just("\n "), Just("\t")];
    let leaf = prop_oneof![
        Just(("null".to_owned(), "null".to_owned())),
        any::<bool>().prop_map(|b| (b.to_string(), b.to_string())),
        any::<i64>().prop_map(|i| (i.to_string(), i.to_string())),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| (format!("{f:e}"), format!("{f:e}"))),
        (".{0,8}", any::<u64>()).prop_map(|(s, mask)| {
            let text = json_string(&s, mask);
            (text.clone(), text)
        }),
    ];
    leaf.prop_recursive(4, 32, 6, move |inner| {
        let ws = ws.clone();
        prop_oneof![
            (proptest::collection::vec(inner.clone(), 0..6), ws.clone()).prop_map(|(items, w)| {
                let spelled: Vec<String> =
                    items.iter().map(|(s, _)| format!("{w}{s}{w}")).collect();
                let canon: Vec<String> = items.into_iter().map(|(_, c)| c).collect();
                (
                    format!("[{w}{}]", spelled.join(",")),
                    format!("[{}]", canon.join(",")),
                )
            }),
            (
                proptest::collection::btree_map("[a-z]{1,3}", inner, 0..6),
                ws
            )
                .prop_map(|(members, w)| {
                    let spelled: Vec<String> = members
                        .iter()
                        .map(|(k, (s, _))| format!("{w}\"{k}\"{w}:{w}{s}{w}"))
                        .collect();
                    let canon: Vec<String> = members
                        .into_iter()
                        .map(|(k, (_, c))| format!("\"{k}\":{c}"))
                        .collect();
                    (
                        format!("{{{w}{}}}", spelled.join(",")),
                        format!("{{{}}}", canon.join(",")),
                    )
                }),
        ]
    })
}

fn json_case(column_type: ColumnType) -> impl Strategy<Value = Case> {
    json_value()
        .prop_filter("fits the column", move |(_, canon)| match column_type {
            ColumnType::Object => canon.starts_with('{'),
            ColumnType::Array => canon.starts_with('['),
            // A top-level null is SQL NULL, not JSON text.
            _ => canon != "null",
        })
        .prop_map(|(json, cell)| Case { json, cell })
}

fn case_for(column_type: ColumnType) -> BoxedStrategy<Case> {
    match column_type {
        ColumnType::Int => int_case().boxed(),
        ColumnType::UInt => uint_case().boxed(),
        ColumnType::Float => float_case().boxed(),
        ColumnType::Boolean => bool_case().boxed(),
        ColumnType::String => string_case().boxed(),
        ColumnType::Timestamp => timestamp_case().boxed(),
        ColumnType::Interval => interval_case().boxed(),
        ColumnType::Binary => binary_case().boxed(),
        ColumnType::Object | ColumnType::Array | ColumnType::Any => json_case(column_type).boxed(),
    }
}

/// Rows over a table with one column of every type; each field present, null or missing.
fn rows() -> impl Strategy<Value = Vec<Vec<Option<Option<Case>>>>> {
    let row = ColumnType::ALL
        .iter()
        .map(|t| proptest::option::weighted(0.9, proptest::option::weighted(0.9, case_for(*t))))
        .collect::<Vec<_>>();
    proptest::collection::vec(row, 1..20)
}

fn table() -> Vec<Column> {
    ColumnType::ALL
        .iter()
        .map(|t| Column::new(format!("c_{t}"), *t))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn accepted_rows_read_back_in_canonical_form(rows in rows(), crlf in any::<bool>()) {
        let columns = table();
        let mut body = String::new();
        for row in &rows {
            let fields: Vec<String> = row
                .iter()
                .zip(&columns)
                .filter_map(|(field, column)| match field {
                    None => None,
                    Some(None) => Some(format!("\"{}\":null", column.name)),
                    Some(Some(case)) => Some(format!("\"{}\":{}", column.name, case.json)),
                })
                .collect();
            body.push('{');
            body.push_str(&fields.join(","));
            body.push_str(if crlf { "}\r\n" } else { "}\n" });
        }
        let batch = Decoder::new(&columns)
            .decode(body.as_bytes(), &Limits::default())
            .map_err(|e| TestCaseError::fail(format!("{e:?}\nbody: {body}")))?;
        prop_assert_eq!(batch.num_rows(), rows.len());
        for (r, row) in rows.iter().enumerate() {
            for (c, field) in row.iter().enumerate() {
                let want = match field {
                    Some(Some(case)) => Some(case.cell.clone()),
                    _ => None,
                };
                prop_assert_eq!(format_cell(batch.column(c), r), want, "row {} column {}", r, c);
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Decoder::new(&table()).decode(&body, &Limits::default());
    }

    #[test]
    fn mutated_valid_rows_never_panic(rows in rows(), cut in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let columns = table();
        let mut body = Vec::new();
        for row in &rows {
            let fields: Vec<String> = row.iter().zip(&columns).filter_map(|(f, c)| match f {
                Some(Some(case)) => Some(format!("\"{}\":{}", c.name, case.json)),
                _ => None,
            }).collect();
            body.extend_from_slice(format!("{{{}}}\n", fields.join(",")).as_bytes());
        }
        let at = cut.index(body.len());
        body[at] = byte;
        let _ = Decoder::new(&columns).decode(&body, &Limits::default());
    }
}
