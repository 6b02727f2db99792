//! Object storage: the one place that knows which backend holds the data at rest.
//!
//! [`Storage::open`] builds an `object_store` from a URL: a local directory (the default, under
//! the data directory; writes are fsynced before they count, see `local`),
//! `s3://bucket/prefix` (credentials, endpoint and region from the standard `AWS_*`
//! variables; path-style requests for MinIO and other S3-compatible servers), or `memory://`
//! for tests. Everything else in sluice sees only [`Storage::store`] and paths
//! relative to the database root.
//!
//! A local directory is held by the process using it (`DirHold`): a node's default store
//! alone, a directory named as the store shared. So no other node writes into a node's default
//! store while it runs (`Storage::is_private`), and the catalog need not look for versions
//! the node did not make; no node may name another node's default store at all (`db`).

pub(crate) mod gc;
#[cfg(feature = "testing")]
pub mod journal;
#[cfg(not(feature = "testing"))]
pub mod journal {
    //! Without the `testing` feature there is no simulated power loss: `SyncJournal` has no
    //! values, so every `Option<&SyncJournal>` the file-writing code carries is `None` and
    //! its calls compile away.
    use std::io;
    use std::path::Path;

    /// No journal can exist in this build.
    #[derive(Debug)]
    pub enum SyncJournal {}

    impl SyncJournal {
        pub(crate) fn check_alive(&self) -> io::Result<()> {
            match *self {}
        }
        pub(crate) fn existing(&self, _: &Path, _: u64) {
            match *self {}
        }
        pub(crate) fn created(&self, _: &Path) {
            match *self {}
        }
        pub(crate) fn synced(&self, _: &Path, _: u64) {
            match *self {}
        }
        pub(crate) fn preallocated(&self, _: &Path, _: u64) {
            match *self {}
        }
        pub(crate) fn dir_synced(&self, _: &Path) {
            match *self {}
        }
        pub(crate) fn removed(&self, _: &Path) {
            match *self {}
        }
    }
}
mod local;
pub(crate) mod page_cache;
pub(crate) mod paths;
pub mod probe;
pub(crate) mod versioned;

use std::path::Path;
use std::sync::Arc;

use object_store::ObjectStore;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey, S3ConditionalPut};
use object_store::memory::InMemory;
use object_store::prefix::PrefixStore;

pub(crate) use gc::GcReport;

/// Why object storage could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// A URL sluice cannot use.
    #[error("unsupported object store URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// Why it was refused.
        reason: &'static str,
    },
    /// The backend refused its configuration.
    #[error("cannot set up object store {url:?}: {source}")]
    Backend {
        /// The URL given.
        url: String,
        /// The backend's error.
        #[source]
        source: object_store::Error,
    },
    /// The local directory could not be created.
    #[error("cannot create object store directory {path}: {source}")]
    Io {
        /// The directory.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The local directory cannot be this node's store: it is another node's own default
    /// store (inside its data directory), another process runs on this data directory, or
    /// this node's default store is named as a shared store by another running node.
    #[error("object store directory {path} cannot be this node's store: {reason}")]
    InUse {
        /// The directory.
        path: String,
        /// Why.
        reason: &'static str,
    },
}

/// Which kind of backend a [`Storage`] uses (for logs and metrics only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    /// A local directory.
    Local,
    /// S3 or an S3-compatible server.
    S3,
    /// Process memory (tests).
    Memory,
}

/// The object store holding one sluice database.
#[derive(Debug, Clone)]
pub struct Storage {
    store: Arc<dyn ObjectStore>,
    url: String,
    backend: Backend,
    /// Where the database root is, as other programs name it (`file:///abs/dir`,
    /// `s3://bucket/prefix`), for the locations the Iceberg view publishes.
    location: String,
    /// For S3: the endpoint (when not AWS's) and region a reader needs (never credentials).
    s3_endpoint: Option<String>,
    s3_region: Option<String>,
    /// For a local directory: the directory, where [`Storage::exists`] looks without the
    /// store (stores layered over it, such as the probe, see the same files).
    local_root: Option<std::path::PathBuf>,
    /// For a local directory: this process's hold on it (see [`DirHold`]).
    hold: Option<Arc<DirHold>>,
}

