//! The dispatcher over a real stream engine: a database in a scratch directory, its objects
//! in memory behind a [`Probe`] that injects store faults. The database's own dispatcher is
//! closed; each test runs dispatchers without background loops ([`Subscriptions::load_own`])
//! and drives their rounds itself, so every interleaving here is the one the test names.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use object_store::ObjectStoreExt as _;

use super::*;
use crate::db::{Database, DbConfig};
use crate::storage::paths;
use crate::storage::probe::{Probe, ProbedStore};
use crate::stream::{AppendRequest, CreateRequest, Lifetime};

struct Harness {
    dir: PathBuf,
    config: DbConfig,
    probe: Arc<Probe>,
    storage: Storage,
    db: Arc<Database>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn harness(name: &str, configure: impl FnOnce(&mut DbConfig)) -> Harness {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let dir = std::env::temp_dir().join(format!(
        "sluice-subscriptions-{name}-{}-{nanos}",
        std::process::id()
    ));
    let probe = Arc::new(Probe::default());
    let storage = Storage::from_store(
        Arc::new(ProbedStore::new(
            Arc::new(object_store::memory::InMemory::new()),
            probe.clone(),
        )),
        "memory-probed://",
    );
    let mut config = DbConfig::new(&dir);
    configure(&mut config);
    let db = Database::open_with_storage(config.clone(), storage.clone())
        .await
        .unwrap();
    db.subscriptions().close().await;
    Harness {
        dir,
        config,
        probe,
        storage,
        db,
    }
}

impl Harness {
    fn node(&self) -> String {
        self.db.node().id().to_owned()
    }

    /// A dispatcher of the node's own subscriptions over its engine (loaded from the store,
    /// as at a start).
    async fn dispatcher(&self, limits: SubscriptionLimits) -> Arc<Subscriptions> {
        Subscriptions::load_own(
            self.storage.clone(),
            self.db.node().clone(),
            self.db.streams().clone(),
            limits,
            None,
        )
        .await
        .unwrap()
    }

    /// Removes the stored watermarks: the next dispatcher starts as on a first start (or
    /// after an upgrade from a version that kept none).
    async fn forget_watermarks(&self) {
        let path = object_store::path::Path::from(paths::subscription_watermarks(&self.node()));
        self.storage.store().delete(&path).await.unwrap();
    }

    /// A dispatcher as on a first start (no watermark stored) with subscription `s` of
    /// `local` watching pattern `e/*`, made before any round.
    async fn first_start_with_a_pattern(&self) -> Arc<Subscriptions> {
        self.forget_watermarks().await;
        let d = self.dispatcher(SubscriptionLimits::default()).await;
        d.put(&caller("local"), "s", pattern("e/*", "wakes"))
            .await
            .unwrap();
        d
    }

    /// The process dies (nothing is flushed) and starts again on the same directory and
    /// store.
    async fn restart(&mut self) {
        self.db.log().close();
        self.db = Database::open_with_storage(self.config.clone(), self.storage.clone())
            .await
            .unwrap();
        self.db.subscriptions().close().await;
    }

    async fn create(&self, name: &str, body: &str) {
        self.create_as(name, "text/plain", body).await;
    }

    async fn create_as(&self, name: &str, content_type: &str, body: &str) {
        self.db
            .streams()
            .create(CreateRequest {
                name: name.into(),
                content_type: Some(content_type.into()),
                lifetime: Lifetime::default(),
                closed: false,
                fork: None,
                body: Bytes::from(body.to_owned()),
                incarnation: None,
            })
            .await
            .unwrap();
    }

    async fn append(&self, name: &str, body: &str, close: bool) {
        self.db
            .streams()
            .append(AppendRequest {
                name: name.into(),
                content_type: Some("text/plain".into()),
                body: Bytes::from(body.to_owned()),
                close,
                producer: None,
                stream_seq: None,
                incarnation: None,
            })
            .await
            .unwrap();
    }

