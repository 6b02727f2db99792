//! Garbage collection's shared parts: what a collection did, and the rule that an object is
//! deleted only after it was seen unreferenced for the whole grace period.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// What one collection did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GcReport {
    /// Objects deleted.
    pub objects: u64,
    /// Their bytes.
    pub bytes: u64,
}

impl GcReport {
    pub(crate) fn add(&mut self, other: GcReport) {
        self.objects += other.objects;
        self.bytes += other.bytes;
    }
}

/// Objects seen unreferenced, and since when.
#[derive(Debug, Default)]
pub(crate) struct Unreferenced {
    since: HashMap<String, Instant>,
}

impl Unreferenced {
    /// Of `candidates` (unreferenced now), those unreferenced for at least `grace`; the
    /// others are remembered. Keys no longer among the candidates are forgotten.
    pub(crate) fn due<'a>(
        &mut self,
        scope: &str,
        candidates: impl IntoIterator<Item = &'a str>,
        grace: Duration,
    ) -> Vec<String> {
        let now = Instant::now();
        let candidates: HashSet<&str> = candidates.into_iter().collect();
        self.since
            .retain(|k, _| !k.starts_with(scope) || candidates.contains(k.as_str()));
        let mut due = Vec::new();
        for c in candidates {
            let since = *self.since.entry(c.to_owned()).or_insert(now);
            if now.duration_since(since) >= grace {
                due.push(c.to_owned());
            }
        }
        due
    }

    /// Forgets a deleted object.
    pub(crate) fn forget(&mut self, key: &str) {
        self.since.remove(key);
    }
}

/// The wall-clock time `grace` ago, in the type object listings carry.
pub(crate) fn cutoff(grace: Duration) -> chrono::DateTime<chrono::Utc> {
    let grace = chrono::Duration::from_std(grace).unwrap_or(chrono::Duration::MAX);
    chrono::Utc::now()
        .checked_sub_signed(grace)
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC)
}
