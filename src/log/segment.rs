//! Segment files: naming, framing, scanning and the file handle the writer appends to.
//!
//! A segment the writer creates is preallocated to the segment size (`fallocate`, Linux), and
//! the allocation synced before the first record goes in: every later group commit then writes
//! inside the file's size into blocks it already owns, so its `fdatasync` carries the data and
//! no size or allocation change. The unwritten rest reads as zeros. A scan therefore ends a
//! segment cleanly at the first record position where every byte to the end is zero, but only
//! in the last segment: before the log moves on to a new segment, the old one is cut back to
//! its records and the cut synced, so zeros at the end of any other segment are damage. (On
//! ext4 and XFS the first write into each preallocated block still converts its extent from
//! "unwritten", a journalled change; what preallocation saves is the size change and the
//! block allocation of every group.)

use std::fs::{self, File, OpenOptions};
use std::io::{self, IoSlice, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::{FRAME_HEADER_BYTES, GROUP_END, LogError, Lsn, MAX_RECORD_BYTES, Record, RecordKind};
use crate::storage::journal::SyncJournal;
use crate::storage::page_cache::drop_cached;

const SUFFIX: &str = ".log";

pub(super) fn segment_path(dir: &Path, first_lsn: Lsn) -> PathBuf {
    dir.join(format!("{first_lsn:020}{SUFFIX}"))
}

/// The segment files in `dir`, oldest first, with the first LSN their names give.
pub(super) fn list(dir: &Path) -> Result<Vec<(Lsn, PathBuf)>, LogError> {
    let mut segments = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| LogError::io(dir, e))? {
        let entry = entry.map_err(|e| LogError::io(dir, e))?;
        let name = entry.file_name();
        let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(SUFFIX)) else {
            continue;
        };
        if let Ok(first_lsn) = stem.parse::<Lsn>() {
            segments.push((first_lsn, entry.path()));
        }
    }
    segments.sort();
    Ok(segments)
}

/// The frame header of one record: length, checksum (of kind, LSN and payload), kind (with
/// the group-end mark on a group's last record), LSN.
pub(super) fn frame_header(
    lsn: Lsn,
    kind: RecordKind,
    group_end: bool,
    payload: &[u8],
) -> [u8; FRAME_HEADER_BYTES] {
    let len = payload.len() as u32;
    let kind = kind as u8 | if group_end { GROUP_END } else { 0 };
    let mut crc = crc32c::crc32c(&[kind]);
    crc = crc32c::crc32c_append(crc, &lsn.to_le_bytes());
    crc = crc32c::crc32c_append(crc, payload);
    let mut header = [0u8; FRAME_HEADER_BYTES];
    header[0..4].copy_from_slice(&len.to_le_bytes());
    header[4..8].copy_from_slice(&crc.to_le_bytes());
    header[8] = kind;
    header[9..17].copy_from_slice(&lsn.to_le_bytes());
    header
}

/// How much of a segment file holds whole, valid records.
pub(super) struct SegmentScan {
    /// Bytes up to the end of the last valid record.
    pub(super) valid_len: u64,
    /// Bytes up to the last nonzero byte (at least `valid_len`): past it, only zeros, as
    /// preallocated space nothing was written into reads.
    pub(super) written_len: u64,
    /// The file's size.
    pub(super) file_len: u64,
    /// Whether, past the first bad record, a complete group is followed by more valid
    /// records: then the bad record was acknowledged (corruption, not a torn tail).
    pub(super) complete_group_after: bool,
}

