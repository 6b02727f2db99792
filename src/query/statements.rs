//! Statements run asynchronously: submitted, polled by id, cancelled.
//!
//! Each statement runs in its own task. Submitting waits a little for it, so short statements
//! answer `finished` at once; longer ones answer `running` and are polled. Finished statements
//! are kept for a while for clients to fetch, then forgotten.
//!
//! A statement can be cancelled until it starts to write: an `INSERT` or a catalog change
//! calls [`begin_write`] before its first write, and from then on a cancel leaves it to end
//! with its real outcome (a write cut off halfway would leave the client not knowing what was
//! applied). So a statement answered `cancelled` applied nothing.
//!
//! A statement belongs to the key that submitted it (its *owner*): ids live in one namespace
//! per owner, so another key can neither read, cancel nor take over a statement by naming
//! its id. What is kept is bounded: running statements by count (and one owner's to a
//! quarter of them, so that one key cannot hold every slot), finished ones by count, by the
//! bytes of their results and by age ([`StatementLimits`]). A statement holds its running
//! slot until it has answered *and* its work has ended ([`WorkToken`]): a timeout or a cancel
//! answers at once, but work stuck inside a long poll keeps its slot until it really stops.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use tokio::sync::watch;

use super::{QueryError, StatementOutput};

/// Bounds on the statements a server keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatementLimits {
    /// Statements running at once; past it a submit is refused (retry later). One owner
    /// (key) may run a quarter of them ([`StatementLimits::max_running_per_owner`]).
    pub max_running: usize,
    /// Finished statements kept for fetching; the oldest are forgotten first.
    pub max_retained: usize,
    /// Bytes of results kept for fetching; the oldest are forgotten first.
    pub max_retained_bytes: usize,
    /// How long a finished statement stays fetchable.
    pub retention: Duration,
}

impl Default for StatementLimits {
    fn default() -> Self {
        StatementLimits {
            max_running: 64,
            max_retained: 1000,
            max_retained_bytes: 256 << 20,
            retention: Duration::from_secs(15 * 60),
        }
    }
}

impl StatementLimits {
    /// Statements one owner may run at once: a quarter of [`Self::max_running`] (at least
    /// one), so that statements of one key that run long leave room for other keys'.
    pub fn max_running_per_owner(&self) -> usize {
        self.max_running.div_ceil(4).max(1)
    }
}

/// Where a statement is.
#[derive(Debug, Clone)]
pub(crate) enum StatementState {
    /// Running.
    Running,
    /// Done, with its result.
    Finished(Arc<StatementOutput>),
    /// Failed, with its error (its class says whether anything was applied).
    Failed(Arc<QueryError>),
    /// Cancelled before it wrote anything.
    Cancelled,
}

/// Whether a statement may still be cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not writing yet: a cancel stops it.
    Open,
    /// Writing: it runs to its end.
    Writing,
    /// Cancelled: it must not start writing.
    Cancelled,
}

tokio::task_local! {
    /// The phase of the statement whose work runs in this task.
    static PHASE: Arc<Mutex<Phase>>;
    /// The running slot of the statement whose work runs in this task.
    static WORK: Arc<WorkToken>;
}

/// Holds a statement's running slot while any of its work may still run: its task holds
/// one, and work that may outlive the task (threads a timeout or a cancel cannot stop at
/// once, see [`super::runtime`]) holds another ([`work_token`]). When the last is dropped
/// the work has ended, and the slot is free once the statement has also answered.
#[derive(Debug)]
pub(crate) struct WorkToken {
    registry: std::sync::Weak<Statements>,
    owner: Owner,
    statement: Arc<Statement>,
}

impl Drop for WorkToken {
    fn drop(&mut self) {
        self.statement
            .work_ended
            .store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(registry) = self.registry.upgrade() {
            registry.release(&self.owner, &self.statement);
        }
    }
}

/// The running slot of the statement whose task calls this, for work that may outlive the
/// task (none outside a statement's task).
pub(crate) fn work_token() -> Option<Arc<WorkToken>> {
    WORK.try_with(Arc::clone).ok()
}

