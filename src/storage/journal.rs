//! A simulated power loss, for tests: the files sluice writes on local disk (the commit log,
//! the local object store, the node identity) report each write, `fsync` and directory sync
//! to a [`SyncJournal`]; [`SyncJournal::power_loss`] then puts every file back to what a real
//! power loss would leave: data written but not synced is gone, and files whose directory
//! entry was never synced are gone.
//!
//! In the spirit of SlateDB's failure points, this is an injectable fault of the real code
//! path, not a mock: sluice writes, syncs and renames files as always; the journal only
//! remembers how much of each file the syncs have made durable. After the power loss every
//! journaled operation fails, as on a machine that has stopped, until a new database opens
//! with a new journal.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// What a power loss would leave of one file.
#[derive(Debug, Clone, Copy, Default)]
struct FileState {
    /// Bytes made durable by the last sync of the file's data.
    synced_len: u64,
    /// Whether the file's directory entry is durable (its directory was synced since it was
    /// created or renamed into place).
    entry_synced: bool,
    /// Bytes allocated and synced ahead of the data (a preallocated log segment): after a
    /// power loss, unsynced writes inside them read as zeros instead of being cut off.
    preallocated: u64,
}

#[derive(Debug, Default)]
struct State {
    dead: bool,
    files: HashMap<PathBuf, FileState>,
}

/// Remembers, per file, what is durable; see the module docs.
#[derive(Debug, Default)]
pub struct SyncJournal {
    state: Mutex<State>,
    /// Where a recording journal also writes each operation, for a power loss applied by
    /// another process after this one was killed ([`SyncJournal::recording`]).
    record: Option<Mutex<std::fs::File>>,
}

impl SyncJournal {
    /// A journal with nothing recorded.
    pub fn new() -> Self {
        Self::default()
    }

    /// A journal that also appends every operation it is told of to the file at `path`, one
    /// line each (`op<TAB>len<TAB>path`), after the operation itself (a sync is recorded once
    /// it returned), so that a test can kill the process and then apply the power loss from
    /// the record ([`power_loss_from_record`]). The record is not synced: a killed process's
    /// writes stay in the page cache. The `sluice` binary of a test build opens one when
    /// `SLUICE_TEST_SYNC_RECORD` names a file.
    pub fn recording(path: &Path) -> io::Result<SyncJournal> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(SyncJournal {
            state: Mutex::default(),
            record: Some(Mutex::new(file)),
        })
    }

    fn note(&self, op: &str, path: &Path, len: u64) {
        use std::io::Write as _;
        if let Some(record) = &self.record {
            // One write per line, so a kill leaves whole lines and at most one cut one.
            let line = format!("{op}\t{len}\t{}\n", path.display());
            let mut file = record.lock().unwrap_or_else(|p| p.into_inner());
            let _ = file.write_all(line.as_bytes());
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fails once the power is lost: the machine no longer writes anything.
    pub(crate) fn check_alive(&self) -> io::Result<()> {
        if self.state().dead {
            Err(io::Error::other("simulated power loss"))
        } else {
            Ok(())
        }
    }

    /// A file that was there, whole and durable, when the journal started looking.
    pub(crate) fn existing(&self, path: &Path, len: u64) {
        self.note("existing", path, len);
        self.state()
            .files
            .entry(path.to_owned())
            .or_insert(FileState {
                synced_len: len,
                entry_synced: true,
                preallocated: 0,
            });
    }

    /// A file was created (or renamed into place): neither its data nor its entry is durable.
    pub(crate) fn created(&self, path: &Path) {
        self.note("created", path, 0);
        self.state()
            .files
            .insert(path.to_owned(), FileState::default());
    }

    /// A file's data was synced up to `len` bytes.
    pub(crate) fn synced(&self, path: &Path, len: u64) {
        self.note("synced", path, len);
        let mut state = self.state();
        let file = state.files.entry(path.to_owned()).or_default();
        file.synced_len = len;
    }

    /// A file's first `len` bytes were allocated (reading as zeros) and the allocation synced.
    pub(crate) fn preallocated(&self, path: &Path, len: u64) {
        self.note("preallocated", path, len);
        let mut state = self.state();
        let file = state.files.entry(path.to_owned()).or_default();
        file.preallocated = len;
    }

    /// A directory was synced: the entries of the files in it are durable.
    pub(crate) fn dir_synced(&self, dir: &Path) {
        self.note("dir_synced", dir, 0);
        for (path, file) in self.state().files.iter_mut() {
            if path.parent() == Some(dir) {
                file.entry_synced = true;
            }
        }
    }

    /// A file was removed.
    pub(crate) fn removed(&self, path: &Path) {
        self.note("removed", path, 0);
        self.state().files.remove(path);
    }

    /// The power goes out: every file is cut back to what its syncs made durable, files
    /// whose entry was never synced disappear, and every later journaled operation fails.
    /// Returns how many files lost data.
    pub fn power_loss(&self) -> io::Result<usize> {
        let mut state = self.state();
        state.dead = true;
        let mut damaged = 0;
        for (path, file) in state.files.drain() {
            let Ok(meta) = std::fs::metadata(&path) else {
                continue;
            };
            if !file.entry_synced {
                std::fs::remove_file(&path)?;
                damaged += 1;
            } else if meta.len() > file.synced_len {
                // Unsynced bytes inside preallocated space go back to zeros; past it, the file
                // is cut.
                let keep = file.synced_len.max(file.preallocated.min(meta.len()));
                let f = std::fs::OpenOptions::new().write(true).open(&path)?;
                zero_range(&f, file.synced_len, keep)?;
                f.set_len(keep)?;
                damaged += 1;
            }
        }
        Ok(damaged)
    }
}

/// Writes zeros over `[from, to)` of `file`.
fn zero_range(file: &std::fs::File, from: u64, to: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt as _;
    let zeros = [0u8; 64 << 10];
    let mut at = from;
    while at < to {
        let n = (to - at).min(zeros.len() as u64) as usize;
        file.write_all_at(&zeros[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

/// Applies a power loss to the files a killed process's recording journal names (see
/// [`SyncJournal::recording`]): every file is cut back to what its syncs made durable, and
/// files whose directory entry was never synced disappear. Files the process did not touch
/// are left as they are (what an earlier process left counts as written back). Returns how
/// many files lost data.
pub fn power_loss_from_record(record: &Path) -> io::Result<usize> {
    let text = std::fs::read_to_string(record)?;
    let journal = SyncJournal::new();
    for line in text.lines() {
        let mut fields = line.splitn(3, '\t');
        let (Some(op), Some(len), Some(path)) = (fields.next(), fields.next(), fields.next())
        else {
            // The last line, cut by the kill: the process was still inside the journal call,
            // so nothing it covers had been acknowledged; dropping it is the stricter reading.
            continue;
        };
        let Ok(len) = len.parse::<u64>() else {
            continue;
        };
        let path = Path::new(path);
        match op {
            "existing" => journal.existing(path, len),
            "created" => journal.created(path),
            "synced" => journal.synced(path, len),
            "preallocated" => journal.preallocated(path, len),
            "dir_synced" => journal.dir_synced(path),
            "removed" => journal.removed(path),
            _ => {}
        }
    }
    journal.power_loss()
}
