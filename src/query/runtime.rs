//! Where statements run, and what they may reach.
//!
//! Statements are parsed, planned and executed off the HTTP runtime, on threads with large
//! stacks ([`STACK_BYTES`]): parsers, planners and expression evaluators recurse on the
//! statement's shape, and an expression that [`super::prepare::check_size`] lets through must
//! never exhaust a stack. Parsing runs on the shared runtime's blocking threads.
//!
//! Execution runs on threads of the statement's own ([`StatementRuntime::run`]): a small
//! runtime built for it on a dedicated thread. DataFusion operators can stay inside one poll
//! for minutes (a nested-loop join evaluates a whole probe batch against every build row
//! before it yields), so no statement may share the threads another one needs: the operating
//! system shares the cores between statements' threads. Once a statement's threads together
//! have used [`EXECUTION_SLICE`] of CPU time they go on at the lowest priority, so a
//! `SELECT 1` runs first, however many statements are busy. A timeout or a cancel does not
//! wait for them: the statement answers at once, and its threads stop at their next await.
//! Until they have ended, the statement's work counts as in flight, its running slot stays
//! taken ([`super::statements::work_token`]) and its memory stays counted, so a key cannot
//! pile up stopped-but-running work beyond its share of the running statements.
//!
//! Planning (SQL to a logical plan, analysis, optimization and physical planning) is
//! synchronous and can be long, so each statement plans on a thread of its own
//! ([`StatementRuntime::plan`]) in the same way.
//! A planning thread counts as the statement's work in flight until it ends (once: with its
//! statement's task while that waits for it, by itself after), so there are
//! never more of them than statements may run at once; a timeout or cancel stops it at its
//! next checkpoint ([`super::budget`]), and what it planned is dropped. A statement that has
//! planned for more than [`PLANNING_SLICE`] of CPU time goes on at the lowest priority
//! ([`planning_checkpoint`]): a `SELECT 1` plans first, however many statements are busy
//! planning.
//!
//! DataFusion's runtime environment is built so that SQL cannot reach anything sluice does
//! not read itself: its object store registry knows only sluice's table store (no `file://`,
//! no other URL), spilling to disk is off, and a memory pool bounds what operators hold.

use std::sync::Arc;
use std::time::Duration;

use datafusion::error::{DataFusionError, Result as DfResult};
use datafusion::execution::disk_manager::{DiskManagerBuilder, DiskManagerMode};
use datafusion::execution::memory_pool::GreedyMemoryPool;
use datafusion::execution::object_store::ObjectStoreRegistry;
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use object_store::ObjectStore;
use url::Url;

/// Stack of each statement thread. Only touched pages take memory.
pub(crate) const STACK_BYTES: usize = 64 << 20;

/// Limits on what one statement may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryLimits {
    /// Bytes all running statements may hold at once, and one statement at most: their
    /// operators (sorts, joins, aggregations), their functions' results, their plans and
    /// constants (see [`super::budget`]). Past it a statement fails with
    /// `resources_exhausted` (or, when other statements hold the rest, a retryable 503).
    pub memory_bytes: usize,
    /// Longest a statement may run before it is stopped.
    pub timeout: Duration,
    /// Most rows a result may hold.
    pub max_result_rows: usize,
    /// Most bytes (in Arrow memory) a result may hold.
    pub max_result_bytes: usize,
}

impl Default for QueryLimits {
    fn default() -> Self {
        QueryLimits {
            memory_bytes: 1 << 30,
            timeout: Duration::from_secs(300),
            max_result_rows: 1_000_000,
            max_result_bytes: 128 << 20,
        }
    }
}

/// The runtime statements run on. Dropping it stops its threads without waiting for them
/// (it may be dropped inside another runtime).
pub(crate) struct StatementRuntime {
    runtime: Option<tokio::runtime::Runtime>,
    /// Tasks on the runtime that have not ended (a cancelled statement counts until its work
    /// really stops: synchronous planning cannot be interrupted).
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
    /// Workers of each statement's own runtime.
    workers: usize,
}

/// Counts a task as in flight until it is dropped (completed, or aborted and unwound).
struct InFlight(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

impl std::fmt::Debug for StatementRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatementRuntime").finish_non_exhaustive()
    }
}