/// Called by a statement's work before its first write (a log append, a catalog change):
/// from then on a cancel no longer stops it. Fails with [`QueryError::Cancelled`] when the
/// statement was cancelled first. Outside a statement's task (an embedder's
/// [`crate::db::Database::execute`]) there is nothing to cancel.
pub(crate) fn begin_write() -> Result<(), QueryError> {
    PHASE
        .try_with(|phase| {
            let mut phase = phase.lock().unwrap_or_else(|p| p.into_inner());
            if *phase == Phase::Cancelled {
                return Err(QueryError::Cancelled);
            }
            *phase = Phase::Writing;
            Ok(())
        })
        .unwrap_or(Ok(()))
}

/// One submitted statement.
#[derive(Debug)]
pub(crate) struct Statement {
    /// Its id (unique for its owner).
    pub id: String,
    /// When it was submitted.
    pub created_at: SystemTime,
    submitted: Instant,
    finished: Mutex<Option<Instant>>,
    state: watch::Sender<StatementState>,
    abort: Mutex<Option<tokio::task::AbortHandle>>,
    phase: Arc<Mutex<Phase>>,
    /// What its result weighs ([`StatementOutput::memory_bytes`]), measured once it ends.
    bytes: std::sync::atomic::AtomicUsize,
    /// Nothing of its work runs any more (its last [`WorkToken`] was dropped).
    work_ended: std::sync::atomic::AtomicBool,
}

impl Statement {
    /// Its current state.
    pub(crate) fn state(&self) -> StatementState {
        self.state.borrow().clone()
    }

    /// Nanoseconds from submission to now (or to its end).
    pub(crate) fn elapsed_nanos(&self) -> u64 {
        let end = self
            .finished
            .lock()
            .ok()
            .and_then(|f| *f)
            .unwrap_or_else(Instant::now);
        end.duration_since(self.submitted).as_nanos() as u64
    }

    /// Waits until the statement is no longer running, for at most `timeout`.
    pub(crate) async fn wait(&self, timeout: Duration) {
        let mut rx = self.state.subscribe();
        let _ = tokio::time::timeout(
            timeout,
            rx.wait_for(|s| !matches!(s, StatementState::Running)),
        )
        .await;
    }

    fn finished_at(&self) -> Option<Instant> {
        self.finished.lock().ok().and_then(|f| *f)
    }

    /// Bytes its result holds (0 unless finished).
    fn result_bytes(&self) -> usize {
        self.bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Ends the statement; only the first end counts (a cancel racing a finish keeps
    /// whichever came first). Returns whether this call ended it.
    fn finish(&self, state: StatementState) -> bool {
        let bytes = match &state {
            StatementState::Finished(output) => output.memory_bytes(),
            _ => 0,
        };
        let ended = self.state.send_if_modified(|s| {
            if matches!(s, StatementState::Running) {
                *s = state;
                true
            } else {
                false
            }
        });
        if ended {
            self.bytes
                .store(bytes, std::sync::atomic::Ordering::Relaxed);
            if let Ok(mut f) = self.finished.lock() {
                f.get_or_insert_with(Instant::now);
            }
        }
        ended
    }
}

/// Why a statement was not started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum SubmitError {
    /// As many statements as allowed are running.
    #[error("{0} statements are running, the most this server runs at once; retry shortly")]
    Busy(usize),
    /// As many statements of this owner as one owner may run are running.
    #[error(
        "{0} statements of this key are running, the most one key runs at once; retry \
         shortly"
    )]
    OwnerBusy(usize),
}

/// Who a statement belongs to: an opaque name of the key that submitted it.
pub(crate) type Owner = Arc<str>;

/// Every statement of this server.
#[derive(Debug, Default)]
pub(crate) struct Statements {
    limits: StatementLimits,
    retained: Mutex<Retained>,
}

