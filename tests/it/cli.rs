//! The `sluice` command as a client: `ingest`, `query`, `tables` against a real server.

use crate::common;

use std::io::Write as _;
use std::process::Command;

use sluice::db::{Database, DbConfig};

fn sluice(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .env_remove("SLUICE_API_KEY")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_reports_a_rejected_batch_in_the_middle_and_the_rest_lands() {
    let dir = common::temp_dir("cli");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let (addr, _task) = common::serve(db, vec![]).await;
    let endpoint = format!("http://{addr}");
    let e = ["--endpoint", endpoint.as_str()];
    let run = |args: Vec<&str>| {
        let args: Vec<&str> = args.into_iter().chain(e).collect();
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        tokio::task::spawn_blocking(move || {
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            sluice(&refs)
        })
    };
    let (code, out, _) = run(vec!["query", "CREATE TABLE t (a int, s string)"])
        .await
        .unwrap();
    assert_eq!(code, 0, "{out}");
    // 1,000 rows, 10 batches of 100; line 451 is bad, so batch 401-500 is refused whole.
    let file = dir.join("rows.ndjson");
    let mut f = std::fs::File::create(&file).unwrap();
    for i in 0..1000 {
        if i == 450 {
            writeln!(f, "{{\"a\":\"oops\",\"s\":\"x\"}}").unwrap();
        } else {
            writeln!(f, "{{\"a\":{i},\"s\":\"r{i}\"}}").unwrap();
        }
    }
    drop(f);
    let path = file.display().to_string();
    let (code, out, err) = run(vec![
        "ingest",
        &path,
        "--table",
        "scopedb.public.t",
        "--batch-rows",
        "100",
        "--connections",
        "3",
    ])
    .await
    .unwrap();
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains("900 rows committed in 10 batches; 1 rejected; 0 unknown"),
        "{out}"
    );
    assert!(err.contains(&format!("rejected: {path}:401-500")), "{err}");
    assert!(err.contains(&format!("{path}:451: column a")), "{err}");
    let (code, out, _) = run(vec![
        "query",
        "SELECT count(*) AS n, min(a) AS lo, max(a) AS hi FROM t WHERE a BETWEEN 400 AND 499",
    ])
    .await
    .unwrap();
    assert_eq!(code, 0);
    assert_eq!(
        out,
        "n   | lo   | hi\nint | int  | int\n----+------+-----\n0   | NULL | NULL\n(1 row)\n"
    );
    let (_, out, _) = run(vec!["query", "SELECT count(*) FROM t", "--format", "csv"])
        .await
        .unwrap();
    assert_eq!(out, "count(*)\n900\n");

    // A gzip file goes in whole; tables lists the catalog.
    let gz = dir.join("more.ndjson.gz");
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(&gz).unwrap(),
        flate2::Compression::fast(),
    );
    for i in 1000..1100 {
        writeln!(enc, "{{\"a\":{i},\"s\":\"g\"}}").unwrap();
    }
    enc.finish().unwrap();
    let gz_path = gz.display().to_string();
    let (code, out, err) = run(vec!["ingest", &gz_path, "--table", "scopedb.public.t"])
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("100 rows committed in 1 batches"), "{out}");
    let (_, out, _) = run(vec![
        "query",
        "FROM t WHERE s = 'g' AGGREGATE count(*) AS n",
        "--format",
        "json",
    ])
    .await
    .unwrap();
    assert_eq!(out, "{\"n\":\"100\"}\n");
    let (_, out, _) = run(vec!["tables"]).await.unwrap();
    assert_eq!(out, "scopedb.public.t (a int, s string)\n");
    // A statement error is reported, with a non-zero exit.
    let (code, _, err) = run(vec!["query", "SELECT nope FROM t"]).await.unwrap();
    assert_eq!(code, 1);
    assert!(err.contains("nope"), "{err}");
}