    fn tail(&self, name: &str) -> u64 {
        self.db.streams().mark_of(name).unwrap().tail
    }
}

fn caller(subject: &str) -> Caller {
    Caller {
        subject: Arc::from(subject),
        admin: false,
    }
}

fn pattern(pattern: &str, wake_stream: &str) -> Definition {
    Definition::new(
        Target::PullWake {
            wake_stream: wake_stream.into(),
        },
        Some(pattern.into()),
        Vec::new(),
        None,
        None,
    )
}

fn listing(streams: &[&str], wake_stream: &str) -> Definition {
    Definition::new(
        Target::PullWake {
            wake_stream: wake_stream.into(),
        },
        None,
        streams.iter().map(|s| (*s).to_owned()).collect(),
        None,
        None,
    )
}

/// The tail subscription `id` knows for stream `name`, when it is linked.
fn linked_tail(subscriptions: &Subscriptions, owner: &str, id: &str, name: &str) -> Option<u64> {
    subscriptions
        .get(&caller(owner), id)
        .unwrap()
        .streams
        .iter()
        .find(|l| l.path == name)
        .map(|l| l.tail)
}

fn has_wake(subscriptions: &Subscriptions, id: &str) -> bool {
    subscriptions
        .holders(id)
        .iter()
        .any(|r| r.state().has_wake(id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_watch_whose_start_is_not_stored_keeps_the_changes_it_took() {
    let h = harness("first-watch-store", |_| {}).await;
    h.forget_watermarks().await;
    let limits = SubscriptionLimits {
        store_timeout: Duration::from_millis(300),
        ..SubscriptionLimits::default()
    };
    let d = h.dispatcher(limits).await;
    d.put(&caller("local"), "s", pattern("e/*", "wakes"))
        .await
        .unwrap();
    h.create("e/a", "one").await;
    let watermarks = paths::subscription_watermarks(&h.node());
    // The store does not answer: the round gives up at the store's deadline (it holds the
    // lock every subscription request waits on), and nothing of the batch it took is lost.
    h.probe.hold_writes_under(Some(&watermarks));
    tokio::time::timeout(Duration::from_secs(30), d.round())
        .await
        .expect("a round waits on a store that does not answer");
    h.probe.hold_writes_under(None);
    h.create("e/b", "two").await;
    // The store refuses: the same.
    h.probe.fail_writes_under(Some(&watermarks));
    d.round().await;
    assert_eq!(
        linked_tail(&d, "local", "s", "e/a"),
        None,
        "not applied yet"
    );
    h.probe.fail_writes_under(None);
    d.round().await;
    for name in ["e/a", "e/b"] {
        assert_eq!(
            linked_tail(&d, "local", "s", name),
            Some(h.tail(name)),
            "{name} changed in a batch taken before the start was stored"
        );
    }
    assert!(has_wake(&d, "s"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_watch_of_an_overflowed_batch_rescans() {
    let h = harness("first-watch-overflow", |c| {
        c.streams.max_pending_changes = 1
    })
    .await;
    h.forget_watermarks().await;
    let d = h.dispatcher(SubscriptionLimits::default()).await;
    d.put(&caller("local"), "s", pattern("e/*", "wakes"))
        .await
        .unwrap();
    // More streams changed than the engine holds names of: the batch only says so.
    h.create("e/a", "one").await;
    h.create("e/b", "two").await;
    d.round().await;
    for name in ["e/a", "e/b"] {
        assert_eq!(linked_tail(&d, "local", "s", name), Some(h.tail(name)));
    }
    assert!(has_wake(&d, "s"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_first_watch_saw_live_is_found_again_after_a_crash() {
    let h = harness("first-watch-crash", |_| {}).await;
    let first = h.first_start_with_a_pattern().await;
    h.create("e/a", "one").await;
    // Seen live by the first round (a pattern link is stored only once something is acked).
    first.round().await;
    assert_eq!(linked_tail(&first, "local", "s", "e/a"), Some(3));
    // The process dies before anything is acked: the next one finds the link again.
    drop(first);
    let next = h.dispatcher(SubscriptionLimits::default()).await;
    next.round().await;
    assert_eq!(linked_tail(&next, "local", "s", "e/a"), Some(3));
    assert!(has_wake(&next, "s"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_made_while_a_round_runs_hears_of_every_change() {
    let h = harness("subscribe-race", |_| {}).await;
    let d = h.dispatcher(SubscriptionLimits::default()).await;
    h.create("x", "a").await;
    d.round().await;
    let (reached_tx, reached) = tokio::sync::oneshot::channel();
    let (resume, resume_rx) = tokio::sync::oneshot::channel();
    *d.put_pause.lock().unwrap() = Some(Pause {
        reached: reached_tx,
        resume: resume_rx,
    });
    // `put` has read the tails (x at 1) and is held before the subscription exists.
    let put = tokio::spawn({
        let d = d.clone();
        async move { d.put(&caller("local"), "s", listing(&["x"], "wakes")).await }
    });
    reached.await.unwrap();
    h.append("x", "b", false).await;
    // A round now would take x's change and find no subscription for it: it must wait.
    let mut round = tokio::spawn({
        let d = d.clone();
        async move { d.round().await }
    });
    let ran = tokio::time::timeout(Duration::from_secs(2), &mut round).await;
    let _ = resume.send(());
    put.await.unwrap().unwrap();
    if ran.is_err() {
        round.await.unwrap();
    }
    assert_eq!(
        linked_tail(&d, "local", "s", "x"),
        Some(2),
        "x's change went to a round that found no subscription"
    );
    assert!(has_wake(&d, "s"));
    assert!(
        ran.is_err(),
        "a round ran between reading the tails and creating"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_hangs_holds_no_delivery_slot() {
    let h = harness("hung-persist", |_| {}).await;
    let limits = SubscriptionLimits {
        max_deliveries: 1,
        store_timeout: Duration::from_millis(300),
        ..SubscriptionLimits::default()
    };
    let d = h.dispatcher(limits).await;
    h.create("xa", "").await;
    h.create("xb", "").await;
    // Wake events are JSON.
    h.create_as("wa", "application/json", "").await;
    h.create_as("wb", "application/json", "").await;
    let local = caller("local");
    d.put(&local, "a", listing(&["xa"], "wa")).await.unwrap();
    d.put(&local, "b", listing(&["xb"], "wb")).await.unwrap();
    d.round().await;
    // `a`'s wake goes first; storing its generation hangs.
    let a_object = paths::subscription(&h.node(), &store::key("a"));
    h.probe.hold_writes_under(Some(&a_object));
    h.append("xa", "1", false).await;
    d.round().await;
    h.append("xb", "1", false).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while h.tail("wb") == 0 {
        assert!(
            Instant::now() < deadline,
            "b's wake was never delivered: a's hung store write holds the only slot"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        d.round().await;
    }
    assert_eq!(
        h.tail("wa"),
        0,
        "a's generation is not stored: a is not woken"
    );
    h.probe.hold_writes_under(None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_holds_at_most_half_of_the_delivery_slots() {
    let h = harness("delivery-share", |_| {}).await;
    let limits = SubscriptionLimits {
        max_deliveries: 4,
        store_timeout: Duration::from_secs(60),
        ..SubscriptionLimits::default()
    };
    let d = h.dispatcher(limits).await;
    h.create("x", "").await;
    for id in ["a1", "a2", "a3", "a4"] {
        d.put(&caller("a"), id, listing(&["x"], "w")).await.unwrap();
    }
    d.put(&caller("b"), "b1", listing(&["x"], "w"))
        .await
        .unwrap();
    d.round().await;
    // Every delivery hangs storing its wake's generation, holding its slot.
    h.probe
        .hold_writes_under(Some(&paths::subscriptions(&h.node())));
    h.append("x", "1", false).await;
    d.round().await;
    assert_eq!(d.deliveries.held_by("a"), 2, "a holds its share");
    assert_eq!(d.deliveries.held_by("b"), 1, "b is not left waiting");
    d.round().await;
    assert_eq!(d.deliveries.held_by("a"), 2);
    assert_eq!(d.deliveries.free(), 1);
    h.probe.hold_writes_under(None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_is_no_news_to_a_restarts_rescan() {
    let mut h = harness("close-only", |_| {}).await;
    h.create("e/a", "old").await;
    let first = h.dispatcher(SubscriptionLimits::default()).await;
    first.round().await;
    // Made after e/a's data; then e/a is only closed.
    first
        .put(&caller("local"), "s", pattern("e/*", "wakes"))
        .await
        .unwrap();
    h.append("e/a", "", true).await;
    first.round().await;
    assert_eq!(linked_tail(&first, "local", "s", "e/a"), None);
    // Across a checkpoint (the last data change is kept in it) and a restart.
    h.db.streams().checkpoint(true).await.unwrap();
    drop(first);
    h.restart().await;
    let next = h.dispatcher(SubscriptionLimits::default()).await;
    next.round().await;
    assert_eq!(
        linked_tail(&next, "local", "s", "e/a"),
        None,
        "a stream only closed since the subscription was made is linked by the rescan"
    );
    assert!(!has_wake(&next, "s"));
    // Data is news.
    h.create("e/b", "new").await;
    next.round().await;
    assert_eq!(linked_tail(&next, "local", "s", "e/b"), Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_the_first_watch_is_stored_loses_nothing() {
    let h = harness("crash-before-watch", |_| {}).await;
    let first = h.first_start_with_a_pattern().await;
    h.create("e/a", "one").await;
    // The process dies before any round: the next one starts watching where the
    // subscription was made, not where the engine stands when it starts.
    drop(first);
    let next = h.dispatcher(SubscriptionLimits::default()).await;
    next.round().await;
    assert_eq!(linked_tail(&next, "local", "s", "e/a"), Some(3));
    assert!(has_wake(&next, "s"));
}
