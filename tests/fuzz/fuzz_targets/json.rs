//! The JSON scanner on arbitrary bytes: compaction is idempotent and its output is valid JSON.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::types::json::compact;

fuzz_target!(|data: &[u8]| {
    if let Ok(once) = compact(data) {
        let twice = compact(&once).expect("compact output is valid JSON");
        assert_eq!(once, twice);
        assert!(std::str::from_utf8(&once).is_ok());
    }
});
