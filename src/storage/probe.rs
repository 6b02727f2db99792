//! A probe between sluice and its object store: it counts requests and errors (for metrics),
//! and, with the `testing` feature, fails on command for fault tests, in the spirit of
//! SlateDB's failure points: an outage, ambiguous conditional creates whose object lands but
//! whose answer is lost, slow writes, and reads that hang until released. With no fault
//! switched on it only counts.
//!
//! ```
//! use std::sync::Arc;
//! use sluice::storage::probe::{Probe, ProbedStore};
//! use object_store::memory::InMemory;
//!
//! let probe = Arc::new(Probe::default());
//! let store = ProbedStore::new(Arc::new(InMemory::new()), probe.clone());
//! probe.set_down(true); // every request fails until set_down(false)
//! # let _ = store;
//! ```

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

/// The counters and fault switches of a [`ProbedStore`]; share it with whoever reads or flips
/// them.
#[derive(Debug, Default)]
pub struct Probe {
    down: AtomicBool,
    lose_create_answers: AtomicUsize,
    lose_create_answers_unverified: AtomicUsize,
    /// How long each write waits before it is sent (a slow store), in milliseconds.
    write_delay_ms: AtomicU64,
    /// Objects whose next read fails (a lost create answer that cannot be checked).
    blind: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Writes of objects under this prefix fail (an outage of one part of the store).
    failing_writes: std::sync::Mutex<Option<String>>,
    /// Reads of objects under this prefix wait until it is cleared (a read that hangs).
    held_reads: std::sync::Mutex<Option<String>>,
    /// Writes of objects under this prefix wait until it is cleared (a write that hangs).
    held_writes: std::sync::Mutex<Option<String>>,
    /// Reads waiting on [`Probe::hold_reads_under`] now.
    reads_held: AtomicUsize,
    requests: AtomicU64,
    failures: AtomicU64,
    errors: AtomicU64,
}

impl Probe {
    /// While down, every request fails (as a refused connection would).
    #[cfg(feature = "testing")]
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// Performs the next `n` conditional creates but answers each with an error, as a timeout
    /// after the request was sent would: the writer cannot tell whether it landed.
    #[cfg(feature = "testing")]
    pub fn lose_create_answers(&self, n: usize) {
        self.lose_create_answers.store(n, Ordering::SeqCst);
    }

    /// Like [`Probe::lose_create_answers`], and the writer's read-back of each such object
    /// fails once too: the outcome stays unknown to it (a timeout, then a read that times
    /// out as well).
    #[cfg(feature = "testing")]
    pub fn lose_create_answers_unverified(&self, n: usize) {
        self.lose_create_answers_unverified
            .store(n, Ordering::SeqCst);
    }

    /// While set, every write of an object whose path starts with `prefix` fails, and
    /// everything else goes through (`None` ends it).
    #[cfg(feature = "testing")]
    pub fn fail_writes_under(&self, prefix: Option<&str>) {
        if let Ok(mut failing) = self.failing_writes.lock() {
            *failing = prefix.map(str::to_owned);
        }
    }

    /// While set, every read of an object whose path starts with `prefix` waits (without
    /// an answer) until the prefix is cleared (`None`); everything else goes through.
    #[cfg(feature = "testing")]
    pub fn hold_reads_under(&self, prefix: Option<&str>) {
        if let Ok(mut held) = self.held_reads.lock() {
            *held = prefix.map(str::to_owned);
        }
    }

    /// While set, every write of an object whose path starts with `prefix` waits (without
    /// an answer) until the prefix is cleared (`None`); everything else goes through.
    #[cfg(feature = "testing")]
    pub fn hold_writes_under(&self, prefix: Option<&str>) {
        if let Ok(mut held) = self.held_writes.lock() {
            *held = prefix.map(str::to_owned);
        }
    }

    /// Whether writes of `location` are held now.
    fn holds_write(&self, location: &Path) -> bool {
        under(&self.held_writes, location)
    }

    /// How many reads [`Probe::hold_reads_under`] holds now.
    #[cfg(feature = "testing")]
    pub fn reads_held(&self) -> usize {
        self.reads_held.load(Ordering::SeqCst)
    }

    /// Whether reads of `location` are held now.
    fn holds_read(&self, location: &Path) -> bool {
        under(&self.held_reads, location)
    }

    /// Every write waits `delay` before it is sent, as on a store that answers slowly (zero
    /// ends it).
    #[cfg(feature = "testing")]
    pub fn delay_writes(&self, delay: std::time::Duration) {
        let ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
        self.write_delay_ms.store(ms, Ordering::SeqCst);
    }

    /// Requests seen, and requests failed by a fault.
    #[cfg(feature = "testing")]
    pub fn counts(&self) -> (u64, u64) {
        (
            self.requests.load(Ordering::SeqCst),
            self.failures.load(Ordering::SeqCst),
        )
    }

