//! The contracts in `schema/`: the OpenAPI document matches the router route for route, real
//! answers validate against it, and the example table validates against the table schema and
//! is accepted by the server.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};
use sluice::db::{Database, DbConfig};
use sluice::http::{OPENAPI, routes};

/// Validates `value` against the JSON Schema subset the documents use: `$ref` (local),
/// `type` (one or several), `const`, `enum`, `properties`, `required`,
/// `additionalProperties: false`, `items`, `minItems`.
fn validate(root: &Value, schema: &Value, value: &Value, at: &str, errors: &mut Vec<String>) {
    if let Some(r) = schema["$ref"].as_str() {
        let target = r
            .trim_start_matches('#')
            .split('/')
            .skip(1)
            .fold(root, |v, part| &v[part]);
        assert!(!target.is_null(), "dangling $ref {r}");
        return validate(root, target, value, at, errors);
    }
    let type_ok = |t: &str| match t {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        other => panic!("unknown type {other}"),
    };
    match &schema["type"] {
        Value::String(t) if !type_ok(t) => errors.push(format!("{at}: expected {t}, got {value}")),
        Value::Array(ts) if !ts.iter().any(|t| type_ok(t.as_str().unwrap_or(""))) => {
            errors.push(format!("{at}: expected one of {ts:?}, got {value}"));
        }
        _ => {}
    }
    if let Some(c) = schema.get("const")
        && c != value
    {
        errors.push(format!("{at}: expected {c}, got {value}"));
    }
    if let Some(options) = schema["enum"].as_array()
        && !options.contains(value)
    {
        errors.push(format!("{at}: {value} is not one of {options:?}"));
    }
    if let Some(object) = value.as_object() {
        for name in schema["required"].as_array().into_iter().flatten() {
            let name = name.as_str().unwrap_or_default();
            if !object.contains_key(name) {
                errors.push(format!("{at}: missing required {name}"));
            }
        }
        let properties = schema["properties"].as_object();
        for (key, v) in object {
            match properties.and_then(|p| p.get(key)) {
                Some(s) => validate(root, s, v, &format!("{at}.{key}"), errors),
                None if schema["additionalProperties"] == false => {
                    errors.push(format!("{at}: unexpected property {key}"));
                }
                None => {}
            }
        }
    }
    if let Some(items) = value.as_array() {
        if let Some(min) = schema["minItems"].as_u64()
            && (items.len() as u64) < min
        {
            errors.push(format!("{at}: fewer than {min} items"));
        }
        if schema.get("items").is_some() {
            for (i, item) in items.iter().enumerate() {
                validate(root, &schema["items"], item, &format!("{at}[{i}]"), errors);
            }
        }
    }
}

fn doc() -> Value {
    serde_json::from_str(OPENAPI).expect("schema/openapi.json is JSON")
}

const METHODS: [&str; 6] = ["get", "put", "post", "delete", "head", "options"];