/// How this process holds a local-directory store: a `flock` on the directory itself, for
/// as long as any clone of its [`Storage`] lives or until [`Storage::release_hold`]. A
/// node's default store (`objects/` inside its data directory, [`Storage::local_private`])
/// is held alone, with an exclusive lock; a directory named as the store ([`Storage::open`])
/// is held shared, so that several nodes may use it together. Neither kind opens while the
/// other is held by another process: no node can write into another node's default store,
/// which is what lets that node trust its own catalog without looking at the store for
/// newer versions ([`Storage::is_private`]).
///
/// Where locks cannot be trusted (a network or FUSE file system, or `flock` failing) a
/// default store is not private: the node looks at the store as if it were shared.
#[derive(Debug)]
struct DirHold {
    /// The directory's descriptor, locked; `None` once released (or if never locked).
    lock: std::sync::Mutex<Option<std::fs::File>>,
    /// Held alone, and not released.
    private: std::sync::atomic::AtomicBool,
    /// Released (at shutdown, or taken over by a reopen in this process): the holder must
    /// not change the catalog any more (see [`Storage::is_released`]).
    released: std::sync::atomic::AtomicBool,
    /// The directory's device and inode: a reopen in this process finds its own hold.
    id: (u64, u64),
}

/// The private holds of this process, by directory (see [`DirHold::take`]).
static PRIVATE_HOLDS: std::sync::Mutex<Vec<std::sync::Weak<DirHold>>> =
    std::sync::Mutex::new(Vec::new());

impl DirHold {
    /// Locks `dir`. A lock just released may still be held for a moment by a copy of its
    /// descriptor in a child process between its fork and its exec (the commit log's
    /// directory lock waits the same way). A private hold of the same directory by this
    /// process (a database shut down or crashed in place, and opened again, as tests and
    /// embedders do) is taken over: the old one stops counting as private.
    fn take(dir: &Path, private: bool) -> Result<Arc<DirHold>, StorageError> {
        use std::os::unix::fs::MetadataExt as _;
        use std::sync::atomic::AtomicBool;
        let io = |source| StorageError::Io {
            path: dir.display().to_string(),
            source,
        };
        let handle = std::fs::File::open(dir).map_err(io)?;
        let meta = handle.metadata().map_err(io)?;
        let id = (meta.dev(), meta.ino());
        let unheld = || {
            Arc::new(DirHold {
                lock: std::sync::Mutex::new(None),
                private: AtomicBool::new(false),
                released: AtomicBool::new(false),
                id,
            })
        };
        if private && !locks_are_local(&handle) {
            tracing::warn!(dir = %dir.display(), "the default store is not on a local file system known to this build: its catalog is looked at as a shared store's");
            return Ok(unheld());
        }
        let try_lock = |exclusive: bool| {
            if exclusive {
                handle.try_lock()
            } else {
                handle.try_lock_shared()
            }
        };
        let mut attempts = 0;
        loop {
            match try_lock(private) {
                Ok(()) => break,
                Err(std::fs::TryLockError::Error(error)) => {
                    tracing::warn!(dir = %dir.display(), %error, "the store directory cannot be locked: it is used as a shared store");
                    return Ok(unheld());
                }
                Err(std::fs::TryLockError::WouldBlock) if private && attempts == 0 => {
                    attempts += 1;
                    let mut holds = PRIVATE_HOLDS.lock().unwrap_or_else(|p| p.into_inner());
                    for old in holds.iter().filter_map(std::sync::Weak::upgrade) {
                        if old.id == id {
                            old.release();
                        }
                    }
                    holds.retain(|h| h.strong_count() > 0);
                }
                Err(std::fs::TryLockError::WouldBlock) if attempts < 20 => {
                    attempts += 1;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    let reason = if !private {
                        "it is a running node's own default store (inside its data directory), \
                         which no other node may name as its store"
                    } else if try_lock(false).is_ok() {
                        "another node names it as its object store; give this node the same \
                         --object-store to share it"
                    } else {
                        "another sluice process runs on this data directory"
                    };
                    return Err(StorageError::InUse {
                        path: dir.display().to_string(),
                        reason,
                    });
                }
            }
        }
        let hold = Arc::new(DirHold {
            lock: std::sync::Mutex::new(Some(handle)),
            private: AtomicBool::new(private),
            released: AtomicBool::new(false),
            id,
        });
        if private {
            let mut holds = PRIVATE_HOLDS.lock().unwrap_or_else(|p| p.into_inner());
            holds.retain(|h| h.strong_count() > 0);
            holds.push(Arc::downgrade(&hold));
        }
        Ok(hold)
    }