/// The running statements and the finished ones still kept, by owner and id.
///
/// Totals of what finished statements weigh are kept as they change, so that ending a
/// statement costs a few map operations, not a pass over everything kept (with the default
/// limits a thousand results are kept, and a pass per statement was a tenth of a small
/// query's CPU). A statement counts as finished here once its end is counted under the
/// registry's lock ([`Retained::count_end`]), not when its state changes: the totals and
/// what is forgotten always agree.
#[derive(Debug, Default)]
struct Retained {
    by_owner: HashMap<Owner, OwnerKept>,
    running: usize,
    /// Finished statements kept, and the bytes of their results.
    finished: usize,
    bytes: usize,
    /// When expired statements were last looked for: at most once a second.
    last_swept: Option<Instant>,
}

/// One owner's statements.
#[derive(Debug, Default)]
struct OwnerKept {
    by_id: HashMap<String, Kept>,
    /// Ids in submission order: the oldest finished statements are forgotten first.
    order: VecDeque<String>,
    /// Finished statements kept, and the bytes of their results.
    finished: usize,
    bytes: usize,
}

impl OwnerKept {
    /// The owner's statements still running.
    fn running(&self) -> usize {
        self.by_id.len() - self.finished
    }
}

#[derive(Debug)]
struct Kept {
    statement: Arc<Statement>,
    /// Its end is counted in the totals.
    counted: bool,
}

impl Retained {
    fn get(&self, owner: &Owner, id: &str) -> Option<&Arc<Statement>> {
        Some(&self.by_owner.get(owner)?.by_id.get(id)?.statement)
    }

    fn insert(&mut self, owner: &Owner, statement: Arc<Statement>) {
        let kept = self.by_owner.entry(owner.clone()).or_default();
        kept.order.push_back(statement.id.clone());
        kept.by_id.insert(
            statement.id.clone(),
            Kept {
                statement,
                counted: false,
            },
        );
        self.running += 1;
    }

    /// Counts the end of the owner's statement `id` (once).
    fn count_end(&mut self, owner: &Owner, id: &str) {
        let Some(kept) = self.by_owner.get_mut(owner) else {
            return;
        };
        let Some(entry) = kept.by_id.get_mut(id) else {
            return;
        };
        if entry.counted {
            return;
        }
        entry.counted = true;
        let bytes = entry.statement.result_bytes();
        kept.finished += 1;
        kept.bytes += bytes;
        self.finished += 1;
        self.bytes += bytes;
        self.running = self.running.saturating_sub(1);
    }

    /// Forgets the owner's statement at `index` of its order (a finished one).
    fn forget(&mut self, owner: &Owner, index: usize) {
        let Some(kept) = self.by_owner.get_mut(owner) else {
            return;
        };
        if let Some(id) = kept.order.remove(index)
            && let Some(entry) = kept.by_id.remove(&id)
            && entry.counted
        {
            let bytes = entry.statement.result_bytes();
            kept.finished -= 1;
            kept.bytes -= bytes;
            self.finished -= 1;
            self.bytes -= bytes;
        }
        if kept.order.is_empty() {
            self.by_owner.remove(owner);
        }
    }

    /// Forgets finished statements older than the retention (looked for at most once a
    /// second), and the oldest finished ones while more, or more bytes, are kept than the
    /// limits allow.
    fn prune(&mut self, limits: &StatementLimits) {
        let now = Instant::now();
        if self
            .last_swept
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(1))
        {
            self.last_swept = Some(now);
            let owners: Vec<Owner> = self.by_owner.keys().cloned().collect();
            for owner in owners {
                let mut index = 0;
                while let Some(kept) = self.by_owner.get(&owner)
                    && let Some(id) = kept.order.get(index)
                {
                    let expired = kept.by_id.get(id).is_some_and(|e| {
                        e.counted
                            && e.statement
                                .finished_at()
                                .is_some_and(|at| now.duration_since(at) >= limits.retention)
                    });
                    if expired {
                        self.forget(&owner, index);
                    } else {
                        index += 1;
                    }
                }
            }
        }
        // Over the limits, the owner keeping the most gives up its oldest: one key cannot
        // push another's results out.
        while self.finished > limits.max_retained || self.bytes > limits.max_retained_bytes {
            let by_bytes = self.bytes > limits.max_retained_bytes;
            let Some((heaviest, kept)) = self
                .by_owner
                .iter()
                .filter(|(_, k)| k.finished > 0)
                .max_by_key(|(_, k)| if by_bytes { k.bytes } else { k.finished })
            else {
                break;
            };
            // Running statements (at most `max_running`) are passed over.
            let oldest = kept
                .order
                .iter()
                .position(|id| kept.by_id.get(id).is_some_and(|e| e.counted));
            let Some(index) = oldest else { break };
            let heaviest = heaviest.clone();
            self.forget(&heaviest, index);
        }
    }
}