impl StatementRuntime {
    pub(crate) fn new() -> std::io::Result<StatementRuntime> {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("sluice-query")
            .thread_stack_size(STACK_BYTES)
            .enable_all()
            .build()?;
        Ok(StatementRuntime {
            runtime: Some(runtime),
            in_flight: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            workers: threads,
        })
    }

    /// Tasks on the runtime that have not ended.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(std::sync::atomic::Ordering::Acquire)
    }

    fn guard(&self) -> InFlight {
        self.in_flight
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        InFlight(self.in_flight.clone())
    }

    /// Executes `work` on threads of its own and waits for its answer (see the module docs):
    /// a runtime of [`StatementRuntime::workers`] workers, built for this statement on a
    /// dedicated thread, all with [`STACK_BYTES`] stacks. Once its threads together have used
    /// [`EXECUTION_SLICE`] of CPU time they go on at the lowest priority.
    ///
    /// Dropping the wait (a timeout, a cancel) answers at once: the work is dropped at its
    /// next await, which may be minutes away inside one operator's poll. Until every one of
    /// its threads has ended, `until_ended` is kept, the work counts as in flight, and so
    /// does its statement's running slot ([`super::statements::work_token`]); the answer is
    /// sent only after they ended, so a statement that answered holds nothing. A panic in
    /// the work is an error, not a crash.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        work: impl std::future::Future<Output = T> + Send + 'static,
        until_ended: impl Send + 'static,
    ) -> Result<T, ThreadError> {
        if self.runtime.is_none() {
            return Err(ThreadError::NoThread(
                "the statement runtime is shut down".into(),
            ));
        }
        let threads = Arc::new(ExecutionThreads::default());
        let (answer, answered) = tokio::sync::oneshot::channel();
        // Dropped with this wait: the work stops at its next await.
        let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let count = self.guard();
        let token = super::statements::work_token();
        let workers = self.workers;
        let on_start = Arc::clone(&threads);
        let on_stop = Arc::clone(&threads);
        let own = Arc::clone(&threads);
        std::thread::Builder::new()
            .name("sluice-exec".into())
            .stack_size(STACK_BYTES)
            .spawn(move || {
                own.enter();
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(workers)
                    .thread_name("sluice-exec")
                    .thread_stack_size(STACK_BYTES)
                    .on_thread_start(move || on_start.enter())
                    .on_thread_stop(move || on_stop.leave())
                    .enable_all()
                    .build();
                let outcome = match runtime {
                    Ok(runtime) => {
                        let outcome = runtime.block_on(async move {
                            use futures::FutureExt as _;
                            tokio::select! {
                                done = std::panic::AssertUnwindSafe(work).catch_unwind() => {
                                    Some(done.map_err(|_| ThreadError::Panicked))
                                }
                                _ = stopped => None,
                            }
                        });
                        // Waits for every worker: one in the middle of a long poll ends it
                        // first, then drops what it ran.
                        drop(runtime);
                        outcome
                    }
                    Err(e) => Some(Err(ThreadError::NoThread(format!(
                        "cannot start a statement's runtime: {e}"
                    )))),
                };
                own.leave();
                // Its threads ended: what it held is returned before it answers.
                drop(until_ended);
                drop(token);
                drop(count);
                if let Some(outcome) = outcome {
                    let _ = answer.send(outcome);
                }
            })
            .map_err(|e| ThreadError::NoThread(format!("cannot start a statement thread: {e}")))?;
        let mut answered = answered;
        let mut check = tokio::time::interval(CPU_CHECK_INTERVAL);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                outcome = &mut answered => {
                    return outcome.unwrap_or(Err(ThreadError::Panicked));
                }
                _ = check.tick(), if !threads.demoted() => {
                    if threads.cpu_time() > EXECUTION_SLICE {
                        threads.demote();
                    }
                }
            }
        }
    }

    /// Runs synchronous `work` on the runtime's blocking threads (they have the same large
    /// stacks), so that it never waits behind statements busy planning on the workers.
    pub(crate) async fn run_blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, String> {
        let Some(runtime) = &self.runtime else {
            return Err("the statement runtime is shut down".into());
        };
        let guard = self.guard();
        runtime
            .spawn_blocking(move || {
                let _guard = guard;
                work()
            })
            .await
            .map_err(|e| e.to_string())
    }
}