/// Reads a segment's records into `records`, stopping at the first record that is torn,
/// fails its checksum, or does not carry the next LSN (the first must be `first_lsn`).
pub(super) fn scan(
    path: &Path,
    records: &mut Vec<Record>,
    first_lsn: Lsn,
) -> Result<SegmentScan, LogError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|e| LogError::io(path, e))?;
    let mut pos = 0usize;
    let mut expected = first_lsn;
    while let Some((record, next, _)) = decode_at(&bytes, pos) {
        if record.lsn != expected {
            break;
        }
        expected += 1;
        records.push(record);
        pos = next;
    }
    // Preallocated space nothing was written into reads as zeros; a torn or damaged record
    // has nonzero bytes somewhere. Records after a bad one can start only before the last
    // nonzero byte (they may end in zeros: an Arrow stream's end marker does).
    let written_end = last_nonzero(&bytes, pos);
    let complete_group_after =
        pos < written_end && group_end_then_more(&bytes, pos, written_end, expected);
    Ok(SegmentScan {
        valid_len: pos as u64,
        written_len: written_end as u64,
        file_len: bytes.len() as u64,
        complete_group_after,
    })
}

/// The end of `bytes` without its trailing zeros, but not before `from`.
fn last_nonzero(bytes: &[u8], from: usize) -> usize {
    bytes[from..]
        .iter()
        .rposition(|&b| b != 0)
        .map_or(from, |i| from + i + 1)
}

/// Whether the bytes from `bad` on (where a record failed) hold a valid group-end record
/// followed by another valid record, with LSNs from `expected` on, each starting before
/// `starts_before`. Such records can only
/// have been written after the group holding `bad` was synced, so that group was
/// acknowledged. Records are looked for at every offset: the damaged record's length cannot
/// be trusted.
fn group_end_then_more(bytes: &[u8], bad: usize, starts_before: usize, expected: Lsn) -> bool {
    let mut seen_group_end = false;
    let mut at = bad + 1;
    while at < starts_before && at + FRAME_HEADER_BYTES <= bytes.len() {
        match decode_at(bytes, at) {
            Some((record, next, group_end)) if record.lsn >= expected => {
                if seen_group_end {
                    return true;
                }
                seen_group_end = group_end;
                at = next;
            }
            _ => at += 1,
        }
    }
    false
}

/// Decodes the record framed at `pos`, and whether it ends its group; `None` if it is torn
/// or corrupt.
pub(super) fn decode_at(bytes: &[u8], pos: usize) -> Option<(Record, usize, bool)> {
    let header = bytes.get(pos..pos + FRAME_HEADER_BYTES)?;
    let len = u32::from_le_bytes(header[0..4].try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(header[4..8].try_into().ok()?);
    if len > MAX_RECORD_BYTES {
        return None;
    }
    let kind_byte = header[8];
    let lsn_bytes: [u8; 8] = header[9..17].try_into().ok()?;
    let payload_start = pos + FRAME_HEADER_BYTES;
    let payload = bytes.get(payload_start..payload_start + len)?;
    let mut actual = crc32c::crc32c(&[kind_byte]);
    actual = crc32c::crc32c_append(actual, &lsn_bytes);
    actual = crc32c::crc32c_append(actual, payload);
    if actual != crc {
        return None;
    }
    let kind = RecordKind::from_byte(kind_byte)?;
    Some((
        Record {
            lsn: Lsn::from_le_bytes(lsn_bytes),
            kind,
            payload: payload.to_vec(),
        },
        payload_start + len,
        kind_byte & GROUP_END != 0,
    ))
}

/// Cuts a segment file to `len` bytes and syncs it.
pub(super) fn truncate(
    path: &Path,
    len: u64,
    journal: Option<&SyncJournal>,
) -> Result<(), LogError> {
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| LogError::io(path, e))?;
    file.set_len(len).map_err(|e| LogError::io(path, e))?;
    file.sync_all().map_err(|e| LogError::io(path, e))?;
    if let Some(journal) = journal {
        journal.synced(path, len);
    }
    Ok(())
}

