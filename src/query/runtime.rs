//! Where statements run, and what they may reach.
//!
//! Statements are parsed, planned and executed off the HTTP runtime, on threads with large
//! stacks ([`STACK_BYTES`]): parsers, planners and expression evaluators recurse on the
//! statement's shape, and an expression that [`super::prepare::check_size`] lets through must
//! never exhaust a stack. Execution runs on the statement runtime's workers. Parsing runs on
//! its blocking threads. Planning (SQL to a logical plan, analysis, optimization and physical
//! planning) is synchronous and can be long, so each statement plans on a thread of its own
//! ([`StatementRuntime::plan`]): a statement that plans for long never holds a thread other
//! statements need, and the operating system shares the cores between planning threads.
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
}

/// Counts a task as in flight until it is dropped (completed, or aborted and unwound).
struct InFlight(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// Aborts a spawned task when whoever waits for it goes away (a cancelled statement).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
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

    /// Runs `work` on the statement runtime and waits for it; dropping the wait (a cancel)
    /// aborts the work at its next await. A panic in it is an error, not a crash of the
    /// caller.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        work: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Result<T, String> {
        let Some(runtime) = &self.runtime else {
            return Err("the statement runtime is shut down".into());
        };
        let guard = self.guard();
        let mut task = AbortOnDrop(runtime.spawn(async move {
            let _guard = guard;
            work.await
        }));
        (&mut task.0).await.map_err(|e| e.to_string())
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
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec for the call to write; the clock exists on Linux.
    let read = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
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
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn lower_priority() {
    // SAFETY: system calls on this thread's own id, without pointers; on Linux,
    // `setpriority` with a thread id changes that thread only. A failure leaves the priority
    // as it was.
    unsafe {
        let thread = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, thread as libc::id_t, 19);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn lower_priority() {}

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

/// Why planning on a thread of its own gave no answer.
#[derive(Debug)]
pub(crate) enum PlanThreadError {
    /// No thread could be started (the process is at its limit): retry later.
    NoThread(String),
    /// The planning panicked (a bug).
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
    ) -> Result<T, PlanThreadError> {
        let Some(runtime) = &self.runtime else {
            return Err(PlanThreadError::NoThread(
                "the statement runtime is shut down".into(),
            ));
        };
        let handle = runtime.handle().clone();
        let (answer, answered) = tokio::sync::oneshot::channel();
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
            })
            .map_err(|e| {
                PlanThreadError::NoThread(format!("cannot start a planning thread: {e}"))
            })?;
        // From here until the thread ends, it counts once: as its statement's task while the
        // statement waits for it, by itself once the statement stopped waiting.
        let _waiting = Waiting {
            thread: counted,
            in_flight: Arc::clone(&self.in_flight),
        };
        match answered.await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(_)) | Err(_) => Err(PlanThreadError::Panicked),
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