    /// Ends the hold: the lock is released and the store no longer counts as private.
    fn release(&self) {
        self.released
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.private
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.lock.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

/// The directory a store URL names, if it names one (a path, or `file://`).
pub(crate) fn local_dir(url: &str) -> Option<&Path> {
    match url.strip_prefix("file://") {
        Some(path) => Some(Path::new(path)),
        None if url.contains("://") || url == "memory:" => None,
        None => Some(Path::new(url)),
    }
}

/// Whether `flock` on the directory `handle` excludes every other process that can write
/// into it: only on file systems known to be local to this machine (a network or FUSE file
/// system may be written by another machine, whose locks ours do not exclude).
fn locks_are_local(handle: &std::fs::File) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd as _;
        // SAFETY: `fstatfs` only writes into the zeroed buffer it is given, and the
        // descriptor is open for the whole call (borrowed from `handle`).
        let (rc, fs) = unsafe {
            let mut fs: libc::statfs = std::mem::zeroed();
            (libc::fstatfs(handle.as_raw_fd(), &mut fs), fs)
        };
        if rc != 0 {
            return false;
        }
        // ext2/3/4, XFS, Btrfs, tmpfs, ramfs, ZFS, overlayfs, F2FS, bcachefs.
        const LOCAL: [u32; 9] = [
            0xEF53,
            0x5846_5342,
            0x9123_683E,
            0x0102_1994,
            0x8584_58F6,
            0x2FC1_2FC1,
            0x794C_7630,
            0xF2F5_2010,
            0xCA45_1A4E,
        ];
        // The magic is 32 bits wide; `f_type`'s width and sign differ between targets.
        #[allow(clippy::unnecessary_cast)]
        let magic = fs.f_type as u32;
        LOCAL.contains(&magic)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = handle;
        false
    }
}

impl Storage {
    /// Builds the object store for `url`.
    ///
    /// - `memory://`: a fresh in-memory store;
    /// - `s3://bucket[/prefix]`: S3 with settings from `AWS_*` variables; path-style requests,
    ///   region `us-east-1` unless set, conditional create through `If-None-Match`/ETag;
    /// - `file:///abs/dir` or a plain path: a local directory, created if missing.
    ///
    /// ```
    /// use object_store::ObjectStoreExt as _;
    /// # tokio_test_block(async {
    /// let storage = sluice::storage::Storage::open("memory://").unwrap();
    /// storage.store().put(&"a".into(), vec![1u8].into()).await.unwrap();
    /// # });
    /// # fn tokio_test_block<F: std::future::Future>(f: F) -> F::Output {
    /// #     tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
    /// # }
    /// ```
    pub fn open(url: &str) -> Result<Storage, StorageError> {
        Self::open_with(url, true, None)
    }

