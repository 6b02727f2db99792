//! The read-only Iceberg REST catalog at `/iceberg` (the Apache Iceberg REST catalog
//! specification's `v1` routes that a reader needs): configuration, namespaces, table lists,
//! table loads and existence checks. Namespaces are `[db]` and `[db, schema]`; tables live in
//! `[db, schema]` under their sluice names. Keys and roles are the API's (a GET or HEAD
//! needs the read role). A load publishes the table's Iceberg view it asks for (that view
//! alone: the other's trouble never fails it) for its newest manifest version if no node has
//! yet ([`crate::iceberg`]), so a reader always gets the committed files. Errors carry the
//! specification's `error` object beside sluice's own body.
//!
//! Two views of every table ([`View`]), chosen by the specification's prefix: the routes
//! without one and those under prefix `v3` serve the format-3 view, those under prefix `v2`
//! the format-2 view. A client names a view as its warehouse: `v1/config?warehouse=v2` hands
//! out prefix `v2` (and `v3` prefix `v3`; no warehouse, or an empty one, no prefix); any other
//! warehouse or prefix is not found.

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ErrorBody;
use super::{ApiError, AppState};
use crate::catalog::{CatalogPath, RootDef};
use crate::iceberg::View;

/// The separator of namespace levels in a URL (the specification's unit separator).
const LEVELS: char = '\u{1f}';

/// An answer of the catalog: the specification's error model on failures.
pub(super) struct Answer(Result<Response, ApiError>);

impl<E: Into<ApiError>> From<E> for Answer {
    fn from(e: E) -> Self {
        Answer(Err(e.into()))
    }
}

impl IntoResponse for Answer {
    fn into_response(self) -> Response {
        match self.0 {
            Ok(r) => r,
            // [`error_model`] adds the specification's error object, to these and to the
            // refusals made before a handler runs alike.
            Err(e) => e.into_response(),
        }
    }
}

/// Every error answer under `/iceberg` in the REST specification's error model as well:
/// `{"error": {message, type, code}}` beside sluice's `{code, message, details}` (clients
/// such as pyiceberg parse only the former). Runs on the answer of every request under
/// `/iceberg`, so refusals by the key check and the router get it too.
pub(super) fn error_model(head: bool, mut response: Response) -> Response {
    let status = response.status();
    if head || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    // Every error sluice answers keeps its body as a value; other answers (a framework's
    // own refusals, in plain text) are left as they are.
    let Some(ErrorBody(mut value)) = response.extensions_mut().remove::<ErrorBody>() else {
        return response;
    };
    if value.get("error").is_some() {
        return response;
    }
    let kind = match status {
        StatusCode::NOT_FOUND => match value["details"]["kind"].as_str() {
            Some("namespace") => "NoSuchNamespaceException",
            Some("table") => "NoSuchTableException",
            _ => "NotFoundException",
        },
        StatusCode::BAD_REQUEST => "BadRequestException",
        StatusCode::UNAUTHORIZED => "NotAuthorizedException",
        StatusCode::FORBIDDEN => "ForbiddenException",
        StatusCode::METHOD_NOT_ALLOWED => "NotImplementedException",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableException",
        _ => "ServerErrorException",
    };
    value["error"] = json!({
        "message": value["message"].clone(),
        "type": kind,
        "code": status.as_u16(),
    });
    let (mut parts, _) = response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(parts, axum::body::Body::from(value.to_string()))
}

fn ok(body: Value) -> Answer {
    Answer(Ok(Json(body).into_response()))
}

fn no_content() -> Answer {
    Answer(Ok(StatusCode::NO_CONTENT.into_response()))
}

fn no_such(kind: &'static str, name: String) -> Answer {
    let mut e = ApiError::not_found(format!("{kind} {name} does not exist"));
    e.details.insert("kind".into(), json!(kind));
    Answer(Err(e))
}

/// The namespace levels of a path segment (`db` or `db\x1fschema`).
fn levels(namespace: &str) -> Vec<&str> {
    namespace.split(LEVELS).collect()
}

/// The catalog's definitions, refreshed.
async fn root(state: &AppState) -> Result<RootDef, ApiError> {
    state.db.catalog().refresh().await?;
    let (value, _) = state.db.catalog().get(&CatalogPath::Root).await?;
    serde_json::from_value(value).map_err(|e| ApiError::internal(e.to_string()))
}

/// The prefix of `view`'s routes.
fn prefix(view: View) -> &'static str {
    match view {
        View::V3 => "v3",
        View::V2 => "v2",
    }
}

