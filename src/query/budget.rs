//! What one statement may use while it plans and runs, and how it is stopped.
//!
//! A statement gets a [`StatementBudget`] when it starts. It holds:
//!
//! - **Memory** ([`StatementMemory`]): the statement's own DataFusion memory pool, layered over
//!   the server's ([`super::QueryLimits::memory_bytes`], shared by every running statement).
//!   Everything the statement holds is counted in both: its operators' reservations (sorts,
//!   joins, aggregations, the batches a recursive query keeps), the results of its functions
//!   while anything still holds them ([`super::guard`]), what its plan costs to build and
//!   optimize, and what its plan's constants can cost once broadcast to every row of a batch
//!   ([`super::plan_limits`]), what its window functions emit and its joins output
//!   ([`super::operator_memory`]). Before any of that, its text reserves what parsing and
//!   planning it can take in the server's pool alone ([`super::QueryEngine::prepare`]). A request past the statement's own limit fails for good (the
//!   statement needs more than a statement may have); a request the server cannot grant
//!   because other statements hold the rest fails as "retry later". Either way DataFusion
//!   sees `ResourcesExhausted`, and [`StatementBudget::error`] classifies it.
//! - **Time and cancellation**: the statement's deadline and a stop flag. Planning is
//!   synchronous and runs on a thread of its own ([`super::runtime`]): it looks at the flag
//!   between analyzer and optimizer rules and at every function call
//!   ([`StatementBudget::checkpoint`]), so a timeout or a cancel stops it there.
//!
//! The budget reaches code DataFusion calls (functions, optimizer rules) through the
//! statement's configuration: [`BudgetOption`] is a configuration extension that holds it.
//!
//! Invariants: what a statement has reserved is returned to the server's pool when the
//! statement ends ([`StatementBudget::close`]), even if some of its arrays live on in its kept
//! result (those are bounded by the statements' retention limits instead); a reservation
//! dropped later changes nothing on the server's side.

use std::any::Any;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use datafusion::common::config::{ConfigEntry, ConfigExtension, ExtensionOptions};
use datafusion::config::ConfigOptions;
use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::memory_pool::{
    MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation,
};

use super::QueryError;

/// Why a statement was stopped.
const RUNNING: u8 = 0;
const CANCELLED: u8 = 1;
const TIMED_OUT: u8 = 2;

/// Why a memory request was refused (the first refusal is what the statement answers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// The statement alone would pass its limit.
    OverStatement,
    /// Other statements hold the rest of the server's pool.
    ServerFull,
}

/// One statement's memory pool (see the module docs).
#[derive(Debug)]
pub(crate) struct StatementMemory {
    limit: usize,
    ledger: Mutex<Ledger>,
}

#[derive(Debug)]
struct Ledger {
    /// Bytes the statement's reservations hold.
    used: usize,
    /// The same bytes, held in the server's pool (until the statement ends).
    server: MemoryReservation,
    /// The statement ended: nothing more is granted, and what it held is returned.
    closed: bool,
    /// The first refusal, and what it said.
    refused: Option<(Refusal, String)>,
}

impl StatementMemory {
    fn new(server: &Arc<dyn MemoryPool>, limit: usize) -> StatementMemory {
        StatementMemory {
            limit,
            ledger: Mutex::new(Ledger {
                used: 0,
                server: MemoryConsumer::new("statement").register(server),
                closed: false,
                refused: None,
            }),
        }
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Returns what the statement holds to the server's pool; nothing more is granted.
    fn close(&self) {
        let mut ledger = self.ledger();
        ledger.closed = true;
        ledger.server.free();
    }

    fn refused(&self) -> Option<(Refusal, String)> {
        self.ledger().refused.clone()
    }
}

impl std::fmt::Display for StatementMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "statement(used: {}, limit: {})",
            self.ledger().used,
            self.limit
        )
    }
}

impl MemoryPool for StatementMemory {
    fn name(&self) -> &str {
        "statement"
    }

    fn grow(&self, _reservation: &MemoryReservation, additional: usize) {
        let mut ledger = self.ledger();
        ledger.used = ledger.used.saturating_add(additional);
        if !ledger.closed {
            ledger.server.grow(additional);
        }
    }