impl Statements {
    /// A registry with these limits.
    pub(crate) fn new(limits: StatementLimits) -> Self {
        Statements {
            limits,
            retained: Mutex::new(Retained::default()),
        }
    }

    /// The limits.
    pub(crate) fn limits(&self) -> &StatementLimits {
        &self.limits
    }

    fn retained(&self) -> std::sync::MutexGuard<'_, Retained> {
        self.retained.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts `work` as the statement `id` of `owner` (a new UUIDv7 when absent). An id the
    /// owner already uses answers that statement; nothing new runs.
    pub(crate) fn submit<F>(
        self: &Arc<Self>,
        owner: &Owner,
        id: Option<String>,
        work: F,
    ) -> Result<Arc<Statement>, SubmitError>
    where
        F: std::future::Future<Output = Result<StatementOutput, QueryError>> + Send + 'static,
    {
        let id = id.unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
        let mut retained = self.retained();
        retained.prune(&self.limits);
        if let Some(existing) = retained.get(owner, &id) {
            return Ok(existing.clone());
        }
        if retained.running >= self.limits.max_running {
            return Err(SubmitError::Busy(self.limits.max_running));
        }
        let per_owner = self.limits.max_running_per_owner();
        if retained
            .by_owner
            .get(owner)
            .is_some_and(|k| k.running() >= per_owner)
        {
            return Err(SubmitError::OwnerBusy(per_owner));
        }
        let (state, _) = watch::channel(StatementState::Running);
        let statement = Arc::new(Statement {
            id,
            created_at: SystemTime::now(),
            submitted: Instant::now(),
            finished: Mutex::new(None),
            state,
            abort: Mutex::new(None),
            phase: Arc::new(Mutex::new(Phase::Open)),
            bytes: std::sync::atomic::AtomicUsize::new(0),
            work_ended: std::sync::atomic::AtomicBool::new(false),
        });
        let running = statement.clone();
        let running_owner = owner.clone();
        let registry = self.clone();
        let phase = statement.phase.clone();
        let token = Arc::new(WorkToken {
            registry: Arc::downgrade(self),
            owner: owner.clone(),
            statement: statement.clone(),
        });
        let task = tokio::spawn(async move {
            use futures::FutureExt as _;
            // A panic in the work (a bug) ends the statement as failed: it must not stay
            // "running" for ever and hold a running slot.
            let outcome = std::panic::AssertUnwindSafe(
                WORK.scope(Arc::clone(&token), PHASE.scope(phase.clone(), work)),
            )
            .catch_unwind()
            .await;
            let state = match outcome {
                Ok(Ok(result)) => StatementState::Finished(Arc::new(result)),
                Ok(Err(e)) => StatementState::Failed(Arc::new(e)),
                Err(_) => {
                    let wrote = *phase.lock().unwrap_or_else(|p| p.into_inner()) == Phase::Writing;
                    tracing::error!(wrote, "a statement panicked");
                    StatementState::Failed(Arc::new(QueryError::Panicked { wrote }))
                }
            };
            registry.end(&running_owner, &running, state);
            drop(token);
        });
        if let Ok(mut abort) = statement.abort.lock() {
            *abort = Some(task.abort_handle());
        }
        retained.insert(owner, statement.clone());
        Ok(statement)
    }

    /// Ends a statement (its answer), and frees its running slot if its work has ended.
    fn end(&self, owner: &Owner, statement: &Statement, state: StatementState) {
        if statement.finish(state) {
            self.release(owner, statement);
        }
    }

