//! The statement classifier on arbitrary text: it runs the depth check, the catalog-statement
//! and ScopeQL parsers and DataFusion's SQL parser, and must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = sluice::query::statement_access(text);
    }
});
