//! The `sluice` command line.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("--version" | "-V") => {
            println!("sluice {}", env!("CARGO_PKG_VERSION"));
            ExitCode::SUCCESS
        }
        _ => {
            eprintln!(
                "sluice {}: the server is not built yet; the library holds the typed NDJSON decoder.\n\
                 usage: sluice --version",
                env!("CARGO_PKG_VERSION")
            );
            ExitCode::from(2)
        }
    }
}
