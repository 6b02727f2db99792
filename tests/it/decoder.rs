//! Table-driven tests of the typed NDJSON decoder: every column rule of the ingest contract with
//! accepted and rejected cases, the row rules, the body forms, the limits and the storage form.

use std::io::Write as _;

use arrow_array::RecordBatch;
use sluice::ingest::{ContentEncoding, Decoder, IngestError, Limits, RowErrors, decompress};
use sluice::types::cell::format_cell;
use sluice::types::{Column, ColumnType};

use ColumnType::*;

/// What one value in a one-column table should become.
enum Expect {
    /// Accepted; the cell form of the stored value.
    Cell(&'static str),
    /// Accepted as SQL NULL.
    Null,
    /// Rejected; the row error's message contains this text.
    Reject(&'static str),
}
use Expect::*;

fn decode_one(column_type: ColumnType, value: &str) -> Result<RecordBatch, IngestError> {
    let decoder = Decoder::new(&[Column::new("v", column_type)]);
    decoder.decode(
        format!("{{\"v\":{value}}}\n").as_bytes(),
        &Limits::default(),
    )
}

fn row_errors(result: Result<RecordBatch, IngestError>) -> RowErrors {
    match result {
        Err(IngestError::InvalidRows(errors)) => errors,
        Err(other) => panic!("expected row errors, got {other:?}"),
        Ok(batch) => panic!("expected row errors, got {} rows", batch.num_rows()),
    }
}

const CASES: &[(ColumnType, &str, Expect)] = &[
    // int: integer tokens in the signed 64-bit range only.
    (Int, "42", Cell("42")),
    (Int, "-0", Cell("0")),
    (Int, "9223372036854775807", Cell("9223372036854775807")),
    (Int, "-9223372036854775808", Cell("-9223372036854775808")),
    (Int, "9223372036854775808", Reject("out of range")),
    (Int, "-9223372036854775809", Reject("out of range")),
    (Int, "42.0", Reject("integer token")),
    (Int, "42e0", Reject("integer token")),
    (Int, "\"42\"", Reject("found a string")),
    (Int, "true", Reject("found a boolean")),
    (Int, "null", Null),
    // uint: 0 through 9223372036854775807.
    (UInt, "0", Cell("0")),
    (UInt, "9223372036854775807", Cell("9223372036854775807")),
    (
        UInt,
        "9223372036854775808",
        Reject("out of range 0..=9223372036854775807"),
    ),
    (UInt, "-1", Reject("out of range")),
    (UInt, "1.0", Reject("integer token")),
    (UInt, "\"1\"", Reject("found a string")),
    // float: finite; integer tokens exact; no overflow; no non-zero underflow.
    (Float, "1.5", Cell("1.5")),
    (Float, "-2.5e-3", Cell("-0.0025")),
    (Float, "1e300", Cell("1e300")),
    (Float, "42", Cell("42")),
    (Float, "9007199254740992", Cell("9007199254740992")),
    (
        Float,
        "9007199254740993",
        Reject("cannot represent exactly"),
    ),
    (Float, "1e309", Reject("overflows")),
    (Float, "-1e309", Reject("overflows")),
    (Float, "1e-400", Reject("underflows to zero")),
    (Float, "0e-400", Cell("0")),
    (Float, "0.1", Cell("0.1")),
    (Float, "\"1.5\"", Reject("found a string")),
    (Float, "NaN", Reject("invalid JSON")),
    // boolean: JSON booleans only.
    (Boolean, "true", Cell("true")),
    (Boolean, "false", Cell("false")),
    (Boolean, "\"true\"", Reject("found a string")),
    (Boolean, "1", Reject("found a number")),
    // string: JSON strings only, escapes decoded.
    (String, "\"hello\"", Cell("hello")),
    (
        String,
        r#""a\"b\\c\/d\n\u00e9\ud83d\ude00""#,
        Cell("a\"b\\c/d\né😀"),
    ),
    (String, "\"\"", Cell("")),
    (String, "42", Reject("found a number")),
    (String, "{\"a\":1}", Reject("found an object")),
    (String, r#""\ud800""#, Reject("unpaired surrogate")),
    (String, "\"tab\there\"", Reject("control character")),
    (String, r#""\x41""#, Reject("invalid escape")),
    // timestamp: RFC 3339 with T and an explicit offset, <= 9 fraction digits, fits i64 ns.
    (
        Timestamp,
        "\"2026-10-23T09:00:00Z\"",
        Cell("2026-10-23T09:00:00Z"),
    ),
    (
        Timestamp,
        "\"2026-10-23T11:30:00+02:30\"",
        Cell("2026-10-23T09:00:00Z"),
    ),
    (
        Timestamp,
        "\"2026-10-23T09:00:00.123456789-01:00\"",
        Cell("2026-10-23T10:00:00.123456789Z"),
    ),
    (
        Timestamp,
        "\"2026-10-23t09:00:00.5z\"",
        Cell("2026-10-23T09:00:00.5Z"),
    ),
    (
        Timestamp,
        "\"2024-02-29T00:00:00Z\"",
        Cell("2024-02-29T00:00:00Z"),
    ),
    (
        Timestamp,
        "\"2023-02-29T00:00:00Z\"",
        Reject("day does not exist"),
    ),
    (Timestamp, "\"2026-10-23\"", Reject("date without a time")),
    (
        Timestamp,
        "\"2026-10-23T09:00:00\"",
        Reject("missing time zone offset"),
    ),
    (
        Timestamp,
        "\"2026-10-23 09:00:00Z\"",
        Reject("separated by 'T'"),
    ),
    (
        Timestamp,
        "\"2026-10-23T09:00:00.1234567891Z\"",
        Reject("nine fractional"),
    ),
    (
        Timestamp,
        "\"2026-10-23T09:00:00.Z\"",
        Reject("followed by digits"),
    ),
    (Timestamp, "\"2026-10-23T24:00:00Z\"", Reject("hour")),
    (
        Timestamp,
        "\"2026-10-23T23:59:60Z\"",
        Reject("leap seconds"),
    ),
    (
        Timestamp,
        "\"2026-10-23T09:00:00+24:00\"",
        Reject("offset out of range"),
    ),
    (Timestamp, "\"2026-10-23T09:00:00+0200\"", Reject("±HH:MM")),
    (
        Timestamp,
        "\"2262-04-12T00:00:00Z\"",
        Reject("range of 64-bit nanoseconds"),
    ),
    (
        Timestamp,
        "\"1677-09-21T00:00:00Z\"",
        Reject("range of 64-bit nanoseconds"),
    ),
    (Timestamp, "\"1700000000\"", Reject("numeric epochs")),
    (Timestamp, "1700000000", Reject("found a number")),
    // interval: fixed ISO 8601 durations of hours, minutes and seconds.
    (
        Interval,
        "\"PT1H2M3.000000004S\"",
        Cell("PT1H2M3.000000004S"),
    ),
    (Interval, "\"PT90M\"", Cell("PT1H30M")),
    (Interval, "\"PT0S\"", Cell("PT0S")),
    (Interval, "\"-PT1.5S\"", Cell("-PT1.5S")),
    (Interval, "\"PT36H\"", Cell("PT36H")),
    (Interval, "\"P1D\"", Reject("calendar units")),
    (Interval, "\"P1Y\"", Reject("calendar units")),
    (Interval, "\"PT1D\"", Reject("calendar units")),
    (Interval, "\"P1M\"", Reject("calendar units")),
    (Interval, "\"PT\"", Reject("at least one component")),
    (
        Interval,
        "\"PT1.5H\"",
        Reject("only seconds may have a fraction"),
    ),
    (Interval, "\"PT0.1234567891S\"", Reject("nine fractional")),
    (Interval, "\"PT1S2M\"", Reject("order")),
    (
        Interval,
        "\"PT2562048H\"",
        Reject("range of 64-bit nanoseconds"),
    ),
    (Interval, "\"1h\"", Reject("starts with 'P'")),
    (Interval, "3600", Reject("found a number")),
    // binary: canonical padded standard base64.
    (Binary, "\"aGVsbG8=\"", Cell("68656c6c6f")),
    (Binary, "\"\"", Cell("")),
    (Binary, "\"+/8=\"", Cell("fbff")),
    (Binary, "\"aGVsbG8\"", Reject("base64")),
    (Binary, "\"aGVsbG9=\"", Reject("base64")),
    (Binary, "\"-_8=\"", Reject("base64")),
    (Binary, "\"aGVs bG8=\"", Reject("base64")),
    (Binary, "[104]", Reject("found an array")),
    // object: a JSON object, not a string holding one; compact text, order and spelling kept.
    (
        Object,
        r#"{ "b" : 1.50, "a" : [ true , null ] }"#,
        Cell(r#"{"b":1.50,"a":[true,null]}"#),
    ),
    (Object, "{}", Cell("{}")),
    (Object, r#"{"s":"x\u0041\n"}"#, Cell(r#"{"s":"x\u0041\n"}"#)),
    (Object, r#""{\"a\":1}""#, Reject("found a string")),
    (Object, "[1]", Reject("found an array")),
    (
        Object,
        r#"{"a":1,"a":2}"#,
        Reject("duplicate object key \"a\""),
    ),
    (
        Object,
        r#"{"a":{"b":1,"\u0062":2}}"#,
        Reject("duplicate object key \"b\""),
    ),
    (
        Object,
        r#"{"a":9223372036854775808}"#,
        Reject("outside the signed 64-bit range"),
    ),
    (
        Object,
        r#"{"a":-9223372036854775808}"#,
        Cell(r#"{"a":-9223372036854775808}"#),
    ),
    // array: any JSON array, mixed element types.
    (
        Array,
        r#"[1, "a", {"k": null}, [], 2.5e3]"#,
        Cell(r#"[1,"a",{"k":null},[],2.5e3]"#),
    ),
    (Array, "[]", Cell("[]")),
    (Array, "{}", Reject("found an object")),
    (
        Array,
        r#"[[{"x":1,"x":1}]]"#,
        Reject("duplicate object key"),
    ),
    (
        Array,
        "[18446744073709551616]",
        Reject("outside the signed 64-bit range"),
    ),
    (Array, "[1,]", Reject("invalid JSON")),
    // any: every JSON kind, kept as written.
    (
        Any,
        r#""2026-10-23T09:00:00Z""#,
        Cell(r#""2026-10-23T09:00:00Z""#),
    ),
    (Any, "12", Cell("12")),
    (Any, "1.0e+2", Cell("1.0e+2")),
    (Any, "false", Cell("false")),
    (Any, r#"[ null ]"#, Cell("[null]")),
    (
        Any,
        r#"{"a":[1,{"b":null}]}"#,
        Cell(r#"{"a":[1,{"b":null}]}"#),
    ),
    (Any, "null", Null),
    (
        Any,
        "99999999999999999999",
        Reject("outside the signed 64-bit range"),
    ),
    (Any, r#"{"k":1,"k":1}"#, Reject("duplicate object key")),
];

#[test]
fn every_column_rule() {
    let mut failures = Vec::new();
    for (column_type, input, expect) in CASES {
        let result = decode_one(*column_type, input);
        let outcome = match (&result, expect) {
            (Ok(batch), Cell(want)) => {
                let got = format_cell(batch.column(0), 0);
                (got.as_deref() == Some(*want))
                    .then_some(())
                    .ok_or(format!("cell {got:?}, want {want:?}"))
            }
            (Ok(batch), Null) => batch
                .column(0)
                .is_null(0)
                .then_some(())
                .ok_or("not null".into()),
            (Err(IngestError::InvalidRows(e)), Reject(want)) => {
                let first = &e.errors[0];
                if e.errors.len() == 1
                    && first.row_index == 0
                    && first.column.as_deref() == Some("v")
                    && first.message.contains(want)
                {
                    Ok(())
                } else {
                    Err(format!(
                        "errors {:?}, want one for column v containing {want:?}",
                        e.errors
                    ))
                }
            }
            (other, _) => Err(format!(
                "unexpected outcome {:?}",
                other.as_ref().map(|b| b.num_rows())
            )),
        };
        if let Err(why) = outcome {
            failures.push(format!("{column_type} {input}: {why}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{} failing cases:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_type_has_an_accepted_and_a_rejected_case() {
    for t in ColumnType::ALL {
        assert!(
            CASES
                .iter()
                .any(|(ct, _, e)| *ct == t && matches!(e, Cell(_))),
            "{t} accepted"
        );
        assert!(
            CASES
                .iter()
                .any(|(ct, _, e)| *ct == t && matches!(e, Reject(_))),
            "{t} rejected"
        );
    }
}

fn events_decoder() -> Decoder {
    Decoder::new(&[
        Column::new("time", Timestamp),
        Column::new("service", String),
        Column::new("n", Int),
        Column::new("var", Object),
        Column::computed("day", Timestamp),
    ])
}

#[test]
fn missing_and_null_columns_are_null_but_nested_nulls_stay_json() {
    let body = b"{\"n\":1}\n{\"n\":null,\"service\":null,\"var\":{\"x\":null}}\n";
    let batch = events_decoder().decode(body, &Limits::default()).unwrap();
    assert_eq!(batch.num_rows(), 2);
    assert_eq!(batch.num_columns(), 4, "computed columns are not decoded");
    for column in 0..4 {
        assert!(batch.column(column).is_null(0) || column == 2);
    }
    assert_eq!(format_cell(batch.column(2), 0).as_deref(), Some("1"));
    assert!(batch.column(2).is_null(1));
    assert!(batch.column(1).is_null(1));
    assert_eq!(
        format_cell(batch.column(3), 1).as_deref(),
        Some(r#"{"x":null}"#)
    );
}

#[test]
fn unknown_duplicate_and_computed_fields_reject_the_request() {
    let body = b"{\"n\":1,\"extra\":2}\n{\"n\":1,\"n\":2}\n{\"day\":\"2026-10-23T00:00:00Z\"}\n{\"\\u006e\":1,\"n\":3}\n";
    let errors = row_errors(events_decoder().decode(body, &Limits::default()));
    let summary: Vec<(usize, Option<&str>)> = errors
        .errors
        .iter()
        .map(|e| (e.row_index, e.column.as_deref()))
        .collect();
    assert_eq!(
        summary,
        vec![
            (0, Some("extra")),
            (1, Some("n")),
            (2, Some("day")),
            (3, Some("n"))
        ]
    );
    assert!(errors.errors[0].message.contains("unknown field"));
    assert!(errors.errors[1].message.contains("duplicate"));
    assert!(errors.errors[2].message.contains("computed column"));
    assert!(!errors.truncated);
}

#[test]
fn body_forms_ndjson_crlf_blank_lines_and_glued_values() {
    let decoder = Decoder::new(&[Column::new("a", Int)]);
    let limits = Limits::default();
    for body in [
        &b"{\"a\":1}\n{\"a\":2}\n{\"a\":3}"[..],
        b"{\"a\":1}\r\n{\"a\":2}\r\n\r\n\n{\"a\":3}\r\n",
        b"\n\n{\"a\":1}\n\n{\"a\":2}\n{\"a\":3}\n\n",
        b"{\"a\":1}{\"a\":2}{\"a\":3}",
        b"  {\"a\":1} {\"a\" : 2}\t{ \"a\":3 }  ",
    ] {
        let batch = decoder.decode(body, &limits).unwrap();
        let cells: Vec<_> = (0..batch.num_rows())
            .map(|r| format_cell(batch.column(0), r))
            .collect();
        assert_eq!(
            cells,
            vec![Some("1".into()), Some("2".into()), Some("3".into())],
            "{body:?}"
        );
    }
    assert_eq!(decoder.decode(b"", &limits).unwrap().num_rows(), 0);
    assert_eq!(decoder.decode(b"\n\r\n", &limits).unwrap().num_rows(), 0);
}

#[test]
fn non_object_rows_and_broken_json_are_row_errors_with_zero_based_row_index() {
    let decoder = Decoder::new(&[Column::new("a", Int)]);
    // Blank lines are not rows: the broken row is the third row (index 2).
    let body = b"{\"a\":1}\n\n[1,2]\n{\"a\":[1,}\n{\"a\":4}\n\"text\"\n{\"a\":1,,}\n{\"a\":5";
    let errors = row_errors(decoder.decode(body, &Limits::default()));
    let summary: Vec<(usize, Option<&str>)> = errors
        .errors
        .iter()
        .map(|e| (e.row_index, e.column.as_deref()))
        .collect();
    assert_eq!(
        summary,
        vec![(1, None), (2, Some("a")), (4, None), (5, None), (6, None)]
    );
    assert!(
        errors.errors[0]
            .message
            .contains("must be a JSON object, found an array")
    );
    assert!(
        errors.errors[1]
            .message
            .contains("invalid JSON: unexpected character '}'")
    );
    assert!(errors.errors[2].message.contains("found a string"));
    assert!(
        errors.errors[3]
            .message
            .contains("unexpected character ','")
    );
    assert!(errors.errors[4].message.contains("unexpected end of input"));
}

#[test]
fn row_errors_are_capped_and_flagged_truncated() {
    let decoder = Decoder::new(&[Column::new("a", Int)]);
    let body = "{\"a\":\"x\"}\n".repeat(150);
    let errors = row_errors(decoder.decode(body.as_bytes(), &Limits::default()));
    assert_eq!(errors.errors.len(), 100);
    assert!(errors.truncated);
    assert_eq!(errors.errors[99].row_index, 99);

    let exactly = "{\"a\":\"x\"}\n".repeat(100);
    let errors = row_errors(decoder.decode(exactly.as_bytes(), &Limits::default()));
    assert_eq!(errors.errors.len(), 100);
    assert!(!errors.truncated);

    let small_cap = Limits {
        max_row_errors: 2,
        ..Limits::default()
    };
    let errors = row_errors(decoder.decode(body.as_bytes(), &small_cap));
    assert_eq!(errors.errors.len(), 2);
    assert!(errors.truncated);
}

#[test]
fn all_or_nothing_one_bad_row_rejects_every_row() {
    let decoder = Decoder::new(&[Column::new("a", Int)]);
    let mut body = "{\"a\":1}\n".repeat(1000);
    body.push_str("{\"a\":1.5}\n");
    let errors = row_errors(decoder.decode(body.as_bytes(), &Limits::default()));
    assert_eq!(errors.errors.len(), 1);
    assert_eq!(errors.errors[0].row_index, 1000);
}

#[test]
fn row_and_byte_limits() {
    let decoder = Decoder::new(&[Column::new("a", Int)]);
    let limits = Limits {
        max_rows: 3,
        ..Limits::default()
    };
    assert_eq!(
        decoder
            .decode(b"{\"a\":1}\n{}\n{}\n", &limits)
            .unwrap()
            .num_rows(),
        3
    );
    assert_eq!(
        decoder
            .decode(b"{\"a\":1}\n{}\n{}\n{}\n", &limits)
            .unwrap_err(),
        IngestError::TooManyRows { limit: 3 }
    );
    let limits = Limits {
        max_body_bytes: 10,
        ..Limits::default()
    };
    assert_eq!(
        decoder
            .decode(b"{\"a\":1}\n{\"a\":1}\n", &limits)
            .unwrap_err(),
        IngestError::BodyTooLarge { limit: 10 }
    );
    // The contract's defaults.
    assert_eq!(Limits::default().max_body_bytes, 16 * 1024 * 1024);
    assert_eq!(Limits::default().max_rows, 200_000);
    let many = "{}\n".repeat(200_001);
    assert_eq!(
        decoder
            .decode(many.as_bytes(), &Limits::default())
            .unwrap_err(),
        IngestError::TooManyRows { limit: 200_000 }
    );
}

#[test]
fn invalid_utf8_is_a_row_error_in_its_row() {
    let decoder = Decoder::new(&[Column::new("s", String), Column::new("o", Any)]);
    let body = b"{\"s\":\"ok\"}\n{\"s\":\"bad \xff byte\"}\n{\"o\":\"also \xc3\x28 bad\"}\n";
    let errors = row_errors(decoder.decode(body, &Limits::default()));
    let summary: Vec<(usize, Option<&str>)> = errors
        .errors
        .iter()
        .map(|e| (e.row_index, e.column.as_deref()))
        .collect();
    assert_eq!(summary, vec![(1, Some("s")), (2, Some("o"))]);
    assert!(errors.errors[0].message.contains("invalid UTF-8"));
}

#[test]
fn nesting_is_limited() {
    let deep = format!("{{\"v\":{}{}}}", "[".repeat(127), "]".repeat(127));
    let decoder = Decoder::new(&[Column::new("v", Any)]);
    assert_eq!(
        decoder
            .decode(deep.as_bytes(), &Limits::default())
            .unwrap()
            .num_rows(),
        1
    );
    let too_deep = format!("{{\"v\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000));
    let errors = row_errors(decoder.decode(too_deep.as_bytes(), &Limits::default()));
    assert!(errors.errors[0].message.contains("nested deeper than 127"));
}

#[test]
fn arrow_schema_and_metadata() {
    let batch = events_decoder()
        .decode(
            b"{\"time\":\"2026-10-23T09:00:00Z\",\"var\":{}}",
            &Limits::default(),
        )
        .unwrap();
    let schema = batch.schema();
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    assert_eq!(names, vec!["time", "service", "n", "var"]);
    for t in ColumnType::ALL {
        let field = t.arrow_field("c");
        assert_eq!(ColumnType::from_field(&field), Some(t));
        assert_eq!(field.data_type(), &t.arrow_type());
        assert_eq!(
            field
                .metadata()
                .get("ARROW:extension:name")
                .map(std::string::String::as_str),
            t.is_json().then_some("arrow.json")
        );
    }
    assert_eq!(
        schema.field(0).data_type().to_string(),
        "Timestamp(ns, \"UTC\")",
    );
}

#[test]
fn compressed_bodies_decode_after_bounded_decompression() {
    let decoder = Decoder::new(&[Column::new("a", Int)]);
    let body = "{\"a\":7}\n".repeat(1000);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(body.as_bytes()).unwrap();
    let gz = gz.finish().unwrap();
    let zst = zstd::encode_all(body.as_bytes(), 3).unwrap();
    for (encoding, packed) in [(ContentEncoding::Gzip, gz), (ContentEncoding::Zstd, zst)] {
        let plain = decompress(&packed, encoding, Limits::default().max_body_bytes).unwrap();
        assert_eq!(
            decoder
                .decode(&plain, &Limits::default())
                .unwrap()
                .num_rows(),
            1000
        );
        assert_eq!(
            decompress(&packed, encoding, body.len() - 1),
            Err(IngestError::BodyTooLarge {
                limit: body.len() - 1
            })
        );
    }
}

/// A body of about `rows * 40` bytes whose rows are all valid.
fn big_body(rows: usize) -> std::string::String {
    (0..rows)
        .map(|i| format!("{{\"a\":{i},\"s\":\"row {i}\",\"o\":{{\"k\":[{i}]}}}}\n"))
        .collect()
}

#[test]
fn parallel_decoding_matches_sequential_for_good_and_bad_bodies() {
    let columns = [
        Column::new("a", Int),
        Column::new("s", String),
        Column::new("o", Object),
    ];
    let sequential = Decoder::new(&columns).with_parallelism(1);
    let parallel = Decoder::new(&columns).with_parallelism(4);
    let limits = Limits {
        max_body_bytes: 64 << 20,
        max_rows: 1 << 20,
        ..Limits::default()
    };
    // About 10 MiB: split into several chunks.
    let good = big_body(250_000);
    let a = sequential.decode(good.as_bytes(), &limits).unwrap();
    let b = parallel.decode(good.as_bytes(), &limits).unwrap();
    assert_eq!(a, b);
    assert_eq!(b.num_rows(), 250_000);

    // Errors late in the body (a later chunk) report the same rows as a one-piece decode.
    let mut bad = good.clone();
    bad.push_str("{\"a\":\"late\"}\n");
    bad.push_str(&big_body(10));
    let middle = good[good.len() / 2..].find('\n').unwrap() + good.len() / 2 + 1;
    bad.insert_str(middle, "{\"a\":1,\"zz\":0}\n");
    let a = sequential.decode(bad.as_bytes(), &limits).unwrap_err();
    let b = parallel.decode(bad.as_bytes(), &limits).unwrap_err();
    assert_eq!(a, b);
    let errors = row_errors(Err(b));
    assert_eq!(errors.errors.len(), 2);
    assert_eq!(errors.errors[1].row_index, 250_001);

    // The row limit holds across chunks.
    let few = Limits {
        max_rows: 249_999,
        ..limits
    };
    assert_eq!(
        parallel.decode(good.as_bytes(), &few).unwrap_err(),
        IngestError::TooManyRows { limit: 249_999 }
    );
}
