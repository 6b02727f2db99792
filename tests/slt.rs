//! Query tests in a sqllogictest-style format: every `testdata/queries/*.slt` file runs against
//! a fresh database, SQL and ScopeQL side by side over the same data.
//!
//! ```text
//! statement ok            a statement that must succeed
//! <statement>
//!
//! ingest <table>          NDJSON rows appended to scopedb.public.<table>
//! <rows>
//!
//! query [rowsort]         a statement and its rows: cells joined by '|', NULL for null
//! <statement>
//! ----
//! <rows>
//!
//! query error <text>      a statement that must fail with <text> in its message
//! <statement>
//! ```
//! Blocks are separated by blank lines; lines starting with `#` are comments.

use std::path::Path;

use sluice::db::{Database, DbConfig};
use sluice::ingest::ContentEncoding;

struct Block {
    line: usize,
    header: String,
    body: Vec<String>,
    expected: Option<Vec<String>>,
}

fn blocks(text: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut current: Option<Block> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim_end();
        if line.starts_with('#') {
            continue;
        }
        if line.is_empty() {
            out.extend(current.take());
            continue;
        }
        match &mut current {
            None => {
                current = Some(Block {
                    line: i + 1,
                    header: line.to_owned(),
                    body: Vec::new(),
                    expected: None,
                })
            }
            Some(b) if line == "----" => b.expected = Some(Vec::new()),
            Some(b) => match &mut b.expected {
                Some(rows) => rows.push(line.to_owned()),
                None => b.body.push(line.to_owned()),
            },
        }
    }
    out.extend(current);
    out
}

async fn run_file(path: &Path) -> Vec<String> {
    let dir = std::env::temp_dir().join(format!(
        "sluice-slt-{}-{}",
        std::process::id(),
        path.file_stem().unwrap().to_string_lossy()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let text = std::fs::read_to_string(path).unwrap();
    let mut failures = Vec::new();
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    for block in blocks(&text) {
        let at = format!("{name}:{}", block.line);
        let statement = block.body.join("\n");
        let words: Vec<&str> = block.header.split_whitespace().collect();
        match words.as_slice() {
            ["statement", "ok"] => {
                if let Err(e) = db.execute(&statement).await {
                    failures.push(format!("{at}: statement failed: {e}"));
                }
            }
            ["ingest", table] => {
                let body = bytes::Bytes::from(format!("{statement}\n"));
                if let Err(e) = db
                    .ingest("scopedb", "public", table, body, ContentEncoding::Identity)
                    .await
                {
                    failures.push(format!("{at}: ingest failed: {e}"));
                }
            }
            ["query", "error", rest @ ..] => match db.execute(&statement).await {
                Ok(_) => failures.push(format!("{at}: expected an error, the statement succeeded")),
                Err(e) => {
                    let want = rest.join(" ");
                    if !e.to_string().contains(&want) {
                        failures.push(format!("{at}: error {e:?} does not contain {want:?}"));
                    }
                }
            },
            ["query", mode @ ..] => match db.execute(&statement).await {
                Err(e) => failures.push(format!("{at}: query failed: {e}")),
                Ok(result) => {
                    let mut got: Vec<String> = result
                        .rows
                        .iter()
                        .map(|row| {
                            row.iter()
                                .map(|c| c.clone().unwrap_or_else(|| "NULL".into()))
                                .collect::<Vec<_>>()
                                .join("|")
                        })
                        .collect();
                    let mut want = block.expected.clone().unwrap_or_default();
                    if mode == ["rowsort"] {
                        got.sort();
                        want.sort();
                    }
                    if got != want {
                        failures.push(format!(
                            "{at}: rows differ\n  want: {want:?}\n  got:  {got:?}"
                        ));
                    }
                }
            },
            _ => failures.push(format!("{at}: unknown block header {:?}", block.header)),
        }
    }
    failures
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_files() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/queries");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "slt"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .slt files in {}", dir.display());
    let mut failures = Vec::new();
    for f in &files {
        failures.extend(run_file(f).await);
    }
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