/// The view a warehouse or prefix names (see the module docs).
fn named_view(name: &str) -> Option<View> {
    View::ALL.into_iter().find(|v| prefix(*v) == name)
}

/// The view a request under `/iceberg/v1/` asks for: by its prefix, the segment after `v1`
/// (`namespaces` where there is none). The router only routes `namespaces` or a prefix there.
/// `Err` holds a prefix that names no view.
fn view_of(uri: &Uri) -> Result<View, &str> {
    let first = uri
        .path()
        .strip_prefix("/iceberg/v1/")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_default();
    if first == "namespaces" {
        return Ok(View::V3);
    }
    named_view(first).ok_or(first)
}

/// The answer to a prefix that names no view.
fn no_such_prefix(prefix: &str) -> Answer {
    no_such("prefix", prefix.to_owned())
}

/// Query parameters of the configuration.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ConfigParams {
    #[serde(default)]
    warehouse: Option<String>,
}

/// `GET /iceberg/v1/config[?warehouse=v2|v3]`.
pub(super) async fn config(
    params: Result<Query<ConfigParams>, axum::extract::rejection::QueryRejection>,
) -> Answer {
    let Ok(Query(params)) = params else {
        return ApiError::bad_request("bad query parameters").into();
    };
    let mut overrides = serde_json::Map::new();
    match params.warehouse.as_deref() {
        None | Some("") => {}
        Some(name) => match named_view(name) {
            Some(view) => {
                overrides.insert("prefix".into(), json!(prefix(view)));
            }
            None => {
                let mut e = ApiError::not_found(format!(
                    "warehouse {name} does not exist: sluice serves `v3` (the default, Iceberg \
                     format version 3) and `v2` (format version 2, microsecond timestamps)"
                ));
                e.details.insert("kind".into(), json!("warehouse"));
                return Answer(Err(e));
            }
        },
    }
    let endpoints = [
        "GET /v1/{prefix}/namespaces",
        "GET /v1/{prefix}/namespaces/{namespace}",
        "HEAD /v1/{prefix}/namespaces/{namespace}",
        "GET /v1/{prefix}/namespaces/{namespace}/tables",
        "GET /v1/{prefix}/namespaces/{namespace}/tables/{table}",
        "HEAD /v1/{prefix}/namespaces/{namespace}/tables/{table}",
    ];
    ok(json!({"defaults": {}, "overrides": overrides, "endpoints": endpoints}))
}

/// The path parameters of a namespace's routes (a prefix, if any, is read by [`view_of`]).
#[derive(Debug, Deserialize)]
pub(super) struct NamespacePath {
    namespace: String,
}

/// The path parameters of a table's routes.
#[derive(Debug, Deserialize)]
pub(super) struct TablePath {
    namespace: String,
    table: String,
}

/// Query parameters of the namespace list.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ListNamespaces {
    #[serde(default)]
    parent: Option<String>,
}

/// `GET /iceberg/v1/namespaces[?parent=db]`: the databases, or a database's schemas.
pub(super) async fn list_namespaces(
    State(state): State<AppState>,
    uri: Uri,
    params: Result<Query<ListNamespaces>, axum::extract::rejection::QueryRejection>,
) -> Answer {
    if let Err(prefix) = view_of(&uri) {
        return no_such_prefix(prefix);
    }
    let Ok(Query(params)) = params else {
        return ApiError::bad_request("bad query parameters").into();
    };
    let root = match root(&state).await {
        Ok(r) => r,
        Err(e) => return e.into(),
    };
    let namespaces: Vec<Value> = match params.parent.as_deref().map(levels).as_deref() {
        None | Some([""]) => root.databases.iter().map(|d| json!([d.name])).collect(),
        Some([db]) => match root.databases.iter().find(|d| d.name == *db) {
            Some(d) => d.schemas.iter().map(|s| json!([d.name, s.name])).collect(),
            None => return no_such("namespace", (*db).to_owned()),
        },
        Some([db, schema]) => {
            let exists = root
                .databases
                .iter()
                .any(|d| d.name == *db && d.schemas.iter().any(|s| s.name == *schema));
            if !exists {
                return no_such("namespace", format!("{db}.{schema}"));
            }
            Vec::new()
        }
        Some(other) => return no_such("namespace", other.join(".")),
    };
    ok(json!({"namespaces": namespaces}))
}