/// How much CPU time a statement plans with at normal priority (see the module docs):
/// ordinary statements plan in a few milliseconds.
pub(crate) const PLANNING_SLICE: Duration = Duration::from_millis(100);

thread_local! {
    /// On a planning thread: whether its priority is still normal.
    static PLANNING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Whether this thread is a planning thread.
    static PLANNING_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Called at every planning checkpoint: on a planning thread that has used more than
/// [`PLANNING_SLICE`] of CPU time, lowers the thread's priority to the lowest (once; the
/// thread ends with its statement's planning). Elsewhere (the runtime's workers) it does
/// nothing.
pub(crate) fn planning_checkpoint() {
    PLANNING.with(|normal| {
        if normal.get() && thread_cpu_time() > PLANNING_SLICE {
            lower_priority();
            normal.set(false);
        }
    });
}

/// Whether this thread is a statement's planning thread.
pub(crate) fn on_planning_thread() -> bool {
    PLANNING_THREAD.with(std::cell::Cell::get)
}

/// The CPU time this thread has used.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn thread_cpu_time() -> Duration {
    read_clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// What `clock` reads now (zero when it cannot be read).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn read_clock(clock: libc::clockid_t) -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to write; a clock that does not exist
    // (a thread's that ended) fails the call, which writes nothing.
    let read = unsafe { libc::clock_gettime(clock, &mut now) };
    if read != 0 {
        return Duration::ZERO;
    }
    Duration::new(
        u64::try_from(now.tv_sec).unwrap_or(0),
        u32::try_from(now.tv_nsec).unwrap_or(0),
    )
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn thread_cpu_time() -> Duration {
    Duration::ZERO
}

/// Lowers this thread's scheduling priority to the lowest nice value (19): it keeps a small
/// share of a busy core, and threads at normal priority come first.
fn lower_priority() {
    lower_priority_of(this_thread().0);
}

/// This thread's id and its CPU-time clock.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn this_thread() -> (libc::pid_t, libc::clockid_t) {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: `gettid` has no arguments; `pthread_getcpuclockid` writes a clock id to
    // `clock`, a valid place for it, for the calling thread (`pthread_self` is always valid).
    // On failure the clock stays 0 (the process's realtime clock is never read as CPU time:
    // see `cpu_time_of`).
    unsafe {
        let thread = libc::gettid();
        if libc::pthread_getcpuclockid(libc::pthread_self(), &mut clock) != 0 {
            clock = 0;
        }
        (thread, clock)
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn this_thread() -> (i32, i32) {
    (0, 0)
}

/// The CPU time a thread of this process has used, by its CPU-time clock (zero when the
/// clock cannot be read: the thread ended).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn cpu_time_of(clock: libc::clockid_t) -> Duration {
    if clock == 0 {
        return Duration::ZERO;
    }
    read_clock(clock)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn cpu_time_of(_clock: i32) -> Duration {
    Duration::ZERO
}

/// Lowers the scheduling priority of thread `thread` of this process to the lowest nice
/// value (19).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn lower_priority_of(thread: libc::pid_t) {
    // SAFETY: a system call without pointers; on Linux, `setpriority` with a thread id
    // changes that thread only. A failure (the thread ended) leaves priorities as they were.
    unsafe {
        libc::setpriority(libc::PRIO_PROCESS, thread as libc::id_t, 19);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn lower_priority_of(_thread: i32) {}

/// How much CPU time a statement's execution threads use together at normal priority (see
/// the module docs): ordinary statements execute in a few milliseconds, and a statement of a
/// second of CPU still runs at the speed it would alone (past the slice, on a machine other
/// processes keep busy, the lowest priority can slow it many times over).
pub(crate) const EXECUTION_SLICE: Duration = Duration::from_secs(1);

/// How often the CPU time of a statement's execution threads is looked at.
const CPU_CHECK_INTERVAL: Duration = Duration::from_millis(20);

/// The threads one statement executes on (see [`StatementRuntime::run`]): each registers
/// itself when it starts and leaves when it ends, so that their CPU time can be summed and
/// their priority lowered from outside, while one of them is inside a long poll.
///
/// Invariant: an id in `live` is a running thread's (it leaves before it ends), and once
/// `demoted` is set every thread in `live`, and every thread that enters later, runs at the
/// lowest priority.
#[derive(Debug, Default)]
struct ExecutionThreads {
    /// Thread id and CPU-time clock of each running thread.
    live: std::sync::Mutex<Vec<(ThreadId, ClockId)>>,
    demoted: std::sync::atomic::AtomicBool,
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
type ThreadId = libc::pid_t;
#[cfg(all(target_os = "linux", target_env = "gnu"))]
type ClockId = libc::clockid_t;
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
type ThreadId = i32;
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
type ClockId = i32;

impl ExecutionThreads {
    fn live(&self) -> std::sync::MutexGuard<'_, Vec<(ThreadId, ClockId)>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Called by each thread as it starts.
    fn enter(&self) {
        let mut live = self.live();
        live.push(this_thread());
        if self.demoted() {
            lower_priority();
        }
    }

    /// Called by each thread as it ends.
    fn leave(&self) {
        let (me, _) = this_thread();
        self.live().retain(|(thread, _)| *thread != me);
    }

    fn demoted(&self) -> bool {
        self.demoted.load(std::sync::atomic::Ordering::Acquire)
    }

    /// CPU time the running threads have used.
    fn cpu_time(&self) -> Duration {
        self.live()
            .iter()
            .map(|(_, clock)| cpu_time_of(*clock))
            .sum()
    }

    /// Lowers every thread's priority to the lowest, now and for threads that start later.
    fn demote(&self) {
        let live = self.live();
        self.demoted
            .store(true, std::sync::atomic::Ordering::Release);
        for (thread, _) in live.iter() {
            lower_priority_of(*thread);
        }
    }
}

/// How a planning thread counts as work in flight (see [`StatementRuntime::plan`]).
enum PlanThread {
    /// Its statement waits for it, and counts for it.
    Waited,
    /// Its statement stopped waiting (a timeout, a cancel): the thread counts by itself.
    Orphaned {
        /// Held for its drop, when the thread ends.
        _count: InFlight,
    },
    /// The thread ended.
    Ended,
}

/// Held while a statement waits for its planning thread: when the wait ends before the
/// thread does, the thread starts counting as work in flight by itself.
struct Waiting {
    thread: Arc<std::sync::Mutex<PlanThread>>,
    in_flight: Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut thread = self.thread.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*thread, PlanThread::Waited) {
            self.in_flight
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            *thread = PlanThread::Orphaned {
                _count: InFlight(Arc::clone(&self.in_flight)),
            };
        }
    }
}

/// Why work on threads of its own (planning, execution) gave no answer.
#[derive(Debug)]
pub(crate) enum ThreadError {
    /// No thread could be started (the process is at its limit): retry later.
    NoThread(String),
    /// The work panicked (a bug).
    Panicked,
}

impl StatementRuntime {
    /// Runs synchronous planning `work` on a new thread with a large stack, and waits for it.
    /// `work` gets the runtime's handle, to wait for the asynchronous parts of planning (table
    /// lookups). Dropping the wait leaves the thread to end by itself: `work` must stop at its
    /// checkpoints once its statement is stopped. A panic in it is an error.
    pub(crate) async fn plan<T: Send + 'static>(
        &self,
        work: impl FnOnce(&tokio::runtime::Handle) -> T + Send + 'static,
    ) -> Result<T, ThreadError> {
        let Some(runtime) = &self.runtime else {
            return Err(ThreadError::NoThread(
                "the statement runtime is shut down".into(),
            ));
        };
        let handle = runtime.handle().clone();
        let (answer, answered) = tokio::sync::oneshot::channel();
        // The statement's running slot is held until the thread ends.
        let token = super::statements::work_token();
        let counted = Arc::new(std::sync::Mutex::new(PlanThread::Waited));
        let ended = Arc::clone(&counted);
        std::thread::Builder::new()
            .name("sluice-plan".into())
            .stack_size(STACK_BYTES)
            .spawn(move || {
                PLANNING.with(|normal| normal.set(true));
                PLANNING_THREAD.with(|planning| planning.set(true));
                let result =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(&handle)));
                let _ = answer.send(result);
                // No longer work in flight (if it counted, its count ends here).
                let was = std::mem::replace(
                    &mut *ended.lock().unwrap_or_else(|p| p.into_inner()),
                    PlanThread::Ended,
                );
                drop(was);
                drop(token);
            })
            .map_err(|e| ThreadError::NoThread(format!("cannot start a planning thread: {e}")))?;
        // From here until the thread ends, it counts once: as its statement's task while the
        // statement waits for it, by itself once the statement stopped waiting.
        let _waiting = Waiting {
            thread: counted,
            in_flight: Arc::clone(&self.in_flight),
        };
        match answered.await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(_)) | Err(_) => Err(ThreadError::Panicked),
        }
    }
}

