//! The stream JSON message validator on arbitrary bytes: it never panics, and what it accepts
//! re-validates to the same messages (compaction is idempotent, messages are valid JSON text).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::stream::json::split_messages;

fuzz_target!(|data: &[u8]| {
    if let Ok(messages) = split_messages(data) {
        for m in messages {
            let again = split_messages(&m).expect("an accepted message is valid JSON");
            // A message that is itself an array is split again; anything else is kept whole.
            if m.first() != Some(&b'[') {
                assert_eq!(again, vec![m]);
            }
        }
    }
});
