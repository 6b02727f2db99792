//! The local-directory object store, made durable: `object_store`'s `LocalFileSystem` writes a
//! temporary file and renames it into place but never calls `fsync`, so after a power loss an
//! object it reported written can be empty or missing, while the commit log was already cut
//! behind it. This store writes objects itself: the staged file is written and `fsync`ed
//! before it is renamed (or, for a conditional create, linked) into place, so its name never
//! stands for data that is not durable, and then the directories on its path are synced (its
//! own, and those above it up to the store's root the first time it sees them). A failed sync
//! fails the write. Reads, listings and deletes go to `LocalFileSystem`. A synced object of a
//! megabyte or more has its pages dropped from the page cache (see `page_cache`).
//!
//! With durability `none` it syncs nothing, like the log. Every write reports to the
//! [`SyncJournal`] when one is set (simulated power loss in tests).

use std::collections::HashSet;
use std::ops::Range;
use std::path::{Path as FsPath, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult, Result, UploadPart,
};

use super::journal::SyncJournal;
use super::page_cache::drop_cached;

/// Objects at least this large have their pages dropped from the page cache once synced
/// (`page_cache`): Parquet files and stream checkpoints, whose writes into pages the system
/// had not used lately cost more CPU than the rest of a flush's I/O. Their next reader
/// (compaction, a cold query, a read of sealed stream records past the chunk cache) reads
/// from disk instead. Smaller objects (manifests, read at once and often) keep theirs.
const UNCACHE_MIN_BYTES: u64 = 1 << 20;

/// Drops the pages of `file`, synced and `len` bytes long, if it is large enough.
fn uncache_if_large(file: &std::fs::File, len: u64) {
    if len >= UNCACHE_MIN_BYTES {
        drop_cached(file, 0, len);
    }
}

/// A local directory store whose writes are durable when they return.
#[derive(Debug)]
pub(super) struct DurableLocalStore {
    inner: Arc<LocalFileSystem>,
    sync: Arc<Syncer>,
}

/// Syncs files and directories of one store root.
#[derive(Debug)]
struct Syncer {
    root: PathBuf,
    enabled: bool,
    journal: Option<Arc<SyncJournal>>,
    /// Directories whose own entries are known durable (from the root down).
    durable_dirs: Mutex<HashSet<PathBuf>>,
}

fn io_error(e: std::io::Error) -> object_store::Error {
    object_store::Error::Generic {
        store: "DurableLocalStore",
        source: Box::new(e),
    }
}

impl Syncer {
    /// Writes `payload` at `path`: staged beside it, synced, then renamed into place (or, for
    /// a conditional create, linked, so an existing object is never replaced), and the
    /// directory synced.
    fn put_durably(&self, path: &FsPath, payload: &PutPayload, create: bool) -> Result<PutResult> {
        use std::io::Write as _;
        let dir = path
            .parent()
            .ok_or_else(|| io_error(std::io::Error::other("an object path has a directory")))?;
        std::fs::create_dir_all(dir).map_err(io_error)?;
        // `#` marks a staged file: LocalFileSystem's listings skip it.
        let staged = {
            let mut name = path.as_os_str().to_owned();
            name.push(format!("#sluice-{}", uuid::Uuid::new_v4().simple()));
            PathBuf::from(name)
        };
        let written = (|| {
            let mut file = std::fs::File::create(&staged)?;
            for chunk in payload.iter() {
                file.write_all(chunk)?;
            }
            file.sync_all()?;
            let len = file.metadata()?.len();
            uncache_if_large(&file, len);
            Ok::<u64, std::io::Error>(len)
        })();
        let len = match written {
            Ok(len) => len,
            Err(e) => {
                let _ = std::fs::remove_file(&staged);
                return Err(io_error(e));
            }
        };
        let placed = if create {
            let linked = std::fs::hard_link(&staged, path);
            let _ = std::fs::remove_file(&staged);
            linked
        } else {
            std::fs::rename(&staged, path)
        };
        if let Err(e) = placed {
            let _ = std::fs::remove_file(&staged);
            return Err(if e.kind() == std::io::ErrorKind::AlreadyExists {
                object_store::Error::AlreadyExists {
                    path: path.display().to_string(),
                    source: Box::new(e),
                }
            } else {
                io_error(e)
            });
        }
        if let Some(journal) = &self.journal {
            journal.created(path);
            journal.synced(path, len);
        }
        self.dir_changed(dir).map_err(io_error)?;
        Ok(PutResult {
            e_tag: None,
            version: None,
        })
    }

