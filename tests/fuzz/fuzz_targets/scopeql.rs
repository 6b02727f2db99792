//! The statement classifier on arbitrary text: it runs the catalog-statement and ScopeQL
//! parsers and the SQL keyword scan, and must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::query::QueryEngine;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = QueryEngine::access(text);
    }
});
