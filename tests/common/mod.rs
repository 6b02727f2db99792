//! Helpers shared by the integration tests that run a server in this process.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};
use sluice::db::Database;
use sluice::http::{AppState, router};

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A fresh, empty directory under the system temp dir, unique to this process and call.
pub fn temp_dir(prefix: &str) -> PathBuf {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("sluice-{prefix}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Serves `db` over HTTP on a free loopback port.
pub async fn serve(
    db: Arc<Database>,
    keys: Vec<String>,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(AppState::new(db, keys));
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (addr, task)
}

/// The seed's `events` table definition.
pub fn events_def() -> Value {
    json!({"name": "events", "comment": null, "columns": [
        {"name": "time", "data_type": "timestamp"},
        {"name": "service", "data_type": "string"},
        {"name": "name", "data_type": "string"},
        {"name": "message", "data_type": "string"},
        {"name": "var", "data_type": "object"}
    ]})
}