    /// [`Storage::open`], with a local directory's writes fsynced or not (`sync`) and its
    /// syncs recorded in `journal` (simulated power loss in tests).
    pub(crate) fn open_with(
        url: &str,
        sync: bool,
        journal: Option<Arc<journal::SyncJournal>>,
    ) -> Result<Storage, StorageError> {
        let invalid = |reason| StorageError::InvalidUrl {
            url: url.to_owned(),
            reason,
        };
        let backend_error = |source| StorageError::Backend {
            url: url.to_owned(),
            source,
        };
        if url == "memory://" || url == "memory:" {
            return Ok(Storage {
                store: Arc::new(InMemory::new()),
                url: url.to_owned(),
                backend: Backend::Memory,
                location: "memory://".to_owned(),
                s3_endpoint: None,
                s3_region: None,
                local_root: None,
                hold: None,
            });
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(invalid("an s3 URL needs a bucket: s3://bucket[/prefix]"));
            }
            let mut builder = AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_virtual_hosted_style_request(false)
                .with_conditional_put(S3ConditionalPut::ETagMatch);
            if std::env::var_os("AWS_REGION").is_none()
                && std::env::var_os("AWS_DEFAULT_REGION").is_none()
            {
                builder = builder.with_region("us-east-1");
            }
            let s3_endpoint = builder
                .get_config_value(&AmazonS3ConfigKey::Endpoint)
                .filter(|e| !e.is_empty());
            let s3_region = builder.get_config_value(&AmazonS3ConfigKey::Region);
            let s3 = builder.build().map_err(backend_error)?;
            let store: Arc<dyn ObjectStore> = match prefix.trim_matches('/') {
                "" => Arc::new(s3),
                p => Arc::new(PrefixStore::new(s3, p)),
            };
            let location = match prefix.trim_matches('/') {
                "" => format!("s3://{bucket}"),
                p => format!("s3://{bucket}/{p}"),
            };
            return Ok(Storage {
                store,
                url: url.to_owned(),
                backend: Backend::S3,
                location,
                s3_endpoint,
                s3_region,
                local_root: None,
                hold: None,
            });
        }
        let Some(dir) = local_dir(url) else {
            return Err(invalid("use a directory path, file://, s3:// or memory://"));
        };
        if dir.as_os_str().is_empty() {
            return Err(invalid("empty directory path"));
        }
        Self::local_with(dir, false, sync, journal).map(|mut s| {
            s.url = url.to_owned();
            s
        })
    }

    /// A node's default store, `dir` inside its data directory, held by this process alone
    /// (see [`DirHold`]): refused while another node has it open as a shared store.
    pub(crate) fn local_private(
        dir: &Path,
        sync: bool,
        journal: Option<Arc<journal::SyncJournal>>,
    ) -> Result<Storage, StorageError> {
        Self::local_with(dir, true, sync, journal)
    }

    /// A local directory store, held alone (`private`) or shared with other nodes (see
    /// [`DirHold`]); `sync` says whether writes are fsynced (durability `none` turns it off),
    /// `journal` records syncs for simulated power loss (tests).
    fn local_with(
        dir: &Path,
        private: bool,
        sync: bool,
        journal: Option<Arc<journal::SyncJournal>>,
    ) -> Result<Storage, StorageError> {
        std::fs::create_dir_all(dir).map_err(|source| StorageError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        let hold = DirHold::take(dir, private)?;
        let store = local::DurableLocalStore::new(dir, sync, journal).map_err(|source| {
            StorageError::Backend {
                url: dir.display().to_string(),
                source,
            }
        })?;
        // An absolute, canonical directory: what the Iceberg view names is read by other
        // processes, from other working directories. Not percent-encoded: readers take the
        // path after `file://` as it is (pyiceberg does not decode `%20`; Hadoop's `Path`
        // would encode it again).
        let absolute = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        let location = format!(
            "file://{}",
            absolute.display().to_string().trim_end_matches('/')
        );
        if location.contains(['#', '?']) {
            // A URL parser takes these for a fragment or a query: readers would look for the
            // files somewhere else.
            tracing::warn!(%location, "a data directory whose path holds '#' or '?' cannot be read through the Iceberg view");
        }
        Ok(Storage {
            store: Arc::new(store),
            url: dir.display().to_string(),
            backend: Backend::Local,
            location,
            s3_endpoint: None,
            s3_region: None,
            local_root: Some(absolute),
            hold: Some(hold),
        })
    }

    /// Wraps an existing store (for tests that inject faults).
    pub fn from_store(store: Arc<dyn ObjectStore>, url: impl Into<String>) -> Storage {
        let url = url.into();
        Storage {
            store,
            location: url.trim_end_matches('/').to_owned(),
            url,
            backend: Backend::Memory,
            s3_endpoint: None,
            s3_region: None,
            local_root: None,
            hold: None,
        }
    }

    /// Whether no other node can write into this store: it is this node's default store,
    /// held alone. (A store wrapped by [`Storage::layered`] keeps its hold.)
    pub(crate) fn is_private(&self) -> bool {
        self.hold
            .as_ref()
            .is_some_and(|hold| hold.private.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// Whether this process's hold on the directory has ended (see
    /// [`Storage::release_hold`]; a reopen in this process takes a private hold over): the
    /// holder must not change the catalog any more, since a node that opened the directory
    /// since would not look for the change.
    pub(crate) fn is_released(&self) -> bool {
        self.hold
            .as_ref()
            .is_some_and(|hold| hold.released.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// Ends this process's hold on a local directory (the node shuts down): another node
    /// may open it at once, and it no longer counts as private here.
    pub(crate) fn release_hold(&self) {
        if let Some(hold) = &self.hold {
            hold.release();
        }
    }

    /// The same storage through another store layered over this one (a probe, say).
    pub(crate) fn layered(&self, store: Arc<dyn ObjectStore>) -> Storage {
        Storage {
            store,
            ..self.clone()
        }
    }

    /// Whether object `path` exists. In a local directory, one `stat` on the calling thread
    /// for a path of plain characters (a small object a request looks for often, such as the
    /// catalog's next version: the store's `HEAD` goes through the blocking pool, two thread
    /// switches each time); otherwise the store's `HEAD`.
    pub(crate) async fn exists(
        &self,
        path: &object_store::path::Path,
    ) -> object_store::Result<bool> {
        let plain = |p: &str| {
            !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'/' | b'_' | b'-' | b'.'))
                && p.split('/')
                    .all(|part| !part.is_empty() && part != "." && part != "..")
        };
        match &self.local_root {
            Some(root) if plain(path.as_ref()) => {
                match std::fs::metadata(root.join(path.as_ref())) {
                    Ok(meta) => Ok(meta.is_file()),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
                    Err(source) if source.kind() == std::io::ErrorKind::PermissionDenied => {
                        Err(object_store::Error::PermissionDenied {
                            path: path.to_string(),
                            source: Box::new(source),
                        })
                    }
                    Err(source) => Err(object_store::Error::Generic {
                        store: "LocalFileSystem",
                        source: Box::new(source),
                    }),
                }
            }
            _ => match object_store::ObjectStoreExt::head(&self.store, path).await {
                Ok(_) => Ok(true),
                Err(object_store::Error::NotFound { .. }) => Ok(false),
                Err(e) => Err(e),
            },
        }
    }

    /// The object store.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// The URL it was opened from.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The URI of object `path` as other programs name it (`file:///…`, `s3://…`).
    pub(crate) fn location_of(&self, path: &str) -> String {
        format!("{}/{}", self.location, path.trim_start_matches('/'))
    }

    /// For S3, what a reader needs besides its own credentials to read the objects:
    /// `(endpoint, region)` (the endpoint only when not AWS's default).
    pub(crate) fn s3_settings(&self) -> Option<(Option<&str>, Option<&str>)> {
        (self.backend == Backend::S3)
            .then_some((self.s3_endpoint.as_deref(), self.s3_region.as_deref()))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use object_store::ObjectStoreExt as _;
    use object_store::path::Path as ObjectPath;

    use super::*;

    /// A node's default store is held alone: no open of the directory as a shared store is
    /// let in while it lives, nor the other way round (whichever comes first), while
    /// directories named as stores are shared; a hold ends with the last clone of the
    /// storage or when released. A second private open in this process (a database opened
    /// again in place) takes the hold over: the first no longer counts as private.
    #[test]
    fn a_default_store_is_held_alone_and_a_named_one_is_shared() {
        let dir = std::env::temp_dir().join(format!("sluice-hold-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let url = dir.display().to_string();
        let in_use = |result: Result<Storage, StorageError>| {
            matches!(result, Err(StorageError::InUse { .. }))
        };

        let private = Storage::local_private(&dir, false, None).expect("private");
        if !local_file_system(&dir) {
            // Where locks cannot be trusted the default store is held by nothing and shared.
            eprintln!(
                "{}: not a file system known to be local: checked as shared",
                dir.display()
            );
            assert!(!private.is_private());
            assert!(Storage::open(&url).is_ok());
            return;
        }
        assert!(private.is_private());
        let layered = private.layered(private.store().clone());
        assert!(layered.is_private(), "a layered store keeps the hold");
        assert!(
            in_use(Storage::open(&url)),
            "a shared open of a private store"
        );
        drop(private);
        assert!(in_use(Storage::open(&url)), "a clone still holds it");
        let again = Storage::local_private(&dir, false, None).expect("taken over");
        assert!(again.is_private());
        assert!(!layered.is_private(), "the hold taken over");
        assert!(in_use(Storage::open(&url)), "held by the new owner");
        again.release_hold();
        assert!(!again.is_private());

        let shared = Storage::open(&url).expect("shared once released");
        assert!(!shared.is_private());
        let other = Storage::open(&format!("file://{url}")).expect("shared twice");
        assert!(
            in_use(Storage::local_private(&dir, false, None)),
            "a private open of a shared store"
        );
        drop((shared, other));
        assert!(Storage::local_private(&dir, false, None).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Whether the tests' directory is on a file system whose locks count (see
    /// `locks_are_local`): the private hold's tests check the shared behaviour elsewhere.
    pub(crate) fn local_file_system(dir: &Path) -> bool {
        std::fs::File::open(dir).is_ok_and(|handle| locks_are_local(&handle))
    }

    /// `exists` answers as the store's `HEAD` does, for objects written through the store,
    /// missing ones, a directory and a name of other characters (looked up through the store).
    #[tokio::test]
    async fn exists_answers_as_the_store_does() {
        let dir = std::env::temp_dir().join(format!("sluice-exists-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let local = Storage::local_with(&dir, false, false, None).expect("local");
        let memory = Storage::open("memory://").expect("memory");
        for storage in [&local, &memory] {
            for name in ["catalog/log/00000000000000000001.json", "a b/ü%.json"] {
                let path = ObjectPath::from(name);
                assert!(!storage.exists(&path).await.expect("missing"), "{name}");
                storage
                    .store()
                    .put(&path, bytes::Bytes::from_static(b"{}").into())
                    .await
                    .expect("put");
                assert!(storage.exists(&path).await.expect("there"), "{name}");
                let head = storage.store().head(&path).await.is_ok();
                assert!(head, "{name}");
            }
            // A prefix of objects is no object.
            assert!(
                !storage
                    .exists(&ObjectPath::from("catalog/log"))
                    .await
                    .expect("a directory")
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
