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

/// An interrupted load prints where to resume; resuming there loses and doubles nothing.
/// Standard input, zstd and an offset that is not a line's end are covered too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_ingest_resumes_with_no_row_lost_or_doubled() {
    use std::io::BufRead as _;
    let dir = common::temp_dir("cli-resume");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let (addr, _task) = common::serve(db, vec![]).await;
    let endpoint = format!("http://{addr}");
    let client = reqwest::Client::new();
    common::statement(&client, &endpoint, "CREATE TABLE t (a int, s string)").await;
    let rows = 30_000;
    let file = dir.join("rows.ndjson");
    let mut text = String::new();
    for i in 0..rows {
        text += &format!("{{\"a\":{i},\"s\":\"row {i}\"}}\n");
        if i % 1000 == 7 {
            text += "\n";
        }
    }
    std::fs::write(&file, &text).unwrap();
    let path = file.display().to_string();
    let ingest = |extra: &[&str]| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_sluice"));
        command
            .args([
                "ingest",
                &path,
                "--table",
                "scopedb.public.t",
                "--batch-rows",
                "100",
            ])
            .args(["--connections", "2", "--endpoint", &endpoint])
            .args(extra)
            .env_remove("SLUICE_API_KEY");
        command
    };
    // Interrupted after a few batches have settled.
    let mut child = ingest(&[])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let first = tokio::task::spawn_blocking(move || {
        let mut lines = std::io::BufReader::new(stderr).lines();
        let mut seen = Vec::new();
        while let Some(Ok(line)) = lines.next() {
            seen.push(line);
            if seen.len() == 5 {
                break;
            }
        }
        (seen, lines)
    });
    let (seen, rest) = first.await.unwrap();
    assert_eq!(seen.len(), 5, "{seen:?}");
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = tokio::task::spawn_blocking(move || {
        let _: Vec<_> = rest.collect();
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(out.status.code(), Some(130), "{stdout}");
    let resume: u64 = stdout
        .split("--resume-from ")
        .nth(1)
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("no resume offset: {stdout}"));
    assert!(resume > 0 && resume < text.len() as u64, "{stdout}");
    assert_eq!(text.as_bytes()[resume as usize - 1], b'\n');
    // An offset inside a line is refused, with nothing sent.
    let out = ingest(&["--resume-from", &(resume + 1).to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not the end of a line"));
    // Resumed: every row exactly once.
    let out = ingest(&["--resume-from", &resume.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let r = common::statement(
        &client,
        &endpoint,
        "SELECT count(*), count(DISTINCT a), min(a), max(a) FROM t",
    )
    .await;
    assert_eq!(
        r["result_set"]["rows"][0],
        serde_json::json!(["30000", "30000", "0", "29999"]),
        "{r}"
    );

    // Standard input, zstd-compressed, with a last line that has no newline.
    common::statement(&client, &endpoint, "CREATE TABLE z (a int)").await;
    let input = zstd::encode_all(&b"{\"a\":1}\n\n{\"a\":2}"[..], 3).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "ingest",
            "-",
            "--table",
            "scopedb.public.z",
            "--endpoint",
            &endpoint,
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("2 rows committed in 1 batches"),
        "{out:?}"
    );
    let r = common::statement(&client, &endpoint, "SELECT sum(a) FROM z").await;
    assert_eq!(r["result_set"]["rows"][0][0], "3");
}

/// Runs `sluice ingest` with `args`; returns the kernel's high-water mark of its resident set
/// (read until it exits) and its output.
/// Runs `sluice ingest` and samples its memory every 10 ms: returns the peak resident set
/// (`VmHWM`), the peak anonymous resident memory (`RssAnon`: the heap and stacks, without the
/// pages of the binary itself, whose count moves with the page cache from run to run), and
/// the output.
async fn ingest_peak_rss(args: Vec<String>) -> (u64, u64, std::process::Output) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("ingest")
        .args(args)
        .env_remove("SLUICE_API_KEY")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let status_path = format!("/proc/{}/status", child.id());
    tokio::task::spawn_blocking(move || {
        let (mut peak, mut anon) = (0u64, 0u64);
        let bytes = |kb: &str| -> u64 {
            kb.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .unwrap()
                * 1024
        };
        loop {
            if let Ok(status) = std::fs::read_to_string(&status_path) {
                for line in status.lines() {
                    if let Some(kb) = line.strip_prefix("VmHWM:") {
                        peak = peak.max(bytes(kb));
                    } else if let Some(kb) = line.strip_prefix("RssAnon:") {
                        anon = anon.max(bytes(kb));
                    }
                }
            }
            if child.try_wait().unwrap().is_some() {
                return (peak, anon, child.wait_with_output().unwrap());
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    })
    .await
    .unwrap()
}

/// The command's memory does not grow with its input. CI form: 64 MiB of events in small
/// batches; the peak anonymous memory stays within 24 MiB of the same command's on a one-row
/// input, well under the input's 64 MiB (the resident set also counts the debug binary's own
/// pages, 40-50 MiB by how many are cached, which made a bound on it flaky; the one-row
/// baseline's anonymous memory itself moves by 2 MiB between runs, and the difference was
/// 14-16.4 MiB in full test runs, so 16 MiB was too tight). Long form (`SLUICE_CLI_LONG=1`, run in
/// release): 2 GiB in default batches (8 MiB), under 100 MB in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_of_a_large_input_runs_in_bounded_memory() {
    let long = std::env::var("SLUICE_CLI_LONG").is_ok_and(|v| v == "1");
    let (size, batch_rows): (u64, &str) = if long {
        (2 << 30, "200000")
    } else {
        (64 << 20, "2000")
    };
    let dir = common::temp_dir("cli-memory");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    // Flushes keep the server's memory within its limits, as `sluice serve` runs them.
    tokio::spawn(db.clone().run_maintenance(std::future::pending()));
    let (addr, _task) = common::serve(db, vec![]).await;
    let endpoint = format!("http://{addr}");
    let client = reqwest::Client::new();
    let created = client
        .put(format!(
            "{endpoint}/v1/catalog/databases/scopedb/schemas/public/tables/events"
        ))
        .json(&common::events_def())
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 200);
    let event = |n: u64| {
        format!(
            "{{\"time\":\"2026-10-23T09:{:02}:{:02}Z\",\"service\":\"svc-{}\",\"name\":\"event_{}\",\
             \"message\":\"request {n} handled in {} ms\",\"var\":{{\"n\":{n},\"ok\":true}}}}\n",
            n / 60 % 60,
            n % 60,
            n % 7,
            n % 13,
            n % 997
        )
    };
    let small = dir.join("one.ndjson");
    std::fs::write(&small, event(0)).unwrap();
    let file = dir.join("events.ndjson");
    let mut out = std::io::BufWriter::new(std::fs::File::create(&file).unwrap());
    let (mut written, mut rows) = (0u64, 0u64);
    while written < size {
        let line = event(rows);
        out.write_all(line.as_bytes()).unwrap();
        written += line.len() as u64;
        rows += 1;
    }
    out.flush().unwrap();
    drop(out);
    let args = |path: &std::path::Path| {
        let mut args = vec![path.display().to_string()];
        for a in [
            "--table",
            "scopedb.public.events",
            "--batch-rows",
            batch_rows,
        ] {
            args.push(a.into());
        }
        args.extend(["--endpoint".into(), endpoint.clone()]);
        args
    };
    let (baseline, baseline_anon, out) = ingest_peak_rss(args(&small)).await;
    assert!(out.status.success(), "{out:?}");
    let started = std::time::Instant::now();
    let (peak, anon, out) = ingest_peak_rss(args(&file)).await;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.starts_with(&format!("{rows} rows committed")),
        "{stdout}"
    );
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "sluice ingest: {:.0} MiB, {rows} rows in {:.1} s; peak RSS {:.1} MiB, anonymous {:.1} \
         MiB (one row: {:.1} MiB, anonymous {:.1} MiB)",
        mib(written),
        started.elapsed().as_secs_f64(),
        mib(peak),
        mib(anon),
        mib(baseline),
        mib(baseline_anon)
    );
    assert!(
        baseline > 0 && peak > 0 && anon > 0,
        "the resident set was never read"
    );
    if long {
        assert!(peak < 100_000_000, "peak RSS {:.1} MiB", mib(peak));
    } else {
        assert!(
            anon < baseline_anon + (24 << 20),
            "peak anonymous memory {:.1} MiB, {:.1} MiB on one row",
            mib(anon),
            mib(baseline_anon)
        );
    }
    let r = common::statement(&client, &endpoint, "SELECT count(*) FROM events").await;
    assert_eq!(r["result_set"]["rows"][0][0], (rows + 1).to_string());
}

