//! `GET/PUT/DELETE /v1/catalog[/databases/{db}[/schemas/{s}[/tables/{t}]]]`.

use axum::Json;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::{ApiError, AppState};
use crate::catalog::{CatalogPath, MutateOptions, hide_ids};

/// Query parameters of catalog mutations.
#[derive(Debug, Default, Deserialize)]
pub(super) struct MutationParams {
    #[serde(default)]
    dry_run: Option<bool>,
    #[serde(default)]
    allow_destructive: Option<bool>,
    #[serde(default)]
    with_ids: Option<bool>,
}

/// Query parameters of catalog reads.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ReadParams {
    /// Answer the catalog's own fields too (columns' `id`, tables' `last_column_id` and
    /// `schema_id`); without it the answer is ScopeDB-shaped (see [`hide_ids`]).
    #[serde(default)]
    with_ids: Option<bool>,
}

fn with_etag(body: serde_json::Value, version: u64) -> Response {
    let mut response = Json(body).into_response();
    if let Ok(v) = HeaderValue::from_str(&format!("\"{version}\"")) {
        response.headers_mut().insert(header::ETAG, v);
    }
    response
}

async fn read(
    state: &AppState,
    path: CatalogPath,
    params: ReadParams,
) -> Result<Response, ApiError> {
    state.db.catalog().refresh().await?;
    let (mut value, version) = state.db.catalog().get(&path).await?;
    if !params.with_ids.unwrap_or(false) {
        hide_ids(&path, &mut value);
    }
    Ok(with_etag(value, version))
}

async fn write(
    state: &AppState,
    path: CatalogPath,
    headers: &HeaderMap,
    params: MutationParams,
    body: Option<serde_json::Value>,
) -> Result<Response, ApiError> {
    let if_match = headers.get(header::IF_MATCH).and_then(|v| v.to_str().ok());
    let m = state
        .db
        .mutate_catalog(
            &path,
            body,
            MutateOptions {
                if_match,
                dry_run: params.dry_run.unwrap_or(false),
                allow_destructive: params.allow_destructive.unwrap_or(false),
            },
        )
        .await?;
    let mut m = m;
    if !params.with_ids.unwrap_or(false) {
        for side in [&mut m.before, &mut m.after].into_iter().flatten() {
            hide_ids(&path, side);
        }
    }
    let version = m.version;
    let body = serde_json::to_value(&m).map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(with_etag(body, version))
}

pub(super) async fn get_root(
    State(state): State<AppState>,
    Query(params): Query<ReadParams>,
) -> Result<Response, ApiError> {
    read(&state, CatalogPath::Root, params).await
}

pub(super) async fn put_root(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(params): Query<MutationParams>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let body: serde_json::Value =
        super::read_json(&state, None, &headers, body, "a JSON definition").await?;
    write(&state, CatalogPath::Root, &headers, params, Some(body)).await
}

pub(super) async fn get_database(
    State(state): State<AppState>,
    Path(db): Path<String>,
    Query(params): Query<ReadParams>,
) -> Result<Response, ApiError> {
    read(&state, CatalogPath::Database(db), params).await
}

pub(super) async fn put_database(
    State(state): State<AppState>,
    Path(db): Path<String>,
    headers: HeaderMap,
    Query(params): Query<MutationParams>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let body: serde_json::Value =
        super::read_json(&state, None, &headers, body, "a JSON definition").await?;
    write(
        &state,
        CatalogPath::Database(db),
        &headers,
        params,
        Some(body),
    )
    .await
}

pub(super) async fn delete_database(
    State(state): State<AppState>,
    Path(db): Path<String>,
    headers: HeaderMap,
    Query(params): Query<MutationParams>,
) -> Result<Response, ApiError> {
    write(&state, CatalogPath::Database(db), &headers, params, None).await
}

pub(super) async fn get_schema(
    State(state): State<AppState>,
    Path((db, schema)): Path<(String, String)>,
    Query(params): Query<ReadParams>,
) -> Result<Response, ApiError> {
    read(&state, CatalogPath::Schema(db, schema), params).await
}

pub(super) async fn put_schema(
    State(state): State<AppState>,
    Path((db, schema)): Path<(String, String)>,
    headers: HeaderMap,
    Query(params): Query<MutationParams>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let body: serde_json::Value =
        super::read_json(&state, None, &headers, body, "a JSON definition").await?;
    write(
        &state,
        CatalogPath::Schema(db, schema),
        &headers,
        params,
        Some(body),
    )
    .await
}

pub(super) async fn delete_schema(
    State(state): State<AppState>,
    Path((db, schema)): Path<(String, String)>,
    headers: HeaderMap,
    Query(params): Query<MutationParams>,
) -> Result<Response, ApiError> {
    write(
        &state,
        CatalogPath::Schema(db, schema),
        &headers,
        params,
        None,
    )
    .await
}

pub(super) async fn get_table(
    State(state): State<AppState>,
    Path((db, schema, table)): Path<(String, String, String)>,
    Query(params): Query<ReadParams>,
) -> Result<Response, ApiError> {
    read(&state, CatalogPath::Table(db, schema, table), params).await
}

pub(super) async fn put_table(
    State(state): State<AppState>,
    Path((db, schema, table)): Path<(String, String, String)>,
    headers: HeaderMap,
    Query(params): Query<MutationParams>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let body: serde_json::Value =
        super::read_json(&state, None, &headers, body, "a JSON definition").await?;
    write(
        &state,
        CatalogPath::Table(db, schema, table),
        &headers,
        params,
        Some(body),
    )
    .await
}

pub(super) async fn delete_table(
    State(state): State<AppState>,
    Path((db, schema, table)): Path<(String, String, String)>,
    headers: HeaderMap,
    Query(params): Query<MutationParams>,
) -> Result<Response, ApiError> {
    write(
        &state,
        CatalogPath::Table(db, schema, table),
        &headers,
        params,
        None,
    )
    .await
}

/// `GET .../tables/{table}/stats`: how many rows a table holds and where they are (Parquet
/// files on object storage, or committed batches not yet flushed).
/// With `?files=true` it also lists the Parquet files (path relative to the storage root,
/// rows, bytes).
pub(super) async fn get_table_stats(
    State(state): State<AppState>,
    Path((db, schema, table)): Path<(String, String, String)>,
    params: Result<Query<StatsParams>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(params) =
        params.map_err(|e| ApiError::bad_request(format!("bad query: {}", e.body_text())))?;
    let stats = state.db.table_stats(&db, &schema, &table).await?;
    let mut body = serde_json::json!({
        "rows": stats.file_rows + stats.unflushed_rows,
        "files": stats.files,
        "file_bytes": stats.file_bytes,
        "file_rows": stats.file_rows,
        "unflushed_batches": stats.unflushed_batches,
        "unflushed_bytes": stats.unflushed_bytes,
        "spilled_bytes": stats.spilled_bytes,
        "unflushed_rows": stats.unflushed_rows,
    });
    if params.files.unwrap_or(false) {
        let files = state.db.table_files(&db, &schema, &table).await?;
        body["file_list"] = files
            .iter()
            .map(|f| serde_json::json!({"path": f.path, "rows": f.rows, "bytes": f.bytes}))
            .collect();
    }
    Ok(Json(body).into_response())
}

/// Query parameters of the table stats.
#[derive(Debug, Default, Deserialize)]
pub(super) struct StatsParams {
    #[serde(default)]
    files: Option<bool>,
}