    /// Requests that failed, whether the store or an injected fault failed them. Answers
    /// that are outcomes, not failures (not found, already exists, precondition failed, not
    /// modified: reads of absent versions and lost create races) are not counted.
    pub(crate) fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    /// Counts the outcome of a request.
    fn record<T>(&self, result: Result<T>) -> Result<T> {
        if let Err(e) = &result {
            let outcome = matches!(
                e,
                object_store::Error::NotFound { .. }
                    | object_store::Error::AlreadyExists { .. }
                    | object_store::Error::Precondition { .. }
                    | object_store::Error::NotModified { .. }
            );
            if !outcome {
                self.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        result
    }

    fn take(counter: &AtomicUsize) -> bool {
        counter
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
    }

    /// Counts a request and says whether it fails.
    async fn before(&self) -> Result<()> {
        self.requests.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            return Err(self.injected("object store unavailable (injected fault)"));
        }
        Ok(())
    }

    /// Counts a write and says whether it fails.
    async fn before_write(&self, location: &Path) -> Result<()> {
        self.before().await?;
        let delay = self.write_delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        }
        while self.holds_write(location) {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        if under(&self.failing_writes, location) {
            return Err(self.injected("write refused (injected fault)"));
        }
        Ok(())
    }

    fn injected(&self, message: &'static str) -> object_store::Error {
        self.failures.fetch_add(1, Ordering::SeqCst);
        self.errors.fetch_add(1, Ordering::Relaxed);
        object_store::Error::Generic {
            store: "ProbedStore",
            source: message.into(),
        }
    }
}

/// Whether `location` starts with the prefix a fault switch holds (none: no).
fn under(prefix: &std::sync::Mutex<Option<String>>, location: &Path) -> bool {
    prefix
        .lock()
        .map(|p| {
            p.as_ref()
                .is_some_and(|p| location.as_ref().starts_with(p.as_str()))
        })
        .unwrap_or(false)
}

/// Wraps a store; each request consults the shared [`Probe`] first.
#[derive(Debug)]
pub struct ProbedStore {
    inner: Arc<dyn ObjectStore>,
    probe: Arc<Probe>,
}

impl ProbedStore {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn ObjectStore>, probe: Arc<Probe>) -> Self {
        ProbedStore { inner, probe }
    }

    /// What every read goes through first: an outage, and a read of an object whose create
    /// answer was lost unverified.
    async fn before_read(&self, location: &Path) -> Result<()> {
        self.probe.before().await?;
        if self.probe.holds_read(location) {
            /// Counts a held read until it ends, however it ends (a caller may drop it).
            struct Held<'a>(&'a AtomicUsize);
            impl Drop for Held<'_> {
                fn drop(&mut self) {
                    self.0.fetch_sub(1, Ordering::SeqCst);
                }
            }
            self.probe.reads_held.fetch_add(1, Ordering::SeqCst);
            let _held = Held(&self.probe.reads_held);
            while self.probe.holds_read(location) {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        }
        let blind = self
            .probe
            .blind
            .lock()
            .map(|mut b| b.remove(location.as_ref()))
            .unwrap_or(false);
        if blind {
            return Err(self.probe.injected("read timed out (injected fault)"));
        }
        Ok(())
    }
}

impl std::fmt::Display for ProbedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProbedStore({})", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for ProbedStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.probe.before_write(location).await?;
        let create = matches!(opts.mode, PutMode::Create);
        let result = self
            .probe
            .record(self.inner.put_opts(location, payload, opts).await);
        if create && result.is_ok() && Probe::take(&self.probe.lose_create_answers) {
            return Err(self
                .probe
                .injected("connection reset after the request was sent (injected fault)"));
        }
        if create && result.is_ok() && Probe::take(&self.probe.lose_create_answers_unverified) {
            if let Ok(mut blind) = self.probe.blind.lock() {
                blind.insert(location.to_string());
            }
            return Err(self
                .probe
                .injected("connection reset after the request was sent (injected fault)"));
        }
        result
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.probe.before_write(location).await?;
        self.probe
            .record(self.inner.put_multipart_opts(location, opts).await)
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.before_read(location).await?;
        self.probe
            .record(self.inner.get_opts(location, options).await)
    }

    /// The inner store's, counted as one request: the trait's default would merge ranges
    /// less than a megabyte apart and read each merged range with `get_opts`, so a Parquet
    /// scan that wants a few pages of a local file would copy whole column chunks.
    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.before_read(location).await?;
        self.probe
            .record(self.inner.get_ranges(location, ranges).await)
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        if self.probe.down.load(Ordering::SeqCst) {
            let error = self
                .probe
                .injected("object store unavailable (injected fault)");
            return futures::stream::once(async move { Err(error) }).boxed();
        }
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        if self.probe.down.load(Ordering::SeqCst) {
            let error = self
                .probe
                .injected("object store unavailable (injected fault)");
            return futures::stream::once(async move { Err(error) }).boxed();
        }
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.probe.before().await?;
        self.probe
            .record(self.inner.list_with_delimiter(prefix).await)
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.probe.before().await?;
        self.probe
            .record(self.inner.copy_opts(from, to, options).await)
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    use object_store::ObjectStoreExt as _;
    use object_store::memory::InMemory;

    use super::*;

    /// Ranges far apart are read in one request, each range on its own (the trait's default
    /// would send one read per range more than a megabyte from the next), and an outage
    /// fails them as it fails every read.
    #[tokio::test]
    async fn ranges_are_one_request_that_an_outage_fails() {
        let probe = Arc::new(Probe::default());
        let store = ProbedStore::new(Arc::new(InMemory::new()), probe.clone());
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let path = Path::from("t/data.parquet");
        store
            .put(&path, PutPayload::from(data.clone()))
            .await
            .unwrap();
        let ranges = [0..10u64, 1_500_000..1_500_010, 2_999_990..3_000_000];
        let (before, _) = probe.counts();
        let read = store.get_ranges(&path, &ranges).await.unwrap();
        assert_eq!(probe.counts().0 - before, 1);
        for (range, bytes) in ranges.iter().zip(&read) {
            let (start, end) = (range.start as usize, range.end as usize);
            assert_eq!(bytes.as_ref(), &data[start..end]);
        }
        probe.set_down(true);
        assert!(store.get_ranges(&path, &ranges).await.is_err());
        probe.set_down(false);
        assert_eq!(store.get_ranges(&path, &ranges).await.unwrap(), read);
    }
}