/// A batch the server does not take (here a 404 for one batch, as a dropped table gives)
/// stops the run; batches already in flight past it settle, and the printed command skips
/// them: following it sends every row exactly once. The server is a stand-in that fails the
/// one batch on command and records what it takes, because the real one cannot be made to
/// refuse one chosen batch among concurrent ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_ingest_resumes_with_no_row_lost_or_doubled() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let taken = Arc::new(Mutex::new(Vec::<i64>::new()));
    let fail = Arc::new(AtomicBool::new(true));
    let handler = {
        let (taken, fail) = (taken.clone(), fail.clone());
        axum::routing::post(move |body: String| {
            let (taken, fail) = (taken.clone(), fail.clone());
            async move {
                if fail.load(Ordering::SeqCst) && body.contains("\"fail\":true") {
                    let error = serde_json::json!({"code": "not_found",
                        "message": "no such table", "details": {"status": "rejected"}});
                    return (axum::http::StatusCode::NOT_FOUND, axum::Json(error));
                }
                // Slow enough that several batches are in flight at once.
                tokio::time::sleep(std::time::Duration::from_millis(30)).await;
                let rows = stand_in_rows(&body);
                stand_in_commit(&taken, rows)
            }
        })
    };
    let endpoint = stand_in_serve(handler).await;
    let dir = common::temp_dir("cli-stopped");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rows.ndjson");
    let mut text = String::new();
    for i in 0..60 {
        if i == 10 {
            text += &format!("{{\"a\":{i},\"fail\":true}}\n");
        } else {
            text += &format!("{{\"a\":{i}}}\n");
        }
    }
    std::fs::write(&file, &text).unwrap();
    let path = file.display().to_string();
    let run = |extra: Vec<String>| {
        let mut args: Vec<String> = ["ingest", &path, "--table", "d.s.t", "--batch-rows", "1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend([
            "--connections".into(),
            "4".into(),
            "--endpoint".into(),
            endpoint.clone(),
        ]);
        args.extend(extra);
        tokio::task::spawn_blocking(move || {
            let refs: Vec<&str> = args.iter().map(String::as_str).collect();
            sluice(&refs)
        })
    };
    let (code, out, err) = run(vec![]).await.unwrap();
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(err.contains("stopped: "), "{err}");
    let taken_first = taken.lock().unwrap().len();
    assert!(
        taken_first < 59,
        "the run went on past the refused batch: {taken_first}"
    );
    let command = out
        .lines()
        .find_map(|l| l.split("sluice ingest ... ").nth(1))
        .unwrap_or_else(|| panic!("no resume command: {out}"));
    println!("first run: {taken_first} rows taken; resume with: {command}");
    let extra: Vec<String> = command.split_whitespace().map(str::to_owned).collect();
    fail.store(false, Ordering::SeqCst);
    let (code, out, err) = run(extra).await.unwrap();
    assert_eq!(code, 0, "{out}\n{err}");
    let mut all = taken.lock().unwrap().clone();
    all.sort_unstable();
    assert_eq!(
        all,
        (0..60).collect::<Vec<i64>>(),
        "first run took {taken_first}"
    );
}