/// Copies the bytes of segment `path` from `offset` on into `{file name}.{label}-{offset}`
/// beside it (synced, file and directory), then cuts the segment there. Returns the copy and
/// its size: what was cut is never thrown away, whatever the reason for cutting it.
pub(super) fn cut_keeping_tail(
    path: &Path,
    offset: u64,
    label: &str,
    journal: Option<&SyncJournal>,
) -> Result<(PathBuf, u64), LogError> {
    let bytes = fs::read(path).map_err(|e| LogError::io(path, e))?;
    let at = usize::try_from(offset)
        .unwrap_or(bytes.len())
        .min(bytes.len());
    let name = format!(
        "{}.{label}-{offset}",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("segment")
    );
    // A name not taken yet: an earlier cut at the same offset (crash, restart, the same
    // records appended again, crash) keeps its copy.
    let mut aside = path.with_file_name(&name);
    let mut n = 1;
    while aside.exists() {
        aside = path.with_file_name(format!("{name}.{n}"));
        n += 1;
    }
    // Every byte is kept, but the trailing zeros (most of them preallocated space nothing was
    // written into) as a hole: the copy reads the same and takes no disk for them.
    let tail = &bytes[at..];
    let written = last_nonzero(&bytes, at) - at;
    fs::write(&aside, &tail[..written])
        .and_then(|()| {
            let file = OpenOptions::new().write(true).open(&aside)?;
            file.set_len(tail.len() as u64)?;
            file.sync_all()
        })
        .map_err(|e| LogError::io(&aside, e))?;
    if let Some(dir) = path.parent() {
        sync_dir(dir, journal)?;
    }
    truncate(path, offset, journal)?;
    Ok((aside, tail.len() as u64))
}

/// Syncs a directory, so that files created or removed in it survive a crash.
pub(super) fn sync_dir(dir: &Path, journal: Option<&SyncJournal>) -> Result<(), LogError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| LogError::io(dir, e))?;
    if let Some(journal) = journal {
        journal.dir_synced(dir);
    }
    Ok(())
}

/// The segment the writer appends to.
pub(super) struct Segment {
    file: File,
    path: PathBuf,
    first_lsn: Lsn,
    len: u64,
    /// Where the last range dropped from the page cache ended ([`Segment::uncache_synced`]);
    /// after a reopen, the length it reopened at.
    uncached: u64,
}

/// Synced bytes are dropped from the page cache once at least this many have gathered: one
/// `posix_fadvise` for a megabyte of records, none for a small group.
const UNCACHE_BYTES: u64 = 1 << 20;

/// The newest bytes are kept: the kernel may still hold their pages in per-CPU batches, and a
/// drop that meets such a page drains every CPU's batches and walks its range again.
const UNCACHE_LAG_BYTES: u64 = 256 << 10;

/// Each drop starts this far before the last one ended, so that a page group (folio) larger
/// than a page that straddled that end, which the kernel skips, is dropped with the next.
const UNCACHE_OVERLAP_BYTES: u64 = 2 << 20;

/// Ranges are rounded down to this (the kernel rounds to its own page size inside them).
const PAGE_BYTES: u64 = 4096;

/// Reserves the first `bytes` of `file` on disk (extending its size, reading as zeros), and
/// syncs the allocation. Not every file system can; where it cannot, appends extend the file
/// as they go, which is correct, only slower to sync.
fn preallocate(
    file: &File,
    path: &Path,
    bytes: u64,
    journal: Option<&SyncJournal>,
) -> Result<(), LogError> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::fd::AsRawFd as _;
        let len = libc::off_t::try_from(bytes).unwrap_or(libc::off_t::MAX);
        // SAFETY: `fallocate` on a descriptor this function borrows from a live `File`, for a
        // byte range of it; no memory is passed, and mode 0 only allocates (never discards).
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
        if rc != 0 {
            // Preallocation only makes syncs cheaper: without it (a file system that cannot, a
            // disk with less free space than a segment, a size past the file system's limit)
            // appends extend the file as they go, as they did before.
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
                tracing::warn!(segment = %path.display(), error = %e, "could not preallocate a log segment; appending without");
            }
            return Ok(());
        }
        file.sync_all().map_err(|e| LogError::io(path, e))?;
        if let Some(journal) = journal {
            journal.preallocated(path, bytes);
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = (file, path, bytes, journal);
    Ok(())
}