impl Drop for StatementRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// An object store registry that knows one store, sluice's own, and refuses every other URL:
/// a statement cannot name a file or bucket and have DataFusion open it.
#[derive(Debug)]
struct OnlySluiceStore {
    url: Url,
    store: Arc<dyn ObjectStore>,
}

impl ObjectStoreRegistry for OnlySluiceStore {
    fn register_store(
        &self,
        _url: &Url,
        _store: Arc<dyn ObjectStore>,
    ) -> Option<Arc<dyn ObjectStore>> {
        // Nothing may be added: the registry is fixed when the engine is built.
        None
    }

    fn get_store(&self, url: &Url) -> DfResult<Arc<dyn ObjectStore>> {
        if url.scheme() == self.url.scheme() && url.host_str() == self.url.host_str() {
            Ok(self.store.clone())
        } else {
            Err(DataFusionError::Plan(format!(
                "statements cannot read or write {}://{}",
                url.scheme(),
                url.host_str().unwrap_or("")
            )))
        }
    }
}

/// The runtime environment one statement executes in: `base`'s store, caches and disk
/// manager, and the statement's own memory pool (see [`super::budget`]).
pub(crate) fn statement_env(
    base: &RuntimeEnv,
    pool: Arc<dyn datafusion::execution::memory_pool::MemoryPool>,
) -> Arc<RuntimeEnv> {
    Arc::new(RuntimeEnv {
        memory_pool: pool,
        disk_manager: Arc::clone(&base.disk_manager),
        cache_manager: Arc::clone(&base.cache_manager),
        object_store_registry: Arc::clone(&base.object_store_registry),
    })
}