    /// Frees the statement's running slot once it has answered and its work has ended (the
    /// later of the two calls this with both true: each sets its own flag before it looks at
    /// the other's under the registry's lock), and brings the kept results back within the
    /// limits.
    fn release(&self, owner: &Owner, statement: &Statement) {
        let mut retained = self.retained();
        let answered = !matches!(statement.state(), StatementState::Running);
        if answered
            && statement
                .work_ended
                .load(std::sync::atomic::Ordering::SeqCst)
        {
            retained.count_end(owner, &statement.id);
        }
        retained.prune(&self.limits);
    }

    /// The owner's statement with this id.
    pub(crate) fn get(&self, owner: &Owner, id: &str) -> Option<Arc<Statement>> {
        self.retained().get(owner, id).cloned()
    }

    /// Cancels the owner's statement if it has not started writing (a finished one keeps
    /// its state; one that is writing ends with its real outcome).
    pub(crate) fn cancel(&self, owner: &Owner, id: &str) -> Option<Arc<Statement>> {
        let statement = self.get(owner, id)?;
        let cancelled = {
            // Under the phase lock: the work cannot start writing once this decides.
            let mut phase = statement.phase.lock().unwrap_or_else(|p| p.into_inner());
            if *phase == Phase::Open {
                *phase = Phase::Cancelled;
                if let Ok(abort) = statement.abort.lock()
                    && let Some(handle) = abort.as_ref()
                {
                    handle.abort();
                }
                true
            } else {
                false
            }
        };
        if cancelled {
            self.end(owner, &statement, StatementState::Cancelled);
        }
        Some(statement)
    }