    /// Makes the file at `path` and its directory entry durable.
    fn file_written(&self, path: &FsPath) -> std::io::Result<()> {
        if let Some(journal) = &self.journal {
            journal.created(path);
        }
        if !self.enabled {
            return Ok(());
        }
        let file = std::fs::File::open(path)?;
        file.sync_all()?;
        let len = file.metadata()?.len();
        if let Some(journal) = &self.journal {
            journal.synced(path, len);
        }
        uncache_if_large(&file, len);
        drop(file);
        let Some(dir) = path.parent() else {
            return Ok(());
        };
        self.dir_changed(dir)
    }

    /// Syncs `dir` (a file in it was added or removed) and, the first time, the directories
    /// above it up to the root, so that every entry on the path is durable.
    fn dir_changed(&self, dir: &FsPath) -> std::io::Result<()> {
        sync_dir(dir, self.journal.as_deref())?;
        let mut known = self.durable_dirs.lock().unwrap_or_else(|p| p.into_inner());
        let mut child = dir.to_path_buf();
        while child != self.root && !known.contains(&child) {
            let Some(parent) = child.parent() else { break };
            sync_dir(parent, self.journal.as_deref())?;
            known.insert(child.clone());
            child = parent.to_path_buf();
        }
        Ok(())
    }

    /// A file was removed: the directories above it may be cleaned up (removed when empty),
    /// so they are no longer known durable.
    fn file_removed(&self, path: &FsPath) {
        if let Some(journal) = &self.journal {
            journal.removed(path);
        }
        let mut known = self.durable_dirs.lock().unwrap_or_else(|p| p.into_inner());
        let mut dir = path.parent();
        while let Some(d) = dir {
            if d == self.root {
                break;
            }
            known.remove(d);
            dir = d.parent();
        }
    }
}

fn sync_dir(dir: &FsPath, journal: Option<&SyncJournal>) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()?;
    if let Some(journal) = journal {
        journal.dir_synced(dir);
    }
    Ok(())
}

impl DurableLocalStore {
    /// A store over `dir` (created if missing); `sync` says whether writes are fsynced.
    pub(super) fn new(dir: &FsPath, sync: bool, journal: Option<Arc<SyncJournal>>) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(io_error)?;
        let root = std::fs::canonicalize(dir).map_err(io_error)?;
        let inner = LocalFileSystem::new_with_prefix(&root)?
            // Let conditional creates and deletes clean up empty directories.
            .with_automatic_cleanup(true);
        Ok(DurableLocalStore {
            inner: Arc::new(inner),
            sync: Arc::new(Syncer {
                root,
                enabled: sync,
                journal,
                durable_dirs: Mutex::new(HashSet::new()),
            }),
        })
    }

    fn check_alive(&self) -> Result<()> {
        match &self.sync.journal {
            Some(journal) => journal.check_alive().map_err(io_error),
            None => Ok(()),
        }
    }

    /// Makes the object at `location` durable.
    async fn written(&self, location: &Path) -> Result<()> {
        let path = self.inner.path_to_filesystem(location)?;
        file_written(self.sync.clone(), path).await
    }
}