    fn shrink(&self, _reservation: &MemoryReservation, shrink: usize) {
        let mut ledger = self.ledger();
        ledger.used = ledger.used.saturating_sub(shrink);
        if !ledger.closed {
            let held = ledger.server.size();
            ledger.server.shrink(shrink.min(held));
        }
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> DfResult<()> {
        let mut ledger = self.ledger();
        let asker = reservation.consumer().name();
        if ledger.closed {
            return Err(DataFusionError::ResourcesExhausted(format!(
                "{asker} asked for {additional} bytes after its statement ended"
            )));
        }
        if ledger.used.saturating_add(additional) > self.limit {
            let message = format!(
                "the statement needs more memory than a statement may use \
                 (query_memory_bytes, {} bytes): {asker} asked for {additional} bytes \
                 with {} held",
                self.limit, ledger.used
            );
            ledger
                .refused
                .get_or_insert((Refusal::OverStatement, message.clone()));
            return Err(DataFusionError::ResourcesExhausted(message));
        }
        if ledger.server.try_grow(additional).is_err() {
            let message = format!(
                "the running statements hold the server's statement memory \
                 (query_memory_bytes, {} bytes): {asker} asked for {additional} bytes; \
                 retry shortly",
                self.limit
            );
            ledger
                .refused
                .get_or_insert((Refusal::ServerFull, message.clone()));
            return Err(DataFusionError::ResourcesExhausted(message));
        }
        ledger.used += additional;
        Ok(())
    }

    fn reserved(&self) -> usize {
        self.ledger().used
    }

    fn memory_limit(&self) -> MemoryLimit {
        MemoryLimit::Finite(self.limit)
    }
}

/// What one statement may use, and its stop flag (see the module docs).
#[derive(Debug)]
pub(crate) struct StatementBudget {
    memory: Arc<StatementMemory>,
    /// `memory`, as DataFusion takes a pool.
    pool: Arc<dyn MemoryPool>,
    /// Reservations that last as long as the statement: its plan, the constants folded into
    /// it, function results that are single values.
    lifetime: MemoryReservation,
    /// What the statement's text reserved for its syntax tree and plans, counted against
    /// the statement's own limit from when it runs.
    _text: MemoryReservation,
    stop: AtomicU8,
    deadline: Instant,
    timeout: Duration,
}

/// A statement stopped by its timeout or a cancel, as DataFusion carries it.
#[derive(Debug, thiserror::Error)]
#[error("the statement was stopped")]
struct Stopped;

impl StatementBudget {
    /// A budget of `limit` bytes in the server's pool `server`, for a statement that may run
    /// for `timeout` from now.
    #[cfg(test)]
    pub(crate) fn new(
        server: &Arc<dyn MemoryPool>,
        limit: usize,
        timeout: Duration,
    ) -> Arc<StatementBudget> {
        Self::holding(server, limit, timeout, None)
    }

    /// [`StatementBudget::new`], taking over `text`, the server memory the statement's text
    /// reserved before its parse ([`super::QueryEngine::prepare`]): from here it counts
    /// against the statement's own limit, so that a statement past its limit is refused as
    /// its own excess, never as a full server.
    pub(crate) fn holding(
        server: &Arc<dyn MemoryPool>,
        limit: usize,
        timeout: Duration,
        text: Option<MemoryReservation>,
    ) -> Arc<StatementBudget> {
        let memory = Arc::new(StatementMemory::new(server, limit));
        let pool: Arc<dyn MemoryPool> = memory.clone();
        let lifetime = MemoryConsumer::new("statement plan and constants").register(&pool);
        let text_hold = MemoryConsumer::new("statement text").register(&pool);
        if let Some(text) = text {
            // Held in the server's pool twice for a moment, never released in between.
            text_hold.grow(text.size());
            drop(text);
        }
        Arc::new(StatementBudget {
            memory,
            pool,
            lifetime,
            _text: text_hold,
            stop: AtomicU8::new(RUNNING),
            deadline: Instant::now() + timeout,
            timeout,
        })
    }

    /// The statement's memory pool.
    pub(crate) fn pool(&self) -> &Arc<dyn MemoryPool> {
        &self.pool
    }

    /// Reserves `bytes` for `what` (released when the reservation is dropped).
    pub(crate) fn reserve(&self, what: &str, bytes: usize) -> DfResult<MemoryReservation> {
        let reservation = MemoryConsumer::new(what).register(&self.pool);
        reservation.try_grow(bytes)?;
        Ok(reservation)
    }

    /// Reserves `bytes` until the statement ends.
    pub(crate) fn hold(&self, bytes: usize) -> DfResult<()> {
        self.lifetime.try_grow(bytes)
    }

    /// The most bytes the statement may hold.
    pub(crate) fn limit(&self) -> usize {
        self.memory.limit
    }

    /// Fails once the statement was cancelled or passed its deadline: planning and function
    /// calls look here, so that a stopped statement stops there.
    pub(crate) fn checkpoint(&self) -> DfResult<()> {
        super::runtime::planning_checkpoint();
        if self.stop.load(Ordering::Acquire) != RUNNING {
            return Err(DataFusionError::External(Box::new(Stopped)));
        }
        if Instant::now() >= self.deadline {
            self.stop(TIMED_OUT);
            return Err(DataFusionError::External(Box::new(Stopped)));
        }
        Ok(())
    }

    /// [`Self::checkpoint`], and also fails once the statement was refused memory: while
    /// planning, a refusal (of a function the optimizer folds into a constant, which
    /// DataFusion would leave to fail again when the statement runs) ends the statement.
    pub(crate) fn planning_checkpoint(&self) -> DfResult<()> {
        self.checkpoint()?;
        match self.memory.refused() {
            Some((_, message)) => Err(DataFusionError::ResourcesExhausted(message)),
            None => Ok(()),
        }
    }