impl Segment {
    /// Creates a new, empty segment whose first record will have `first_lsn`, preallocated to
    /// `preallocate` bytes (0: none).
    pub(super) fn create(
        dir: &Path,
        first_lsn: Lsn,
        preallocate_bytes: u64,
        journal: Option<&SyncJournal>,
    ) -> Result<Segment, LogError> {
        let path = segment_path(dir, first_lsn);
        let file = OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| LogError::io(&path, e))?;
        if let Some(journal) = journal {
            journal.created(&path);
        }
        if preallocate_bytes > 0 {
            preallocate(&file, &path, preallocate_bytes, journal)?;
        }
        Ok(Segment {
            file,
            path,
            first_lsn,
            len: 0,
            uncached: 0,
        })
    }

    /// Opens an existing segment to append after its last record, at `len` (its records are
    /// scanned and a torn tail cut already; past `len` it holds only zeros), preallocated to
    /// `preallocate` bytes (0: none) if it is smaller.
    pub(super) fn open_append(
        path: &Path,
        first_lsn: Lsn,
        len: u64,
        preallocate_bytes: u64,
        journal: Option<&SyncJournal>,
    ) -> Result<Segment, LogError> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| LogError::io(path, e))?;
        let size = file.metadata().map_err(|e| LogError::io(path, e))?.len();
        if preallocate_bytes > size {
            preallocate(&file, path, preallocate_bytes, journal)?;
        } else if preallocate_bytes > 0
            && let Some(journal) = journal
        {
            // Preallocated (and synced) when the segment was made.
            journal.preallocated(path, size);
        }
        file.seek(SeekFrom::Start(len))
            .map_err(|e| LogError::io(path, e))?;
        Ok(Segment {
            file,
            path: path.to_owned(),
            first_lsn,
            len,
            uncached: len - len % PAGE_BYTES,
        })
    }

    /// Gives back the preallocated space past the last record, once no more records will
    /// come. Before the log moves on to a new segment the cut is synced (`durable`): only the
    /// last segment may end in zeros, so that zeros at the end of any other one are damage.
    pub(super) fn trim(
        &self,
        durable: bool,
        journal: Option<&SyncJournal>,
    ) -> Result<(), LogError> {
        self.file
            .set_len(self.len)
            .map_err(|e| LogError::io(&self.path, e))?;
        if durable {
            self.sync_data(journal)?;
        }
        Ok(())
    }

    /// Writes all of `slices`, in order, with as few system calls as the kernel allows: each
    /// record's header and payload go straight from where they are, without first being
    /// copied into one buffer.
    pub(super) fn write_all_vectored(
        &mut self,
        mut slices: &mut [IoSlice<'_>],
    ) -> Result<(), LogError> {
        let total: usize = slices.iter().map(|s| s.len()).sum();
        while !slices.is_empty() {
            match self.file.write_vectored(slices) {
                Ok(0) => {
                    return Err(LogError::io(
                        &self.path,
                        io::Error::from(io::ErrorKind::WriteZero),
                    ));
                }
                Ok(written) => IoSlice::advance_slices(&mut slices, written),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(LogError::io(&self.path, e)),
            }
        }
        self.len += total as u64;
        Ok(())
    }

    pub(super) fn sync_data(&self, journal: Option<&SyncJournal>) -> Result<(), LogError> {
        self.file
            .sync_data()
            .map_err(|e| LogError::io(&self.path, e))?;
        if let Some(journal) = journal {
            journal.synced(&self.path, self.len);
        }
        Ok(())
    }

    /// Drops the synced records' pages from the page cache, once a megabyte has gathered,
    /// but for the newest quarter megabyte. Returns whether a range was dropped.
    ///
    /// Nothing reads a segment while it is written (the writer answers from memory; replay
    /// and repair read it after a restart, from disk now rather than the page cache), so its
    /// pages were only kept until memory ran short, and each write took a page the system
    /// had not used lately: on the VMs these benches run on, the copy into such pages was
    /// a large share of the server's CPU during bulk ingest (`copy_folio_from_iter_atomic`
    /// under the log's `writev`; benches/README.md, "The log's pages dropped once synced").
    /// Dropped, they are freed and reused by the next writes. Only clean pages are dropped,
    /// so this is called after a sync; a failure costs speed only.
    pub(super) fn uncache_synced(&mut self) -> bool {
        let end = self.len.saturating_sub(UNCACHE_LAG_BYTES);
        let end = end - end % PAGE_BYTES;
        if end < self.uncached.saturating_add(UNCACHE_BYTES) {
            return false;
        }
        let from = self.uncached.saturating_sub(UNCACHE_OVERLAP_BYTES);
        self.uncached = end;
        drop_cached(&self.file, from, end - from)
    }

    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    pub(super) fn first_lsn(&self) -> Lsn {
        self.first_lsn
    }

    pub(super) fn len(&self) -> u64 {
        self.len
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;
    use crate::storage::page_cache::testing::{drops_pages_here, resident, scratch_dir};

    #[test]
    fn synced_pages_are_dropped_a_megabyte_at_a_time_but_the_newest() {
        let dir = scratch_dir("sluice-uncache");
        let _ = fs::remove_dir_all(&dir);
        if !drops_pages_here(&dir) {
            return;
        }
        let mut segment = Segment::create(&dir, 1, 8 << 20, None).unwrap();
        let write = |segment: &mut Segment, bytes: usize, fill: u8| {
            let chunk = vec![fill; bytes];
            segment
                .write_all_vectored(&mut [IoSlice::new(&chunk)])
                .unwrap();
            segment.sync_data(None).unwrap();
            segment.uncache_synced()
        };
        // Under a megabyte past the newest quarter megabyte: nothing dropped.
        assert!(!write(&mut segment, 1_200_000, 1));
        assert_eq!(segment.uncached, 0);
        // Past it: dropped up to a page boundary a quarter megabyte before the end.
        assert!(
            write(&mut segment, 200_001, 2),
            "the kernel took the advice"
        );
        let end = 1_400_001 - UNCACHE_LAG_BYTES;
        assert_eq!(segment.uncached, end - end % PAGE_BYTES);
        let before = segment.uncached;
        assert!(!write(&mut segment, 5_000, 3));
        assert_eq!(
            segment.uncached, before,
            "under a megabyte since the last drop"
        );
        assert!(write(&mut segment, 3 << 20, 4));
        let end = segment.len - UNCACHE_LAG_BYTES;
        assert_eq!(segment.uncached, end - end % PAGE_BYTES);
        // The dropped range is out of the page cache, the newest bytes are still in it.
        let cached = resident(&segment.file, segment.len);
        let page = segment.len.div_ceil(cached.len() as u64);
        let dropped = (segment.uncached / page) as usize;
        let still = cached[..dropped].iter().filter(|c| **c).count();
        assert!(
            still * 20 < dropped,
            "{still} of {dropped} dropped pages still cached"
        );
        assert!(
            cached[dropped..].iter().any(|c| *c),
            "the newest pages are cached"
        );
        // Reopened, the segment drops nothing before the length it reopened at.
        let len = segment.len;
        let path = segment.path().to_owned();
        drop(segment);
        let reopened = Segment::open_append(&path, 1, len, 8 << 20, None).unwrap();
        assert_eq!(reopened.uncached, len - len % PAGE_BYTES);
        let _ = fs::remove_dir_all(&dir);
    }
}
