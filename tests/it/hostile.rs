//! Hostile statements through the real binary, with a read key: every function the statement
//! engine exposes, read from its registry at run time (`information_schema.routines` and
//! `.parameters`: scalar, aggregate, window and table functions, so a new DataFusion
//! version's functions are called too), with hostile arguments; and the corpus in
//! `testdata/hostile/`. The server must stay up, answer each statement with a result or a
//! classified refusal (never an internal error), keep its peak resident memory within its
//! statement memory (`query_memory_bytes`) plus [`MARGIN`], and answer a `SELECT 1` from
//! another key meanwhile.
//!
//! How each function is called: with the argument types its parameters list, or, for
//! functions that list none (variadic and list functions), with each of [`TEMPLATES`] that
//! plans (checked with `EXPLAIN`). A function no template fits fails the test: it needs a
//! template. Each call is then sent with every hostile value of its class at each position
//! ([`hostile`]), as constants (folded while planning), as columns of a `VALUES` source
//! (evaluated while running) and, for scalars, over a table of 8192 rows.

use crate::common::Server;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use serde_json::{Value, json};

/// Statement memory of the server under test.
const BUDGET: u64 = 256 << 20;

/// What the server may hold beyond its statement memory: its own baseline (a debug build's
/// code, the catalog, connection buffers), the allocator's slack, and what is not counted as
/// statement memory by design (rows a scan reads before a limit, the batches of a result
/// being rendered).
const MARGIN: u64 = 512 << 20;

/// Statements in flight at once.
const CONCURRENCY: usize = 4;

const KEYS: [&str; 4] = ["--api-key", "read=r-key", "--api-key", "admin=a-key"];

/// A class of argument values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    Int,
    Float,
    Str,
    Json,
    Arr,
    StrArr,
    Date,
    Ts,
    Time,
    Interval,
    Duration,
    Bool,
    Bin,
    Map,
    Struct,
    /// A union value (what the JSON functions answer).
    Union,
    /// An Arrow type's name (`arrow_cast`).
    TypeName,
    /// The name of a union's field (`union_extract`).
    Field,
    Null,
}

use Class::*;

/// Argument lists tried for functions that list no parameters.
const TEMPLATES: &[&[Class]] = &[
    &[],
    &[Int],
    &[Float],
    &[Str],
    &[Json],
    &[Arr],
    &[StrArr],
    &[Ts],
    &[Map],
    &[Struct],
    &[Int, Int],
    &[Int, Int, Int],
    &[Str, Str],
    &[Str, Int],
    &[Str, Str, Str],
    &[Json, Str],
    &[Json, Str, Str],
    &[Arr, Int],
    &[Arr, Int, Int],
    &[Arr, Int, Int, Int],
    &[Arr, Arr],
    &[Arr, Str],
    &[StrArr, Str],
    &[StrArr, Str, Str],
    &[Arr, Arr, Arr],
    &[Map, Str],
    &[Struct, Str],
    &[Str, Str, Str, Str],
    &[Int, Str],
    &[Arr, Float],
    &[StrArr, Int],
    &[Int, Arr],
    &[Str, StrArr],
    &[Int, TypeName],
    &[Str, TypeName],
    &[Union, Field],
];

/// The class of a type as `information_schema.parameters` prints it.
fn class_of(t: &str) -> Class {
    match t {
        _ if t.starts_with("Int") || t.starts_with("UInt") => Int,
        _ if t.starts_with("Float") || t.starts_with("Decimal") => Float,
        "String" | "Utf8" | "LargeUtf8" | "Utf8View" => Str,
        _ if t.starts_with("Timestamp") => Ts,
        _ if t.starts_with("Time") => Time,
        _ if t.starts_with("Date") => Date,
        _ if t.starts_with("Interval") => Interval,
        _ if t.starts_with("Duration") => Duration,
        "Boolean" => Bool,
        _ if t.contains("Binary") => Bin,
        "Null" => Null,
        _ if t.starts_with("Union") => Json,
        _ => Str,
    }
}

/// An ordinary value of the class.
fn benign(class: Class) -> &'static str {
    match class {
        Int => "2",
        Float => "2.5",
        Str => "'a,b'",
        Json => r#"'{"a":[1,2],"b":"c"}'"#,
        Arr => "make_array(1, 2, 3)",
        StrArr => "make_array('a', 'b')",
        Date => "DATE '2020-02-29'",
        Ts => "TIMESTAMP '2020-02-29T12:00:00'",
        Time => "TIME '12:00:00'",
        Interval => "INTERVAL '1 day'",
        Duration => "arrow_cast(1000, 'Duration(Second)')",
        Bool => "true",
        Bin => "X'0102'",
        Map => "map(['a'], [1])",
        Struct => "named_struct('a', 1)",
        Union => r#"json_get('{"a":1}', 'a')"#,
        TypeName => "'Int64'",
        Field => "'int'",
        Null => "NULL",
    }
}