    fn stop(&self, why: u8) {
        let _ = self
            .stop
            .compare_exchange(RUNNING, why, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Stops the statement because it ran out of time.
    pub(crate) fn time_out(&self) {
        self.stop(TIMED_OUT);
    }

    /// Stops the statement because it was cancelled (or its caller went away).
    pub(crate) fn cancel(&self) {
        self.stop(CANCELLED);
    }

    /// Ends the statement's claim on the server's memory (see the module docs).
    pub(crate) fn close(&self) {
        self.cancel();
        self.memory.close();
    }

    /// The statement's error for a DataFusion error: a stop as the timeout or cancel it
    /// was, an exhausted budget (however deeply DataFusion wrapped it) as
    /// [`QueryError::ResourcesExhausted`], anything else as before.
    pub(crate) fn error(&self, e: DataFusionError) -> QueryError {
        let stopped = match e.find_root() {
            DataFusionError::External(inner) => inner.is::<Stopped>(),
            _ => false,
        };
        if stopped || self.stop.load(Ordering::Acquire) == TIMED_OUT {
            return match self.stop.load(Ordering::Acquire) {
                TIMED_OUT => QueryError::Timeout(self.timeout.as_secs()),
                _ => QueryError::Cancelled,
            };
        }
        if let DataFusionError::ResourcesExhausted(message) = e.find_root() {
            return QueryError::ResourcesExhausted {
                message: message.clone(),
                retry: matches!(self.memory.refused(), Some((Refusal::ServerFull, _))),
            };
        }
        QueryError::from(e)
    }
}

impl Drop for StatementBudget {
    fn drop(&mut self) {
        self.memory.close();
    }
}

/// Stops the statement when dropped: its work's future went away (a cancel, a timeout, the
/// end), and whatever still runs for it (a planning thread) stops at its next checkpoint.
pub(crate) struct StopOnDrop(pub(crate) Arc<StatementBudget>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// Stops the statement when dropped, without returning its memory: its caller stopped
/// waiting, and its work (which may run on until its next await) keeps what it holds
/// counted until it ends.
pub(crate) struct CancelOnDrop(pub(crate) Arc<StatementBudget>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// The configuration extension that carries a statement's budget to what DataFusion calls
/// on its behalf (functions get their statement's configuration; so do optimizer rules).
#[derive(Debug, Clone)]
pub(crate) struct BudgetOption(pub(crate) Arc<StatementBudget>);

impl BudgetOption {
    /// The budget of the statement whose configuration this is, if any.
    pub(crate) fn of(options: &ConfigOptions) -> Option<&Arc<StatementBudget>> {
        options.extensions.get::<BudgetOption>().map(|b| &b.0)
    }
}

impl ConfigExtension for BudgetOption {
    const PREFIX: &'static str = "sluice_statement";
}

impl ExtensionOptions for BudgetOption {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn cloned(&self) -> Box<dyn ExtensionOptions> {
        Box::new(self.clone())
    }

    fn set(&mut self, key: &str, _value: &str) -> DfResult<()> {
        Err(DataFusionError::Configuration(format!(
            "{key} cannot be set"
        )))
    }

    fn entries(&self) -> Vec<ConfigEntry> {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use datafusion::execution::memory_pool::GreedyMemoryPool;

    fn server(bytes: usize) -> Arc<dyn MemoryPool> {
        Arc::new(GreedyMemoryPool::new(bytes))
    }

    #[test]
    fn a_statement_is_held_to_its_limit_and_the_servers() {
        let pool = server(1000);
        let a = StatementBudget::new(&pool, 600, Duration::from_secs(60));
        let b = StatementBudget::new(&pool, 600, Duration::from_secs(60));
        let held = a.reserve("x", 500).unwrap();
        // Past its own limit: for good.
        let e = a.reserve("y", 200).unwrap_err();
        assert!(matches!(
            a.error(e),
            QueryError::ResourcesExhausted { retry: false, .. }
        ));
        // Within its own, past what the server has left: retry later.
        let e = b.reserve("z", 600).unwrap_err();
        assert!(matches!(
            b.error(e),
            QueryError::ResourcesExhausted { retry: true, .. }
        ));
        assert_eq!(pool.reserved(), 500);
        drop(held);
        assert_eq!(pool.reserved(), 0);
        let _z = b.reserve("z", 600).unwrap();
        assert_eq!(pool.reserved(), 600);
        // An ended statement returns everything, whatever it still holds.
        b.close();
        assert_eq!(pool.reserved(), 0);
        assert!(b.reserve("late", 1).is_err());
    }

    #[test]
    fn a_stopped_statement_stops_at_its_next_checkpoint() {
        let pool = server(1000);
        let budget = StatementBudget::new(&pool, 1000, Duration::from_secs(60));
        budget.checkpoint().unwrap();
        budget.cancel();
        let e = budget.checkpoint().unwrap_err();
        assert!(matches!(budget.error(e), QueryError::Cancelled));
        let late = StatementBudget::new(&pool, 1000, Duration::ZERO);
        let e = late.checkpoint().unwrap_err();
        // Wrapped as DataFusion wraps errors of rules.
        let e = DataFusionError::Context("rule".into(), Box::new(e));
        assert!(matches!(late.error(e), QueryError::Timeout(0)));
    }
}
