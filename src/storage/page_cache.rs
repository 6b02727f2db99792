//! Dropping a file's synced pages from the kernel's page cache.
//!
//! On the VMs sluice is benchmarked on, a write into page-cache pages the system has not used
//! lately costs many times a write into pages just freed: the host backs a guest page only
//! when it is first touched, and takes back pages left free. A 64 MiB `write` into a new file
//! took 0.3-0.5 s of system time there, into pages just freed 0.03 s. So the commit log's
//! segments (read only by a restart's replay) and the local store's large objects (read next
//! by compaction, a cold query or a cold stream read, from disk then) have their pages
//! dropped once synced, and the next writes reuse those pages. Only clean pages are dropped,
//! so a file's contents never change; a failure costs speed only.

use std::fs::File;

/// Drops the clean cached pages of `len` bytes of `file` from `from` (`POSIX_FADV_DONTNEED`);
/// whether the kernel took the advice.
pub(crate) fn drop_cached(file: &File, from: u64, len: u64) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::os::fd::AsRawFd as _;
        let (Ok(from), Ok(len)) = (libc::off64_t::try_from(from), libc::off64_t::try_from(len))
        else {
            return false;
        };
        // SAFETY: `posix_fadvise64` on a descriptor borrowed from a live `File`, for a byte
        // range of it; no memory is passed, and `POSIX_FADV_DONTNEED` only drops clean cached
        // pages (the file's contents are unchanged).
        let rc = unsafe {
            libc::posix_fadvise64(file.as_raw_fd(), from, len, libc::POSIX_FADV_DONTNEED)
        };
        rc == 0
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = (file, from, len);
        false
    }
}

/// Test helpers: where a page cache is kept, and which pages of a file are in it.
#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
pub(crate) mod testing {
    use std::fs::File;
    use std::io;
    use std::path::PathBuf;

    /// A scratch directory on a file system that keeps a page cache (not tmpfs, whose pages
    /// are the files themselves and are never dropped).
    pub(crate) fn scratch_dir(prefix: &str) -> PathBuf {
        let name = format!("{prefix}-{}", std::process::id());
        let tmp = std::env::temp_dir();
        let on_tmpfs = {
            use std::os::unix::ffi::OsStrExt as _;
            let path = std::ffi::CString::new(tmp.as_os_str().as_bytes()).unwrap();
            let mut stat = std::mem::MaybeUninit::<libc::statfs>::zeroed();
            // SAFETY: `statfs` writes a `struct statfs` into the buffer it is given, which is
            // one, for a NUL-terminated path that lives across the call.
            let rc = unsafe { libc::statfs(path.as_ptr(), stat.as_mut_ptr()) };
            // SAFETY: on success `statfs` filled the struct (and it was zeroed before).
            rc == 0 && unsafe { stat.assume_init() }.f_type == libc::TMPFS_MAGIC
        };
        let base = if on_tmpfs {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target")
        } else {
            tmp
        };
        base.join(name)
    }

    /// Whether the file system under `dir` (created if missing) keeps written pages cached
    /// and drops them when advised: a probe file is written, synced, checked cached, advised
    /// away with `posix_fadvise` itself (not [`drop_cached`](super::drop_cached), which the
    /// tests check) and checked gone. Where it does not (tmpfs under an overlay, 9p, ZFS),
    /// a test of dropping has nothing to observe.
    pub(crate) fn drops_pages_here(dir: &std::path::Path) -> bool {
        use std::io::Write as _;
        use std::os::fd::AsRawFd as _;
        std::fs::create_dir_all(dir).unwrap();
        let path = dir.join("page-cache-probe");
        // Readable too: `resident` maps it.
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        file.write_all(&vec![1u8; 1 << 20]).unwrap();
        file.sync_all().unwrap();
        let share = |file: &File| {
            let pages = resident(file, 1 << 20);
            pages.iter().filter(|p| **p).count() as f64 / pages.len() as f64
        };
        let cached = share(&file);
        // SAFETY: `posix_fadvise64` on a descriptor borrowed from a live `File`; no memory is
        // passed, and `POSIX_FADV_DONTNEED` only drops clean cached pages.
        let rc =
            unsafe { libc::posix_fadvise64(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let dropped = rc == 0 && share(&file) < 0.05;
        drop(file);
        let _ = std::fs::remove_file(&path);
        let works = cached > 0.5 && dropped;
        if !works {
            eprintln!(
                "{}: this file system does not drop cached pages when advised; nothing to test",
                dir.display()
            );
        }
        works
    }

    /// Which pages of the first `len` bytes of `file` are in the page cache.
    pub(crate) fn resident(file: &File, len: u64) -> Vec<bool> {
        use std::os::fd::AsRawFd as _;
        let len = usize::try_from(len).unwrap();
        // SAFETY: `sysconf` reads a constant.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap();
        let mut pages = vec![0u8; len.div_ceil(page)];
        // SAFETY: a read-only shared mapping of `len` bytes of a live file, whose memory is
        // never read: `mincore` only reports which of its pages are cached, into a vector of
        // one byte per page, and the mapping is unmapped before returning.
        unsafe {
            let addr = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            );
            assert_ne!(addr, libc::MAP_FAILED, "{}", io::Error::last_os_error());
            let rc = libc::mincore(addr, len, pages.as_mut_ptr());
            libc::munmap(addr, len);
            assert_eq!(rc, 0, "{}", io::Error::last_os_error());
        }
        pages.iter().map(|p| p & 1 == 1).collect()
    }
}