/// Hostile values of the class: extremes, sizes that would size a result, deep nesting,
/// pathological patterns and type strings.
fn hostile(class: Class) -> Vec<String> {
    let deep_json = format!("'{}1{}'", "[".repeat(20_000), "]".repeat(20_000));
    let v: Vec<String> = match class {
        Int => vec![
            "9223372036854775807".into(),
            "-9223372036854775808".into(),
            "-1".into(),
            "1000000000000".into(),
        ],
        Float => vec!["1e308".into(), "CAST('NaN' AS DOUBLE)".into()],
        Str => vec![
            "''".into(),
            "repeat('x', 100000)".into(),
            deep_json.clone(),
            "'(a*)*(b|c){50}$'".into(),
            "'((((x{100}){100}){100}){100})'".into(),
        ],
        Json => vec![
            deep_json,
            format!("'{{{}\"a\":1}}'", "\"k\":1,".repeat(20_000)),
        ],
        Arr => vec![
            "make_array()".into(),
            "range(1, 300000)".into(),
            "range(9223372036854775000, 9223372036854775807)".into(),
        ],
        StrArr => vec!["make_array(repeat('x', 100000), '', NULL)".into()],
        Date => vec!["DATE '0001-01-01'".into(), "DATE '9999-12-31'".into()],
        Ts => vec![
            "TIMESTAMP '1677-09-21T00:12:44'".into(),
            "TIMESTAMP '2262-04-11T23:47:16'".into(),
        ],
        Time => vec!["TIME '23:59:59.999999999'".into()],
        Interval => vec![
            "INTERVAL '1 nanosecond'".into(),
            "INTERVAL '1 month -31 days'".into(),
            "INTERVAL '100000000 years'".into(),
        ],
        Duration => vec!["arrow_cast(9223372036854775807, 'Duration(Nanosecond)')".into()],
        Bool => vec![],
        Bin => vec!["X''".into()],
        Map => vec!["map(make_array(), make_array())".into()],
        Struct => vec!["named_struct('a', repeat('x', 100000))".into()],
        Union => vec![format!("json_get({deep_json}, 0)")],
        Field => vec!["'nothing'".into()],
        TypeName => vec![
            "'FixedSizeBinary(2147483647)'".into(),
            "'FixedSizeList(2147483647, FixedSizeList(2147483647, Int64))'".into(),
            format!("'{}Int64{}'", "List(".repeat(100_000), ")".repeat(100_000)),
        ],
        Null => vec![],
    };
    let mut v = v;
    v.push("NULL".into());
    v
}

/// How a function is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Scalar,
    Aggregate,
    Window,
    Table,
}

/// `f(args)` in a statement of the function's kind; `row` puts the arguments in the columns
/// of a `VALUES` source instead of the call.
fn call(kind: Kind, f: &str, args: &[String], row: bool) -> String {
    let columns: Vec<String> = (1..=args.len()).map(|i| format!("c{i}")).collect();
    let (inner, from) = if row && !args.is_empty() {
        let values = format!("({})", args.join(", "));
        (
            columns.join(", "),
            format!(
                " FROM (VALUES {values}, {values}, {values}) AS t({})",
                columns.join(", ")
            ),
        )
    } else {
        (args.join(", "), String::new())
    };
    match kind {
        Kind::Scalar => format!("SELECT {f}({inner}){from}"),
        Kind::Aggregate => format!("SELECT {f}({inner}){from}"),
        Kind::Window => format!("SELECT {f}({inner}) OVER (ORDER BY 1){from}"),
        Kind::Table => format!("SELECT * FROM {f}({}) LIMIT 3", args.join(", ")),
    }
}

/// What one statement answered.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Answer {
    http: u16,
    /// `finished`, or the error code.
    outcome: String,
}