/// Makes the file at `path` durable (on a blocking thread: fsync blocks).
async fn file_written(sync: Arc<Syncer>, path: PathBuf) -> Result<()> {
    tokio::task::spawn_blocking(move || sync.file_written(&path))
        .await
        .map_err(|e| object_store::Error::Generic {
            store: "DurableLocalStore",
            source: Box::new(e),
        })?
        .map_err(io_error)
}

impl std::fmt::Display for DurableLocalStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DurableLocalStore({})", self.sync.root.display())
    }
}

/// A multipart upload whose completed object is made durable before `complete` returns.
#[derive(Debug)]
struct DurableUpload {
    inner: Box<dyn MultipartUpload>,
    path: PathBuf,
    sync: Arc<Syncer>,
}

#[async_trait::async_trait]
impl MultipartUpload for DurableUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        self.inner.put_part(data)
    }

    async fn complete(&mut self) -> Result<PutResult> {
        let result = self.inner.complete().await?;
        file_written(self.sync.clone(), self.path.clone()).await?;
        Ok(result)
    }

    async fn abort(&mut self) -> Result<()> {
        self.inner.abort().await
    }
}

#[async_trait::async_trait]
impl ObjectStore for DurableLocalStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.check_alive()?;
        if !self.sync.enabled || matches!(opts.mode, PutMode::Update(_)) {
            // Not synced (durability none), or a mode only LocalFileSystem answers (it
            // refuses updates).
            let result = self.inner.put_opts(location, payload, opts).await?;
            self.written(location).await?;
            return Ok(result);
        }
        let path = self.inner.path_to_filesystem(location)?;
        let sync = self.sync.clone();
        let create = matches!(opts.mode, PutMode::Create);
        tokio::task::spawn_blocking(move || sync.put_durably(&path, &payload, create))
            .await
            .map_err(|e| object_store::Error::Generic {
                store: "DurableLocalStore",
                source: Box::new(e),
            })?
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.check_alive()?;
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(DurableUpload {
            inner,
            path: self.inner.path_to_filesystem(location)?,
            sync: self.sync.clone(),
        }))
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    /// `LocalFileSystem`'s: each range read on its own from one open file. (The trait's
    /// default merges ranges less than a megabyte apart, right for a remote store's
    /// requests; here it made a Parquet scan that wants a few pages copy whole column
    /// chunks, through one blocking task, open and `stat` for each merged range.)
    async fn get_ranges(&self, location: &Path, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let inner = self.inner.clone();
        let sync = self.sync.clone();
        self.inner
            .delete_stream(locations)
            .map(move |deleted| {
                if let Ok(location) = &deleted
                    && let Ok(path) = inner.path_to_filesystem(location)
                {
                    sync.file_removed(&path);
                }
                deleted
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.check_alive()?;
        self.inner.copy_opts(from, to, options).await?;
        self.written(to).await
    }
}

#[cfg(test)]
mod tests {
    use object_store::ObjectStoreExt as _;

    use super::*;

    #[tokio::test]
    async fn unsynced_objects_are_lost_in_a_power_loss_and_synced_ones_stay() {
        let dir = std::env::temp_dir().join(format!("sluice-durable-store-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sync in [true, false] {
            let journal = Arc::new(SyncJournal::new());
            let store =
                DurableLocalStore::new(&dir.join(sync.to_string()), sync, Some(journal.clone()))
                    .unwrap();
            store
                .put(&Path::from("a/b/c.json"), PutPayload::from_static(b"hello"))
                .await
                .unwrap();
            journal.power_loss().unwrap();
            assert!(
                store
                    .put(&Path::from("x"), PutPayload::from_static(b"1"))
                    .await
                    .is_err()
            );
            let survived = DurableLocalStore::new(&dir.join(sync.to_string()), sync, None)
                .unwrap()
                .get(&Path::from("a/b/c.json"))
                .await
                .is_ok();
            assert_eq!(survived, sync, "sync {sync}");
        }
    }

    /// A synced object of a megabyte or more leaves the page cache; a smaller one (a
    /// manifest, read at once) stays in it, as does a large one written without syncs.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[tokio::test]
    async fn large_synced_objects_leave_the_page_cache() {
        use crate::storage::page_cache::testing::{drops_pages_here, resident, scratch_dir};
        let dir = scratch_dir("sluice-store-uncache");
        let _ = std::fs::remove_dir_all(&dir);
        if !drops_pages_here(&dir) {
            return;
        }
        let cached_share = |path: &FsPath| {
            let file = std::fs::File::open(path).unwrap();
            let pages = resident(&file, file.metadata().unwrap().len());
            pages.iter().filter(|p| **p).count() as f64 / pages.len() as f64
        };
        for (sync, mode, bytes, dropped) in [
            (true, PutMode::Overwrite, 2 << 20, true),
            (true, PutMode::Create, 2 << 20, true),
            (true, PutMode::Overwrite, (1 << 20) - 1, false),
            (false, PutMode::Overwrite, 2 << 20, false),
        ] {
            let root = dir.join(format!("{sync}-{bytes}-{mode:?}"));
            let store = DurableLocalStore::new(&root, sync, None).unwrap();
            let location = Path::from("t/data.parquet");
            let data = vec![7u8; bytes];
            store
                .put_opts(
                    &location,
                    PutPayload::from(data.clone()),
                    mode.clone().into(),
                )
                .await
                .unwrap();
            let path = store.inner.path_to_filesystem(&location).unwrap();
            let share = cached_share(&path);
            if dropped {
                assert!(share < 0.05, "{share} of {bytes} bytes still cached");
            } else {
                // Loose: the clean pages of a kept object may be reclaimed under memory
                // pressure, but not most of them within the test.
                assert!(share > 0.5, "only {share} of {bytes} bytes cached");
            }
            // Dropped or not, the object reads back whole.
            let read = store.get(&location).await.unwrap().bytes().await.unwrap();
            assert_eq!(
                read.as_ref(),
                &data[..],
                "sync {sync}, {bytes} bytes, {mode:?}"
            );
        }
        // A multipart upload's object, synced when it completes, leaves it too.
        let store = DurableLocalStore::new(&dir.join("multipart"), true, None).unwrap();
        let location = Path::from("t/parts.parquet");
        let mut upload = store.put_multipart(&location).await.unwrap();
        for part in 0..2u8 {
            upload
                .put_part(PutPayload::from(vec![part; 3 << 20]))
                .await
                .unwrap();
        }
        upload.complete().await.unwrap();
        let path = store.inner.path_to_filesystem(&location).unwrap();
        let share = cached_share(&path);
        assert!(share < 0.05, "{share} of a multipart object still cached");
        let read = store.get(&location).await.unwrap().bytes().await.unwrap();
        assert_eq!(read.len(), 6 << 20);
        assert!(read[..3 << 20].iter().all(|b| *b == 0) && read[3 << 20..].iter().all(|b| *b == 1));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Ranges are read from the file as asked: each its own bytes, in order, however far
    /// apart or close together.
    #[tokio::test]
    async fn ranges_read_what_was_asked() {
        let dir = std::env::temp_dir().join(format!("sluice-ranges-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let store = DurableLocalStore::new(&dir, false, None).unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let path = Path::from("a/data.parquet");
        store
            .put(&path, PutPayload::from(data.clone()))
            .await
            .unwrap();
        let ranges = [
            5..9u64,
            9..20,
            1_500_000..1_600_000,
            0..1,
            2_999_999..3_000_000,
        ];
        let read = store.get_ranges(&path, &ranges).await.unwrap();
        assert_eq!(read.len(), ranges.len());
        for (range, bytes) in ranges.iter().zip(&read) {
            let (start, end) = (range.start as usize, range.end as usize);
            assert_eq!(bytes.as_ref(), &data[start..end]);
        }
        let past_the_end = [0..1u64, 3_000_001..3_000_002];
        assert!(store.get_ranges(&path, &past_the_end).await.is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
