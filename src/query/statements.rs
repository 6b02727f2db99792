//! Statements run asynchronously: submitted, polled by id, cancelled.
//!
//! Each statement runs in its own task. Submitting waits a little for it, so short statements
//! answer `finished` at once; longer ones answer `running` and are polled. Finished statements
//! are kept for a while for clients to fetch, then forgotten.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::watch;

use super::{QueryEngine, QueryError, QueryResult};

/// How long a finished statement stays fetchable.
const RETENTION: Duration = Duration::from_secs(15 * 60);

/// Where a statement is.
#[derive(Debug, Clone)]
pub enum StatementState {
    /// Running.
    Running,
    /// Done, with its result.
    Finished(Arc<QueryResult>),
    /// Failed: an error code and message.
    Failed {
        /// Machine-readable code.
        code: &'static str,
        /// What went wrong.
        message: String,
    },
    /// Cancelled before it finished.
    Cancelled,
}

/// One submitted statement.
#[derive(Debug)]
pub struct Statement {
    /// Its id.
    pub id: String,
    /// When it was submitted.
    pub created_at: SystemTime,
    submitted: Instant,
    finished: Mutex<Option<Instant>>,
    state: watch::Sender<StatementState>,
    abort: Mutex<Option<tokio::task::AbortHandle>>,
}

impl Statement {
    /// Its current state.
    pub fn state(&self) -> StatementState {
        self.state.borrow().clone()
    }

    /// Nanoseconds from submission to now (or to its end).
    pub fn elapsed_nanos(&self) -> u64 {
        let end = self
            .finished
            .lock()
            .ok()
            .and_then(|f| *f)
            .unwrap_or_else(Instant::now);
        end.duration_since(self.submitted).as_nanos() as u64
    }

    /// Waits until the statement is no longer running, for at most `timeout`.
    pub async fn wait(&self, timeout: Duration) {
        let mut rx = self.state.subscribe();
        let _ = tokio::time::timeout(
            timeout,
            rx.wait_for(|s| !matches!(s, StatementState::Running)),
        )
        .await;
    }

    fn finish(&self, state: StatementState) {
        if let Ok(mut f) = self.finished.lock() {
            f.get_or_insert_with(Instant::now);
        }
        // Only the first end counts (a cancel racing a finish keeps whichever came first).
        self.state.send_if_modified(|s| {
            if matches!(s, StatementState::Running) {
                *s = state;
                true
            } else {
                false
            }
        });
    }
}

/// The code and message a failed statement reports.
pub fn error_code(e: &QueryError) -> &'static str {
    match e {
        QueryError::Syntax { .. } => "syntax_error",
        QueryError::Query(_) => "query_error",
        QueryError::Catalog(crate::catalog::CatalogError::NotFound { .. }) => "not_found",
        QueryError::Catalog(_) => "catalog_error",
        QueryError::Table(_) => "storage_error",
        QueryError::Cancelled => "cancelled",
    }
}

/// Every statement of this server.
#[derive(Debug, Default)]
pub struct Statements {
    retained: Mutex<Retained>,
}

/// The statements of the last [`RETENTION`] (and the running ones), by id.
#[derive(Debug, Default)]
struct Retained {
    by_id: HashMap<String, Arc<Statement>>,
    /// When expired statements were last dropped: at most once a second, as looking at every
    /// retained statement on every submit made a submit cost grow with the statements of
    /// the last [`RETENTION`].
    last_pruned: Option<Instant>,
}

impl Retained {
    /// Drops the statements finished more than [`RETENTION`] ago, unless that was done less
    /// than a second ago.
    fn drop_expired(&mut self) {
        if self
            .last_pruned
            .is_some_and(|at| at.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        self.last_pruned = Some(Instant::now());
        self.by_id.retain(|_, s| {
            s.finished
                .lock()
                .ok()
                .and_then(|f| *f)
                .is_none_or(|at| at.elapsed() < RETENTION)
        });
    }
}

impl Statements {
    /// Starts `sql` under `id` (a new UUIDv7 when absent). An id already in use answers the
    /// existing statement.
    pub fn submit(&self, engine: QueryEngine, sql: String, id: Option<String>) -> Arc<Statement> {
        let id = id.unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
        let mut retained = self.retained.lock().unwrap_or_else(|p| p.into_inner());
        retained.drop_expired();
        if let Some(existing) = retained.by_id.get(&id) {
            return existing.clone();
        }
        let (state, _) = watch::channel(StatementState::Running);
        let statement = Arc::new(Statement {
            id: id.clone(),
            created_at: SystemTime::now(),
            submitted: Instant::now(),
            finished: Mutex::new(None),
            state,
            abort: Mutex::new(None),
        });
        let running = statement.clone();
        let task = tokio::spawn(async move {
            let outcome = engine.execute(&sql).await;
            running.finish(match outcome {
                Ok(result) => StatementState::Finished(Arc::new(result)),
                Err(e) => StatementState::Failed {
                    code: error_code(&e),
                    message: e.to_string(),
                },
            });
        });
        if let Ok(mut abort) = statement.abort.lock() {
            *abort = Some(task.abort_handle());
        }
        retained.by_id.insert(id, statement.clone());
        statement
    }

    /// The statement with this id.
    pub fn get(&self, id: &str) -> Option<Arc<Statement>> {
        self.retained
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .by_id
            .get(id)
            .cloned()
    }

    /// Cancels a running statement (a finished one keeps its state).
    pub fn cancel(&self, id: &str) -> Option<Arc<Statement>> {
        let statement = self.get(id)?;
        if let Ok(abort) = statement.abort.lock() {
            if let Some(handle) = abort.as_ref() {
                handle.abort();
            }
        }
        statement.finish(StatementState::Cancelled);
        Some(statement)
    }
}