/// A request that stalls holds back the rest: finished batches behind it are settled only in
/// input order, so the command stops sending once `2 * connections` are unsettled, and an
/// interruption meanwhile would leave no more than that with unknown outcomes. Once the
/// stalled one is answered, the run ends with every row taken exactly once. (A stand-in
/// server, to hold one chosen request.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_request_holds_back_the_batches_behind_it() {
    use std::sync::{Arc, Mutex};
    let taken = Arc::new(Mutex::new(Vec::<i64>::new()));
    let release = Arc::new(tokio::sync::Notify::new());
    let handler = {
        let (taken, release) = (taken.clone(), release.clone());
        axum::routing::post(move |body: String| {
            let (taken, release) = (taken.clone(), release.clone());
            async move {
                let rows = stand_in_rows(&body);
                if rows.first() == Some(&0) {
                    release.notified().await;
                }
                stand_in_commit(&taken, rows)
            }
        })
    };
    let endpoint = stand_in_serve(handler).await;
    let dir = common::temp_dir("cli-stalled");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rows.ndjson");
    let text: String = (0..100).map(|i| format!("{{\"a\":{i}}}\n")).collect();
    std::fs::write(&file, &text).unwrap();
    let path = file.display().to_string();
    let args: Vec<String> = [
        "ingest",
        &path,
        "--table",
        "d.s.t",
        "--batch-rows",
        "1",
        "--connections",
        "2",
        "--endpoint",
        &endpoint,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let run = tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        sluice(&refs)
    });
    // Until something arrived and then nothing more for a while: the command has stopped
    // sending.
    let mut seen = 0;
    for _ in 0..600 {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        let now = taken.lock().unwrap().len();
        if now > 0 && now == seen {
            break;
        }
        seen = now;
    }
    // The stalled batch and 3 behind it are unsettled (2 * 2 connections).
    assert_eq!(seen, 3, "batches taken behind the stalled one");
    release.notify_one();
    let (code, out, err) = run.await.unwrap();
    assert_eq!(code, 0, "{out}\n{err}");
    let mut all = taken.lock().unwrap().clone();
    all.sort_unstable();
    assert_eq!(all, (0..100).collect::<Vec<i64>>());
}

/// The `a` of each row of a body sent to a stand-in ingest endpoint.
fn stand_in_rows(body: &str) -> Vec<i64> {
    body.lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["a"]
                .as_i64()
                .unwrap()
        })
        .collect()
}

/// A stand-in ingest endpoint takes `rows`: recorded in `taken`, answered as committed.
fn stand_in_commit(
    taken: &std::sync::Mutex<Vec<i64>>,
    rows: Vec<i64>,
) -> (axum::http::StatusCode, axum::Json<serde_json::Value>) {
    let n = rows.len();
    taken.lock().unwrap().extend(rows);
    let answer = serde_json::json!({"status": "committed", "num_rows_inserted": n});
    (axum::http::StatusCode::OK, axum::Json(answer))
}

/// Serves `handler` as a stand-in ingest endpoint on a loopback port; returns its endpoint.
async fn stand_in_serve(handler: axum::routing::MethodRouter) -> String {
    let app = axum::Router::new().route(
        "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}/ingest",
        handler,
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    endpoint
}