/// DataFusion's runtime environment for statements: sluice's store only, no spilling, and
/// the server's statement memory pool of `limits.memory_bytes`, which every statement's own
/// pool draws from.
pub(crate) fn runtime_env(
    store_url: &str,
    store: Arc<dyn ObjectStore>,
    limits: &QueryLimits,
) -> DfResult<Arc<RuntimeEnv>> {
    let url = Url::parse(store_url).map_err(|e| DataFusionError::Plan(e.to_string()))?;
    RuntimeEnvBuilder::new()
        .with_object_store_registry(Arc::new(OnlySluiceStore { url, store }))
        .with_memory_pool(Arc::new(GreedyMemoryPool::new(limits.memory_bytes)))
        .with_disk_manager_builder(
            DiskManagerBuilder::default().with_mode(DiskManagerMode::Disabled),
        )
        .build_arc()
}

#[cfg(test)]
mod tests {
    use datafusion::execution::object_store::ObjectStoreUrl;

    use super::*;

    #[test]
    fn only_sluices_store_is_reachable() {
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let env = runtime_env("sluice://data/", store, &QueryLimits::default()).unwrap();
        for url in [
            "file:///",
            "s3://bucket/",
            "http://169.254.169.254/",
            "sluice://other/",
        ] {
            let store_url = ObjectStoreUrl::parse(url).unwrap();
            assert!(env.object_store(&store_url).is_err(), "{url} is reachable");
        }
        let ours = ObjectStoreUrl::parse("sluice://data/").unwrap();
        assert!(env.object_store(&ours).is_ok());
    }
}