/// Whether the namespace exists (and the prefix of `uri`), with its levels.
async fn find_namespace(
    state: &AppState,
    uri: &Uri,
    namespace: &str,
) -> Result<Vec<String>, Answer> {
    view_of(uri).map_err(no_such_prefix)?;
    let root = root(state).await.map_err(Answer::from)?;
    let levels = levels(namespace);
    let found = match levels.as_slice() {
        [db] => root.databases.iter().any(|d| d.name == *db),
        [db, schema] => root
            .databases
            .iter()
            .any(|d| d.name == *db && d.schemas.iter().any(|s| s.name == *schema)),
        _ => false,
    };
    if found {
        Ok(levels.iter().map(|s| (*s).to_owned()).collect())
    } else {
        Err(no_such("namespace", levels.join(".")))
    }
}

/// `GET /iceberg/v1/namespaces/{namespace}`.
pub(super) async fn get_namespace(
    State(state): State<AppState>,
    uri: Uri,
    Path(NamespacePath { namespace }): Path<NamespacePath>,
) -> Answer {
    match find_namespace(&state, &uri, &namespace).await {
        Ok(levels) => ok(json!({"namespace": levels, "properties": {}})),
        Err(answer) => answer,
    }
}

/// `HEAD /iceberg/v1/namespaces/{namespace}`.
pub(super) async fn head_namespace(
    State(state): State<AppState>,
    uri: Uri,
    Path(NamespacePath { namespace }): Path<NamespacePath>,
) -> Answer {
    match find_namespace(&state, &uri, &namespace).await {
        Ok(_) => no_content(),
        Err(answer) => answer,
    }
}

/// `GET /iceberg/v1/namespaces/{namespace}/tables`.
pub(super) async fn list_tables(
    State(state): State<AppState>,
    uri: Uri,
    Path(NamespacePath { namespace }): Path<NamespacePath>,
) -> Answer {
    let levels = match find_namespace(&state, &uri, &namespace).await {
        Ok(l) => l,
        Err(answer) => return answer,
    };
    let [db, schema] = levels.as_slice() else {
        // A database holds schemas, not tables.
        return ok(json!({"identifiers": []}));
    };
    let tables: Vec<Value> = state
        .db
        .catalog()
        .tables()
        .await
        .into_iter()
        .filter(|t| t.database == *db && t.schema == *schema)
        .map(|t| json!({"namespace": [db, schema], "name": t.def.name}))
        .collect();
    ok(json!({"identifiers": tables}))
}

/// The storage id of a table named by namespace and name.
async fn table_id(state: &AppState, namespace: &str, table: &str) -> Result<String, Answer> {
    let levels = levels(namespace);
    let [db, schema] = levels.as_slice() else {
        return Err(no_such("table", format!("{}.{table}", levels.join("."))));
    };
    match state.db.resolve_table(db, schema, table).await {
        Ok(t) => Ok(t.id),
        Err(crate::catalog::CatalogError::NotFound { .. }) => {
            Err(no_such("table", format!("{db}.{schema}.{table}")))
        }
        Err(e) => Err(e.into()),
    }
}

/// `GET /iceberg/v1/namespaces/{namespace}/tables/{table}`: the table's newest metadata, and
/// what a reader needs to read the files (for S3: the endpoint and region; never
/// credentials).
pub(super) async fn load_table(
    State(state): State<AppState>,
    uri: Uri,
    Path(TablePath { namespace, table }): Path<TablePath>,
) -> Answer {
    let view = match view_of(&uri) {
        Ok(view) => view,
        Err(prefix) => return no_such_prefix(prefix),
    };
    let id = match table_id(&state, &namespace, &table).await {
        Ok(id) => id,
        Err(answer) => return answer,
    };
    let published = match state.db.iceberg_view(&id, view).await {
        Ok(p) => p,
        Err(e) => return ApiError::of(&e).into(),
    };
    let mut config = serde_json::Map::new();
    if let Some((endpoint, region)) = state.db.storage().s3_settings() {
        if let Some(endpoint) = endpoint {
            config.insert("s3.endpoint".into(), json!(endpoint));
        }
        if let Some(region) = region {
            config.insert("s3.region".into(), json!(region));
            config.insert("client.region".into(), json!(region));
        }
        config.insert("s3.path-style-access".into(), json!("true"));
    }
    ok(json!({
        "metadata-location": published.location,
        "metadata": published.metadata,
        "config": config,
    }))
}

/// `HEAD /iceberg/v1/namespaces/{namespace}/tables/{table}`.
pub(super) async fn head_table(
    State(state): State<AppState>,
    uri: Uri,
    Path(TablePath { namespace, table }): Path<TablePath>,
) -> Answer {
    if let Err(prefix) = view_of(&uri) {
        return no_such_prefix(prefix);
    }
    match table_id(&state, &namespace, &table).await {
        Ok(_) => no_content(),
        Err(answer) => answer,
    }
}
