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
}

impl SyncJournal {
    /// A journal with nothing recorded.
    pub fn new() -> Self {
        Self::default()
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
        self.state()
            .files
            .insert(path.to_owned(), FileState::default());
    }

    /// A file's data was synced up to `len` bytes.
    pub(crate) fn synced(&self, path: &Path, len: u64) {
        let mut state = self.state();
        let file = state.files.entry(path.to_owned()).or_default();
        file.synced_len = len;
    }

    /// A file's first `len` bytes were allocated (reading as zeros) and the allocation synced.
    pub(crate) fn preallocated(&self, path: &Path, len: u64) {
        let mut state = self.state();
        let file = state.files.entry(path.to_owned()).or_default();
        file.preallocated = len;
    }

    /// A directory was synced: the entries of the files in it are durable.
    pub(crate) fn dir_synced(&self, dir: &Path) {
        for (path, file) in self.state().files.iter_mut() {
            if path.parent() == Some(dir) {
                file.entry_synced = true;
            }
        }
    }

    /// A file was removed.
    pub(crate) fn removed(&self, path: &Path) {
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