    /// Finished statements kept, and the bytes of their results.
    #[cfg(test)]
    fn kept(&self) -> (usize, usize) {
        let retained = self.retained();
        let finished: Vec<&Kept> = retained
            .by_owner
            .values()
            .flat_map(|k| k.by_id.values())
            .filter(|e| e.counted)
            .collect();
        let kept = (
            finished.len(),
            finished.iter().map(|e| e.statement.result_bytes()).sum(),
        );
        assert_eq!(
            kept,
            (retained.finished, retained.bytes),
            "the totals drifted"
        );
        kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owner(name: &str) -> Owner {
        Arc::from(name)
    }

    #[tokio::test]
    async fn ids_are_per_owner_and_kept_results_are_bounded() {
        let limits = StatementLimits {
            max_running: 2,
            max_retained: 3,
            max_retained_bytes: usize::MAX,
            retention: Duration::from_secs(60),
        };
        let statements = Arc::new(Statements::new(limits));
        let done = || async { Ok(StatementOutput::text("x", vec!["1".into()])) };
        let a = statements
            .submit(&owner("reader"), Some("s1".into()), done())
            .unwrap();
        a.wait(Duration::from_secs(5)).await;
        // Another owner naming the same id gets a statement of its own.
        let b = statements
            .submit(&owner("admin"), Some("s1".into()), done())
            .unwrap();
        assert!(!Arc::ptr_eq(&a, &b));
        assert!(statements.get(&owner("admin"), "s1").is_some());
        assert!(statements.get(&owner("other"), "s1").is_none());
        assert!(statements.cancel(&owner("other"), "s1").is_none());
        b.wait(Duration::from_secs(5)).await;
        for i in 0..10 {
            let s = statements
                .submit(&owner("reader"), Some(format!("n{i}")), done())
                .unwrap();
            s.wait(Duration::from_secs(5)).await;
        }
        assert!(statements.kept().0 <= 3, "{:?}", statements.kept());
        // The reader's flood pushed out its own statements, not the admin's.
        assert!(statements.get(&owner("admin"), "s1").is_some());
        let forever = || async {
            std::future::pending::<()>().await;
            Ok(StatementOutput::text("x", Vec::new()))
        };
        // Running statements are capped, one owner's to a quarter of them (at least one).
        statements.submit(&owner("r"), None, forever()).unwrap();
        assert_eq!(
            statements.submit(&owner("r"), None, forever()).unwrap_err(),
            SubmitError::OwnerBusy(1)
        );
        statements.submit(&owner("w"), None, forever()).unwrap();
        assert_eq!(
            statements.submit(&owner("x"), None, forever()).unwrap_err(),
            SubmitError::Busy(2)
        );
    }

    #[tokio::test]
    async fn kept_results_stay_within_their_bytes_and_age() {
        let one = StatementOutput::text("x", vec!["1".into()]).memory_bytes();
        let limits = StatementLimits {
            max_running: 64,
            max_retained: 1000,
            max_retained_bytes: 10 * one,
            retention: Duration::ZERO,
        };
        let statements = Arc::new(Statements::new(limits));
        let done = || async { Ok(StatementOutput::text("x", vec!["1".into()])) };
        let mut last = None;
        for i in 0..40 {
            let name = ["a", "b", "c"][i % 3];
            let s = statements.submit(&owner(name), None, done()).unwrap();
            s.wait(Duration::from_secs(5)).await;
            last = Some((name, s));
        }
        // `kept` also checks the running totals against what is kept.
        let (count, bytes) = statements.kept();
        assert!(
            bytes <= 10 * one && count > 0,
            "{count} kept, {bytes} bytes"
        );
        // Past the retention they go at the next look, a second after the last.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let (name, last) = last.unwrap();
        assert!(statements.get(&owner(name), &last.id).is_some());
        statements.submit(&owner("d"), None, done()).unwrap();
        assert!(statements.get(&owner(name), &last.id).is_none());
        assert!(statements.kept().0 <= 1);
    }

    #[tokio::test]
    async fn a_statement_is_cancelled_only_before_it_writes() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let statements = Arc::new(Statements::new(StatementLimits::default()));
        let gate = Arc::new(tokio::sync::Notify::new());
        let wrote = Arc::new(AtomicBool::new(false));
        // Cancelled while reading: it never writes, and answers cancelled.
        let work = {
            let (gate, wrote) = (gate.clone(), wrote.clone());
            async move {
                gate.notified().await;
                begin_write()?;
                wrote.store(true, Ordering::SeqCst);
                Ok(StatementOutput::inserted(1))
            }
        };
        let s = statements.submit(&owner("w"), None, work).unwrap();
        statements.cancel(&owner("w"), &s.id);
        gate.notify_one();
        s.wait(Duration::from_secs(5)).await;
        assert!(matches!(s.state(), StatementState::Cancelled));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!wrote.load(Ordering::SeqCst), "a cancelled statement wrote");
        // Cancelled while writing: the cancel does not cut it off; it ends with its outcome.
        let started = Arc::new(tokio::sync::Notify::new());
        let finish = Arc::new(tokio::sync::Notify::new());
        let work = {
            let (started, finish, wrote) = (started.clone(), finish.clone(), wrote.clone());
            async move {
                begin_write()?;
                started.notify_one();
                finish.notified().await;
                wrote.store(true, Ordering::SeqCst);
                Ok(StatementOutput::inserted(1))
            }
        };
        let s = statements.submit(&owner("w"), None, work).unwrap();
        started.notified().await;
        statements.cancel(&owner("w"), &s.id);
        assert!(matches!(s.state(), StatementState::Running));
        finish.notify_one();
        s.wait(Duration::from_secs(5)).await;
        assert!(matches!(s.state(), StatementState::Finished(_)));
        assert!(wrote.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn a_panicking_statement_fails_and_frees_its_running_slot() {
        let limits = StatementLimits {
            max_running: 1,
            ..StatementLimits::default()
        };
        let statements = Arc::new(Statements::new(limits));
        for wrote in [false, true] {
            let work = async move {
                if wrote {
                    begin_write()?;
                }
                if true {
                    panic!("a bug");
                }
                Ok(StatementOutput::inserted(1))
            };
            let s = statements.submit(&owner("w"), None, work).unwrap();
            s.wait(Duration::from_secs(5)).await;
            match s.state() {
                StatementState::Failed(e) => {
                    assert!(matches!(*e, QueryError::Panicked { wrote: w } if w == wrote));
                }
                other => panic!("{other:?}"),
            }
        }
        // The one running slot is free again.
        let done = async { Ok(StatementOutput::text("x", vec!["1".into()])) };
        let s = statements.submit(&owner("w"), None, done).unwrap();
        s.wait(Duration::from_secs(5)).await;
        assert!(matches!(s.state(), StatementState::Finished(_)));
    }
}