/// Sends `sql` with `key` and waits for its end.
async fn run(client: &reqwest::Client, base: &str, key: &str, sql: &str) -> Answer {
    let sent = client
        .post(format!("{base}/v1/statements"))
        .bearer_auth(key)
        .json(&json!({ "statement": sql }))
        .send()
        .await;
    let Ok(r) = sent else {
        return Answer {
            http: 0,
            outcome: "no answer".into(),
        };
    };
    let http = r.status().as_u16();
    let mut body: Value = r.json().await.unwrap_or(Value::Null);
    for _ in 0..1200 {
        if body["status"] != "running" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let id = body["statement_id"].as_str().unwrap_or_default().to_owned();
        body = match client
            .get(format!("{base}/v1/statements/{id}"))
            .bearer_auth(key)
            .send()
            .await
        {
            Ok(r) => r.json().await.unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
    }
    let outcome = match body["status"].as_str() {
        Some("finished") => "finished".to_owned(),
        Some(_) => body["error"]["code"].as_str().unwrap_or("?").to_owned(),
        None => body["code"].as_str().unwrap_or("?").to_owned(),
    };
    Answer { http, outcome }
}

/// Answers no client should get, whatever it sends.
fn broken(a: &Answer) -> bool {
    a.http == 0 || a.http >= 500 && a.http != 503 || a.outcome == "internal_server_error"
}

/// The resident memory a watchdog saw past its bound, and the statements then in flight.
type Overrun = Option<(u64, Vec<String>)>;

/// Watches the server's resident memory while statements run. Past the bound it kills the
/// server at once (a test past its memory must not take the machine's) and keeps the
/// statements that were in flight.
struct Watchdog {
    in_flight: std::sync::Arc<std::sync::Mutex<BTreeSet<String>>>,
    over: std::sync::Arc<std::sync::Mutex<Overrun>>,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Watchdog {
    fn start(server: &Server, bound: u64) -> Watchdog {
        let watchdog = Watchdog {
            in_flight: Default::default(),
            over: Default::default(),
            done: Default::default(),
        };
        let (in_flight, over, done) = (
            watchdog.in_flight.clone(),
            watchdog.over.clone(),
            watchdog.done.clone(),
        );
        let pid = server.child.id();
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let Some(rss) = crate::common::process_memory(pid, "VmRSS") else {
                    return;
                };
                if rss > bound {
                    let statements = in_flight.lock().unwrap().iter().cloned().collect();
                    *over.lock().unwrap() = Some((rss, statements));
                    let _ = std::process::Command::new("kill")
                        .args(["-9", &pid.to_string()])
                        .status();
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        watchdog
    }

    /// Runs `sql` with `key`, noting it as in flight meanwhile.
    async fn run(&self, client: &reqwest::Client, base: &str, key: &str, sql: &str) -> Answer {
        self.in_flight.lock().unwrap().insert(sql.to_owned());
        let answer = run(client, base, key, sql).await;
        self.in_flight.lock().unwrap().remove(sql);
        answer
    }

    /// Fails if the server went past the bound so far (the watchdog watches on).
    fn check_so_far(&self, after: &str) {
        if let Some((rss, _)) = self.over.lock().unwrap().clone() {
            self.check();
            panic!("resident memory reached {} MiB after {after}", rss >> 20);
        }
    }

    /// Fails if the server went past the bound, naming what ran then.
    fn check(&self) {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some((rss, statements)) = self.over.lock().unwrap().take() {
            let shown: Vec<String> = statements
                .iter()
                .map(|s| s.chars().take(300).collect())
                .collect();
            panic!(
                "resident memory reached {} MiB, past the bound; in flight:\n{}",
                rss >> 20,
                shown.join("\n")
            );
        }
    }
}

/// Every function of the engine's registry: its kind and its argument class lists.
async fn registry(
    client: &reqwest::Client,
    base: &str,
) -> BTreeMap<String, (Kind, BTreeSet<Vec<Class>>)> {
    let rows = |sql: &'static str| async move {
        let r: Value = client
            .post(format!("{base}/v1/statements"))
            .bearer_auth("r-key")
            .json(&json!({ "statement": sql }))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        r["result_set"]["rows"].as_array().unwrap().clone()
    };
    let mut functions = BTreeMap::new();
    // Aliases (`list_append` of `array_append`) share the function, its description and its
    // example: each function is called once, by one of its names.
    let mut seen = BTreeSet::new();
    for row in rows(
        "SELECT DISTINCT routine_name, function_type, description, syntax_example \
         FROM information_schema.routines ORDER BY routine_name",
    )
    .await
    {
        if !seen.insert((row[1].to_string(), row[2].to_string(), row[3].to_string())) {
            continue;
        }
        let kind = match row[1].as_str().unwrap() {
            "SCALAR" => Kind::Scalar,
            "AGGREGATE" => Kind::Aggregate,
            "WINDOW" => Kind::Window,
            "TABLE" => Kind::Table,
            other => panic!("a function of kind {other}"),
        };
        functions.insert(row[0].as_str().unwrap().to_owned(), (kind, BTreeSet::new()));
    }
    let parameters = rows(
        "SELECT specific_name, rid, data_type FROM information_schema.parameters \
         WHERE parameter_mode = 'IN' ORDER BY specific_name, rid, ordinal_position",
    )
    .await;
    let mut signatures: BTreeMap<(String, String), Vec<Class>> = BTreeMap::new();
    for row in parameters {
        let key = (row[0].as_str().unwrap().to_owned(), row[1].to_string());
        signatures
            .entry(key)
            .or_default()
            .push(class_of(row[2].as_str().unwrap()));
    }
    for ((name, _), classes) in signatures {
        if let Some((_, lists)) = functions.get_mut(&name) {
            lists.insert(classes);
        }
    }
    functions
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_function_with_hostile_arguments_leaves_the_server_up_and_within_its_memory() {
    let config = format!(
        "query_memory_bytes = {BUDGET}\nstatement_timeout_seconds = 5\nmax_running_statements = 64\n"
    );
    let mut server = Server::start("hostile-functions", &KEYS, &config);
    let base = server.base.clone();
    let client = reqwest::Client::new();
    let started = Instant::now();
    let functions = registry(&client, &base).await;
    assert!(functions.len() > 200, "{} functions", functions.len());

    // Functions that list no parameters: the templates they plan with.
    let mut probes = Vec::new();
    for (name, (kind, lists)) in &functions {
        if lists.is_empty() {
            for template in TEMPLATES {
                let args: Vec<String> = template.iter().map(|c| benign(*c).to_owned()).collect();
                let sql = format!("EXPLAIN {}", call(*kind, name, &args, false));
                probes.push((name.clone(), template.to_vec(), sql));
            }
        }
    }
    let planned: Vec<(String, Vec<Class>, Answer)> = futures::stream::iter(probes)
        .map(|(name, template, sql)| {
            let (client, base) = (client.clone(), base.clone());
            async move {
                let answer = run(&client, &base, "r-key", &sql).await;
                (name, template, answer)
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let mut functions = functions;
    for (name, template, answer) in planned {
        assert!(!broken(&answer), "EXPLAIN {name}{template:?}: {answer:?}");
        if answer.outcome == "finished" {
            functions.get_mut(&name).unwrap().1.insert(template);
        }
    }
    let untried: Vec<&String> = functions
        .iter()
        .filter(|(_, (_, lists))| lists.is_empty())
        .map(|(name, _)| name)
        .collect();
    // Functions that cannot be called in a statement at all.
    let uncallable = ["file_row_index", "input_file_name", "grouping"];
    let untried: Vec<&&String> = untried
        .iter()
        .filter(|n| !uncallable.contains(&n.as_str()))
        .collect();
    assert!(
        untried.is_empty(),
        "functions no argument template plans with (add a template): {untried:?}"
    );

    // Every call: each hostile value at each position, the rest ordinary. A value is sent at
    // a position once per function and number of arguments, in the first signature that takes
    // it there (signatures that differ only in the other arguments' types add time, not
    // cases: arithmetic lists dozens).
    let mut statements = Vec::new();
    let mut sent = BTreeSet::new();
    for (name, (kind, lists)) in &functions {
        for classes in lists {
            let ordinary: Vec<String> = classes.iter().map(|c| benign(*c).to_owned()).collect();
            for (i, class) in classes.iter().enumerate() {
                for value in hostile(*class) {
                    if !sent.insert((name.clone(), classes.len(), i, value.clone())) {
                        continue;
                    }
                    let null = value == "NULL";
                    let mut args = ordinary.clone();
                    args[i] = value;
                    statements.push(call(*kind, name, &args, false));
                    if *kind != Kind::Table && !null {
                        statements.push(call(*kind, name, &args, true));
                    }
                    // Counts and sizes, over a table: results copied to every row.
                    if *kind == Kind::Scalar && *class == Int {
                        statements.push(format!(
                            "SELECT count({name}({})) FROM generate_series(1, 8192)",
                            args.join(", ")
                        ));
                    }
                }
            }
        }
    }
    let total = statements.len();
    assert!(total > 3000, "{total} statements");
    eprintln!("{total} statements over {} functions", functions.len());

    // A SELECT 1 of another key answers all along.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probe = {
        let (client, base, done) = (client.clone(), base.clone(), done.clone());
        tokio::spawn(async move {
            let mut slowest = Duration::ZERO;
            let mut count = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let at = Instant::now();
                let answer = run(&client, &base, "a-key", "SELECT 1").await;
                assert_eq!(answer.outcome, "finished", "{answer:?}");
                slowest = slowest.max(at.elapsed());
                count += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            (count, slowest)
        })
    };

    let watchdog = Watchdog::start(&server, BUDGET + MARGIN);
    let highest = std::sync::atomic::AtomicU64::new(server.memory("VmHWM"));
    let answers: Vec<(String, Answer)> = futures::stream::iter(statements)
        .map(|sql| {
            let (client, base, watchdog, highest) =
                (client.clone(), base.clone(), &watchdog, &highest);
            let pid = server.child.id();
            async move {
                let answer = watchdog.run(&client, &base, "r-key", &sql).await;
                // Where the peak grows, and by what (the statements that raise it most).
                let peak = crate::common::process_memory(pid, "VmHWM").unwrap_or(0);
                let before = highest.fetch_max(peak, std::sync::atomic::Ordering::Relaxed);
                if peak > before + (32 << 20) {
                    eprintln!(
                        "peak RSS {} MiB after {}",
                        peak >> 20,
                        &sql[..sql.len().min(200)]
                    );
                }
                (sql, answer)
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    watchdog.check();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let (probes, slowest) = probe.await.unwrap();

    let mut tally: BTreeMap<Answer, usize> = BTreeMap::new();
    let mut failures = Vec::new();
    for (sql, answer) in &answers {
        *tally.entry(answer.clone()).or_default() += 1;
        if broken(answer) {
            failures.push(format!("{answer:?}: {}", &sql[..sql.len().min(300)]));
        }
    }
    let peak = server.memory("VmHWM");
    eprintln!(
        "{total} statements over {} functions in {:?}: {tally:?}; peak RSS {} MiB; \
         {probes} SELECT 1 from another key, the slowest {slowest:?}",
        functions.len(),
        started.elapsed(),
        peak >> 20
    );
    assert!(server.alive(), "the server died");
    assert!(
        failures.is_empty(),
        "{} broken answers:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        peak <= BUDGET + MARGIN,
        "peak RSS {} MiB, more than the statement memory ({} MiB) and the margin ({} MiB)",
        peak >> 20,
        BUDGET >> 20,
        MARGIN >> 20
    );
}

/// One corpus file: what it sends (`{{N*text}}` is `text` repeated `N` times), how many
/// copies at once, and what it must answer (`finished`; `refused`, any classified refusal;
/// `any`, any answer but a broken one; or an error code).
struct Case {
    name: String,
    sql: String,
    copies: usize,
    expect: String,
}

fn expand(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find("}}").expect("an unclosed {{") + start;
        let (count, unit) = rest[start + 2..end].split_once('*').expect("{{N*text}}");
        out.push_str(&unit.repeat(count.parse().expect("a count")));
        rest = &rest[end + 2..];
    }
    out.push_str(rest);
    out
}

fn corpus() -> Vec<Case> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/hostile");
    let mut cases = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "sql") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let header = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("-- {key}: ")))
                .map(str::trim)
                .map(str::to_owned)
        };
        let sql: Vec<&str> = text.lines().filter(|l| !l.starts_with("--")).collect();
        cases.push(Case {
            name: path.file_stem().unwrap().to_string_lossy().into_owned(),
            sql: expand(&sql.join("\n")),
            copies: header("copies").map_or(1, |c| c.parse().unwrap()),
            expect: header("expect").unwrap_or_else(|| panic!("{path:?} says what to expect")),
        });
    }
    cases.sort_by(|a, b| a.name.cmp(&b.name));
    cases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_hostile_corpus_is_refused_or_bounded() {
    let config = format!(
        "query_memory_bytes = {BUDGET}\nstatement_timeout_seconds = 5\nmax_running_statements = 64\n"
    );
    let mut server = Server::start("hostile-corpus", &KEYS, &config);
    let base = server.base.clone();
    let client = reqwest::Client::new();
    let cases = corpus();
    assert!(cases.len() >= 40, "{} cases", cases.len());
    let watchdog = Watchdog::start(&server, BUDGET + MARGIN);
    let mut wrong = Vec::new();
    for case in &cases {
        let at = Instant::now();
        let answers: Vec<Answer> = futures::future::join_all(
            (0..case.copies).map(|_| watchdog.run(&client, &base, "r-key", &case.sql)),
        )
        .await;
        if !server.alive() {
            watchdog.check();
        }
        // Meanwhile, or right after, another key's SELECT 1 answers.
        let probe = run(&client, &base, "a-key", "SELECT 1").await;
        assert_eq!(probe.outcome, "finished", "after {}: {probe:?}", case.name);
        for answer in &answers {
            let right = match case.expect.as_str() {
                "any" => !broken(answer),
                "refused" => {
                    !broken(answer) && answer.outcome != "finished" && answer.outcome != "?"
                }
                code => answer.outcome == code,
            };
            eprintln!(
                "{}: {answer:?} in {:?}, peak RSS so far {} MiB",
                case.name,
                at.elapsed(),
                server.memory("VmHWM") >> 20
            );
            if !right {
                wrong.push(format!(
                    "{}: expected {}, got {answer:?}",
                    case.name, case.expect
                ));
            }
        }
        assert!(server.alive(), "{} ended the server", case.name);
    }
    watchdog.check();
    let peak = server.memory("VmHWM");
    eprintln!("{} cases; peak RSS {} MiB", cases.len(), peak >> 20);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(
        peak <= BUDGET + MARGIN,
        "peak RSS {} MiB, more than the statement memory ({} MiB) and the margin ({} MiB)",
        peak >> 20,
        BUDGET >> 20,
        MARGIN >> 20
    );
}

/// A statement that plans for seconds within every cap: ten CTEs, each the `UNION ALL` of the
/// one before with itself (1024 copies to analyze and optimize).
fn long_planning() -> String {
    let mut sql = "WITH c0 AS (SELECT 1 AS x)".to_owned();
    for i in 1..=10 {
        sql.push_str(&format!(
            ", c{i} AS (SELECT x FROM c{p} UNION ALL SELECT x FROM c{p})",
            p = i - 1
        ));
    }
    sql + " SELECT count(*) FROM c10"
}

/// Statements that plan for long plan on threads of their own: a `SELECT 1` sent while they
/// plan answers while they are still planning; their timeout stops their planning (the
/// work of a statement counts against the running statements until it really stops).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planning_runs_beside_other_statements_and_stops_at_the_timeout() {
    let keys = [
        "--api-key",
        "read=k1",
        "--api-key",
        "read=k2",
        "--api-key",
        "read=k3",
        "--api-key",
        "read=k4",
        "--api-key",
        "admin=a-key",
    ];
    // Five statements at once (two per key), stopped after a second: each plans for about a
    // second of one core's time alone (the plan-size cap allows no more), so several at once
    // on a small machine are still planning then.
    let config = "statement_timeout_seconds = 1\nmax_running_statements = 5\n";
    let server = Server::start("hostile-planning", &keys, config);
    let base = server.base.clone();
    let client = reqwest::Client::new();
    let submit = |key: &'static str, sql: String| {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move { run(&client, &base, key, &sql).await })
    };
    let planning: Vec<_> = ["k1", "k2", "k3", "k4"]
        .into_iter()
        .map(|key| submit(key, long_planning()))
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let answer = run(&client, &base, "a-key", "SELECT 1").await;
    assert_eq!(answer.outcome, "finished", "{answer:?}");
    // The SELECT 1 answered while every one of them still plans.
    assert!(
        planning.iter().all(|p| !p.is_finished()),
        "a statement that plans for seconds ended before a SELECT 1 sent after it"
    );
    // A fifth fills the running statements. The SELECT 1's slot is free once its work has
    // ended, a moment after its answer (seen once under the whole suite's load): a 503 until
    // then is sent again, as its Retry-After says, while the four still plan.
    let fifth = {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move {
            let sent = Instant::now();
            loop {
                let answer = run(&client, &base, "k4", &long_planning()).await;
                if answer.http != 503 || sent.elapsed() > Duration::from_millis(500) {
                    break answer;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    for p in planning.into_iter().chain([fifth]) {
        let answer = p.await.unwrap();
        assert_eq!(answer.outcome, "statement_timeout", "{answer:?}");
    }
    // Their planning stops with them: the server takes statements again soon, long before
    // their planning would have ended.
    let stopped = Instant::now();
    loop {
        let answer = run(&client, &base, "a-key", "SELECT 1").await;
        if answer.outcome == "finished" {
            break;
        }
        assert_eq!(answer.http, 503, "{answer:?}");
        assert!(
            stopped.elapsed() < Duration::from_secs(5),
            "the timed-out statements still hold the running statements"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A statement that stays inside one poll for minutes: DataFusion's nested-loop join
/// evaluates a whole probe batch against every build row (here 8,192 × 1,000,000 filter
/// evaluations) before it yields.
const STUCK_IN_ONE_POLL: &str =
    "SELECT count(*) FROM range(1000000) a JOIN range(1000000) b ON a.value + b.value = 7";

/// Statements stuck inside one poll stall no other key's statements, answer their timeout
/// or cancel at once, and hold their key's running slots until their threads really end
/// (so a key cannot pile up stuck statements past its share).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_stuck_in_one_poll_stall_nobody_and_answer_their_timeout_at_once() {
    let keys = [
        "--api-key",
        "read=k1",
        "--api-key",
        "read=k2",
        "--api-key",
        "admin=a-key",
    ];
    // Eight running statements, two per key.
    let config = "statement_timeout_seconds = 3\nmax_running_statements = 8\n";
    let server = Server::start("hostile-stuck", &keys, config);
    let base = server.base.clone();
    let client = reqwest::Client::new();
    let submit = |key: &'static str| {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move {
            let sent = Instant::now();
            let answer = run(&client, &base, key, STUCK_IN_ONE_POLL).await;
            (answer, sent.elapsed())
        })
    };
    let stuck = [submit("k1"), submit("k1")];
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Another key's statement runs beside them (the bound is generous for a loaded machine:
    // without threads of their own, it waited for their polls, minutes).
    let sent = Instant::now();
    let answer = run(&client, &base, "k2", "SELECT 1").await;
    assert_eq!(answer.outcome, "finished", "{answer:?}");
    assert!(
        sent.elapsed() < Duration::from_secs(10),
        "a SELECT 1 waited {:?} behind statements stuck in one poll",
        sent.elapsed()
    );
    eprintln!("SELECT 1 beside two stuck statements: {:?}", sent.elapsed());
    for s in stuck {
        let (answer, took) = s.await.unwrap();
        assert_eq!(answer.outcome, "statement_timeout", "{answer:?}");
        eprintln!("stuck statement answered after {took:?}");
        assert!(
            took < Duration::from_secs(10),
            "the 3 s timeout answered after {took:?}"
        );
    }
    // They answered, but their threads are still inside their polls: they still hold k1's
    // two running slots.
    let third = run(&client, &base, "k1", "SELECT 1").await;
    assert_eq!((third.http, &*third.outcome), (429, "too_many_requests"));
    // A cancel answers at once too, and the cancelled statement holds its slot the same way.
    let submitted = {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move {
            let body = json!({ "statement": STUCK_IN_ONE_POLL, "statement_id": "stuck" });
            let sent = client.post(format!("{base}/v1/statements"));
            let r = sent.bearer_auth("k2").json(&body).send().await.unwrap();
            r.json::<Value>().await.unwrap()
        })
    };
    let id = "stuck";
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let cancelled = Instant::now();
    let r = client
        .post(format!("{base}/v1/statements/{id}/cancel"))
        .bearer_auth("k2")
        .send()
        .await
        .unwrap();
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["status"], "cancelled", "{body}");
    assert!(cancelled.elapsed() < Duration::from_secs(5));
    eprintln!("cancel answered after {:?}", cancelled.elapsed());
    let body = submitted.await.unwrap();
    assert_eq!(body["status"], "cancelled", "{body}");
    let answer = run(&client, &base, "k2", "SELECT 1").await;
    assert_eq!(answer.outcome, "finished", "{answer:?}");
    let answer = run(&client, &base, "a-key", "SELECT 1").await;
    assert_eq!(answer.outcome, "finished", "{answer:?}");
}

/// A value of the class that differs from row to row of [`FAN_OUT_ROWS`] (`x` is the row's
/// number, `s` a 200-byte text ending in it), or an ordinary constant.
fn per_row(class: Class) -> String {
    match class {
        Int => "x".into(),
        Float => "CAST(x AS DOUBLE)".into(),
        Str | Json => "s".into(),
        Arr => "make_array(x, x, x)".into(),
        StrArr => "make_array(s, s)".into(),
        Bool => "x % 2 = 0".into(),
        Ts => "to_timestamp(x)".into(),
        other => benign(other).into(),
    }
}

/// The rows aggregates run over as windows: enough for what a window emits per row to
/// show (an `array_agg` over a growing frame would emit 40 GB).
const FAN_OUT_ROWS: u64 = 20_000;

/// Statements whose output repeats what they read, generated from the registry: every
/// aggregate as a window over a growing frame and over the whole partition, every
/// aggregate's value repeated through a cross join, and large `VALUES` statements, eight
/// at once. Each is answered (a result or a classified refusal) with the server's resident
/// memory within its statement memory and [`MARGIN`], and the server up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn what_operators_repeat_is_refused_or_bounded() {
    let config = format!(
        "query_memory_bytes = {BUDGET}\nstatement_timeout_seconds = 5\nmax_running_statements = 64\n"
    );
    let mut server = Server::start("hostile-repeats", &KEYS, &config);
    let base = server.base.clone();
    let client = reqwest::Client::new();
    let functions = registry(&client, &base).await;
    let source = format!(
        "(SELECT x, concat(repeat('m', 195), CAST(x AS VARCHAR)) AS s \
         FROM generate_series(1, {FAN_OUT_ROWS}) AS t(x)) AS g"
    );
    let mut windows = Vec::new();
    let mut joins = Vec::new();
    for (name, (kind, lists)) in &functions {
        if *kind != Kind::Aggregate {
            continue;
        }
        let mut lists: Vec<Vec<Class>> = lists.iter().cloned().collect();
        if lists.is_empty() {
            lists = vec![vec![Str], vec![Int], vec![Arr]];
        }
        // Per function: each argument count once, with per-row values.
        let mut counts = BTreeSet::new();
        for classes in lists.iter().filter(|c| counts.insert(c.len())) {
            let args: Vec<String> = classes.iter().map(|c| per_row(*c)).collect();
            let args = args.join(", ");
            for frame in [
                "ORDER BY x ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW",
                "",
            ] {
                windows.push(format!(
                    "SELECT count(w) FROM (SELECT {name}({args}) OVER ({frame}) AS w \
                     FROM {source}) AS q"
                ));
            }
            joins.push(format!(
                "SELECT count(CASE WHEN r.y < 0 THEN a.v END) FROM \
                 (SELECT {name}({args}) AS v FROM {source}) AS a \
                 CROSS JOIN generate_series(1, 100000) AS r(y)"
            ));
        }
    }
    assert!(windows.len() > 60, "{} window statements", windows.len());
    let values = |rows: usize| {
        format!(
            "SELECT count(*) FROM (VALUES {}) AS t(c)",
            vec!["(1)"; rows].join(",")
        )
    };
    let watchdog = Watchdog::start(&server, BUDGET + MARGIN);
    let mut tally: BTreeMap<(&str, Answer), usize> = BTreeMap::new();
    let mut failures = Vec::new();
    let groups = [
        ("window", windows, CONCURRENCY),
        ("cross join", joins, CONCURRENCY),
        // A megabyte of text (past what a statement may plan), and one of 200 KB that
        // fits once: eight at once.
        ("values", vec![values(260_000); 8], 8),
        ("values", vec![values(50_000); 8], 8),
    ];
    for (group, statements, concurrency) in groups {
        let at = Instant::now();
        let count = statements.len();
        let answers: Vec<(String, Answer)> = futures::stream::iter(statements)
            .map(|sql| {
                let (client, base, watchdog) = (client.clone(), base.clone(), &watchdog);
                async move {
                    let answer = watchdog.run(&client, &base, "r-key", &sql).await;
                    (sql, answer)
                }
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
        if !server.alive() {
            watchdog.check();
        }
        for (sql, answer) in answers {
            if broken(&answer) {
                failures.push(format!("{answer:?}: {}", &sql[..sql.len().min(300)]));
            }
            *tally.entry((group, answer)).or_default() += 1;
        }
        eprintln!(
            "{count} {group} statements in {:?}; peak RSS so far {} MiB",
            at.elapsed(),
            server.memory("VmHWM") >> 20
        );
        // Work that answered its timeout may run on until its next await: what it holds
        // then counts for its group.
        tokio::time::sleep(Duration::from_secs(3)).await;
        watchdog.check_so_far(&format!("the {group} statements"));
        let probe = run(&client, &base, "a-key", "SELECT 1").await;
        assert_eq!(
            probe.outcome, "finished",
            "after the {group} statements: {probe:?}"
        );
    }
    watchdog.check();
    let peak = server.memory("VmHWM");
    eprintln!("{tally:?}; peak RSS {} MiB", peak >> 20);
    assert!(server.alive(), "the server died");
    assert!(
        failures.is_empty(),
        "{} broken answers:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // What grows with its input is refused, not only bounded by the timeout (a cross join
    // is bounded: it runs in batches that fit until its timeout).
    let refused = |group: &str| {
        tally
            .iter()
            .filter(|((g, a), _)| *g == group && a.outcome == "resources_exhausted")
            .map(|(_, n)| n)
            .sum::<usize>()
    };
    for group in ["window", "values"] {
        assert!(
            refused(group) > 0,
            "no {group} statement was refused: {tally:?}"
        );
    }
    assert!(
        peak <= BUDGET + MARGIN,
        "peak RSS {} MiB, more than the statement memory ({} MiB) and the margin ({} MiB)",
        peak >> 20,
        BUDGET >> 20,
        MARGIN >> 20
    );
}
