//! The commit-log reader on an arbitrary segment file: opening either repairs a torn tail or
//! refuses with an error, never panics, and what it returns re-opens identically.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::log::{CommitLog, LogConfig};

fuzz_target!(|data: &[u8]| {
    let dir = std::env::temp_dir().join(format!("sluice-fuzz-log-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("00000000000000000001.log"), data).unwrap();
    let mut config = LogConfig::new(&dir);
    config.durability = sluice::log::Durability::None;
    if let Ok((log, records)) = CommitLog::open(config.clone()) {
        log.close();
        let (again, records_again) = CommitLog::open(config).expect("a repaired log re-opens");
        again.close();
        assert_eq!(records, records_again);
    }
});