#[test]
fn the_document_lists_exactly_the_routes() {
    let doc = doc();
    assert_eq!(doc["openapi"], "3.1.0");
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in METHODS {
            if item.get(method).is_some() {
                documented.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    let served: BTreeSet<(String, String)> = routes()
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    assert_eq!(documented, served);
}

/// A concrete URL for a route template.
fn concrete(template: &str) -> String {
    template
        .replace("{db}", "scopedb")
        .replace("{schema}", "public")
        .replace("{table}", "events")
        .replace("{id}", "no-such-statement")
        .replace("{name}", "contract-demo")
        .replace("{bucket}", "demo")
        .replace("{stream}", "contract-demo")
        .replace("{prefix}", "v2")
}

/// Checks one real answer against the document: its status is documented, and a JSON body
/// validates against the documented schema.
async fn check(doc: &Value, method: &str, template: &str, response: reqwest::Response) -> Value {
    let status = response.status().as_u16().to_string();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let text = response.text().await.unwrap();
    let op = &doc["paths"][template][method.to_lowercase()];
    assert!(!op.is_null(), "{method} {template} is not documented");
    let mut documented = op["responses"][&status].clone();
    assert!(
        !documented.is_null(),
        "{method} {template} answered {status}, which is not documented: {text}"
    );
    if let Some(r) = documented["$ref"].as_str() {
        documented = doc["components"]["responses"][r.rsplit('/').next().unwrap()].clone();
    }
    let schema = &documented["content"]["application/json"]["schema"];
    // Stream data keeps the stream's own content type (often application/json); only answers
    // documented as JSON documents are checked as such.
    // A HEAD answer has the headers of the GET it stands for, and no body.
    if !schema.is_null() && method != "HEAD" {
        assert!(
            content_type.starts_with("application/json"),
            "{method} {template} {status}: documented JSON, answered {content_type:?}"
        );
        let body: Value = serde_json::from_str(&text).unwrap();
        let mut errors = Vec::new();
        validate(doc, schema, &body, "$", &mut errors);
        assert!(
            errors.is_empty(),
            "{method} {template} {status}: {errors:#?}\n{body}"
        );
        body
    } else {
        Value::String(text)
    }
}

#[tokio::test]
async fn real_answers_validate_against_the_document() {
    let doc = doc();
    let dir = common::temp_dir("openapi");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let (addr, _task) = common::serve(db, vec![]).await;
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let send = |method: &str, template: &str| {
        let url = format!("{base}{}", concrete(template));
        client.request(method.parse().unwrap(), url)
    };
    // Every route answers something other than the router's own 404 or 405.
    for (method, template) in routes() {
        let r = send(method, &template).send().await.unwrap();
        let status = r.status().as_u16();
        let body = r.text().await.unwrap_or_default();
        assert!(
            status != 405 && !body.contains("no such endpoint"),
            "{method} {template} is not routed: {status} {body}"
        );
    }
    let events =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/schema/events.json"))
            .unwrap();
    let table = "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}";
    let ingest = "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}/ingest";
    let stream = "/v1/stream/{name}";
    let stats = "/v1/catalog/databases/{db}/schemas/{schema}/tables/{table}/stats";
    let cases: Vec<(&str, &str, reqwest::RequestBuilder)> = vec![
        ("GET", "/v1/health", send("GET", "/v1/health")),
        ("PUT", table, send("PUT", table).header("content-type", "application/json").body(events.clone())),
        ("GET", table, send("GET", table)),
        ("GET", "/v1/catalog", send("GET", "/v1/catalog")),
        ("GET", "/v1/catalog/databases/{db}", send("GET", "/v1/catalog/databases/{db}")),
        ("POST", ingest, send("POST", ingest).header("content-type", "application/x-ndjson").body(
            "{\"time\":\"2026-10-23T09:00:00Z\",\"service\":\"checkout\",\"name\":\"payment_failed\",\"message\":\"m\",\"var\":{\"gateway\":\"credit_card\"}}\n",
        )),
        ("POST", ingest, send("POST", ingest).header("content-type", "application/x-ndjson").body("{\"time\":1}\n")),
        ("GET", stats, send("GET", stats)),
        ("GET", stats, send("GET", stats).query(&[("files", "true")])),
        ("POST", ingest, send("POST", ingest).header("content-type", "text/csv").body("a,b\n")),
        ("POST", "/v1/statements", send("POST", "/v1/statements").json(&json!({"statement": "FROM events SELECT name, var['gateway']::string AS g"}))),
        ("POST", "/v1/statements", send("POST", "/v1/statements").json(&json!({"statement": "SELECT nope FROM events"}))),
        ("POST", "/v1/statements", send("POST", "/v1/statements").body("not json")),
        ("GET", "/v1/statements/{id}", send("GET", "/v1/statements/{id}")),
        ("POST", "/v1/ingest", send("POST", "/v1/ingest").json(&json!({"data": {"format": "json", "rows": "{\"service\":\"x\"}\n"}, "statement": "INSERT INTO events"}))),
        ("DELETE", table, send("DELETE", table)),
        ("PUT", stream, send("PUT", stream).header("content-type", "application/json")),
        ("POST", stream, send("POST", stream).header("content-type", "application/json").body("{\"a\":1}")),
        ("POST", stream, send("POST", stream).header("content-type", "application/json").body("{oops")),
        ("GET", "/v1/streams", send("GET", "/v1/streams")),
        ("GET", "/v1/streams", send("GET", "/v1/streams?limit=0")),
        ("GET", stream, send("GET", stream)),
        ("HEAD", stream, send("HEAD", stream)),
        ("PUT", "/{bucket}", send("PUT", "/{bucket}")),
        ("GET", "/{bucket}/{stream}", send("GET", "/{bucket}/{stream}")),
        ("DELETE", stream, send("DELETE", stream)),
        ("GET", stream, send("GET", stream)),
        ("GET", "/openapi.json", send("GET", "/openapi.json")),
        ("GET", "/", send("GET", "/")),
    ];
    for (method, template, request) in cases {
        let response = request.send().await.unwrap();
        check(&doc, method, template, response).await;
    }
}

#[tokio::test]
async fn the_example_table_matches_the_table_schema_and_is_accepted() {
    let schema: Value =
        serde_json::from_str(include_str!("../../schema/table.schema.json")).unwrap();
    let events: Value = serde_json::from_str(include_str!("../../schema/events.json")).unwrap();
    let mut errors = Vec::new();
    validate(&schema, &schema, &events, "$", &mut errors);
    assert!(errors.is_empty(), "{errors:#?}");
    // The schema refuses what the server refuses.
    let mut bad = events.clone();
    bad["columns"][0]["data_type"] = json!("datetime");
    bad["extra"] = json!(1);
    let mut errors = Vec::new();
    validate(&schema, &schema, &bad, "$", &mut errors);
    assert_eq!(errors.len(), 2, "{errors:#?}");
    let dir = common::temp_dir("table-schema");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let (addr, _task) = common::serve(db, vec![]).await;
    let url = format!("http://{addr}/v1/catalog/databases/scopedb/schemas/public/tables/events");
    let client = reqwest::Client::new();
    let r = client.put(&url).json(&events).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = client
        .put(format!("{url}2"))
        .json(&bad)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // As sent (the ScopeDB shape), and with `?with_ids=true` with the ids the catalog gave:
    // positions from 1, schema id 0.
    let stored: Value = client.get(&url).send().await.unwrap().json().await.unwrap();
    assert_eq!(stored, events);
    let stored: Value = client
        .get(format!("{url}?with_ids=true"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut given = events.clone();
    for (i, c) in given["columns"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .enumerate()
    {
        c["id"] = json!(i + 1);
    }
    given["last_column_id"] = json!(events["columns"].as_array().unwrap().len());
    given["schema_id"] = json!(0);
    assert_eq!(stored, given);
    let mut errors = Vec::new();
    validate(&schema, &schema, &stored, "$", &mut errors);
    assert!(errors.is_empty(), "{errors:#?}");
}

#[tokio::test]
async fn every_role_gets_documented_answers_and_the_router_serves_no_other_method() {
    let doc = doc();
    let dir = common::temp_dir("openapi-roles");
    let db = Database::open(DbConfig::new(&dir)).await.unwrap();
    let keys = vec!["read=r".to_owned(), "write=w".into(), "admin=a".into()];
    let (addr, _task) = common::serve(db, keys).await;
    let base = format!("http://{addr}");
    let client = reqwest::Client::new();
    let routes = routes();
    for (method, template) in &routes {
        for key in [None, Some("r"), Some("w"), Some("a")] {
            let mut request = client.request(
                method.parse().unwrap(),
                format!("{base}{}", concrete(template)),
            );
            if let Some(key) = key {
                request = request.bearer_auth(key);
            }
            if matches!(*method, "PUT" | "POST") {
                request = request
                    .header("content-type", "application/json")
                    .body("{}");
            }
            let response = request.send().await.unwrap();
            check(&doc, method, template, response).await;
        }
    }
    // Methods the route list does not name are not served.
    let mut by_path: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (method, template) in &routes {
        by_path.entry(template.as_str()).or_default().insert(method);
    }
    for (template, methods) in by_path {
        for method in ["GET", "HEAD", "PUT", "POST", "DELETE", "OPTIONS", "PATCH"] {
            // A GET route answers HEAD too (axum's rule; the HEAD answer is the GET's).
            if methods.contains(method) || (method == "HEAD" && methods.contains("GET")) {
                continue;
            }
            let r = client
                .request(
                    method.parse().unwrap(),
                    format!("{base}{}", concrete(template)),
                )
                .bearer_auth("a")
                .send()
                .await
                .unwrap();
            assert_eq!(
                r.status(),
                405,
                "{method} {template} is served but not listed"
            );
            assert!(r.headers().contains_key("allow"), "{method} {template}");
        }
    }
}
