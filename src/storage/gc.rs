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
///
/// An object's grace period runs only over passes that looked at it without a break: a pass
/// whose scope failed must call [`Unreferenced::forget_scope`], since what it did not look
/// at may have been referenced meanwhile.
#[derive(Debug, Default)]
pub(crate) struct Unreferenced {
    since: HashMap<String, Instant>,
}

impl Unreferenced {
    /// Of `candidates` (unreferenced now), those unreferenced for at least `grace`; the
    /// others are remembered. Keys of `scope` no longer among the candidates are forgotten.
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

    /// Forgets every object of `scope`: its pass failed, so their grace periods start again.
    pub(crate) fn forget_scope(&mut self, scope: &str) {
        self.since.retain(|k, _| !k.starts_with(scope));
    }
}

/// The wall-clock time `grace` ago, in the type object listings carry.
pub(crate) fn cutoff(grace: Duration) -> chrono::DateTime<chrono::Utc> {
    let grace = chrono::Duration::from_std(grace).unwrap_or(chrono::Duration::MAX);
    chrono::Utc::now()
        .checked_sub_signed(grace)
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grace_runs_over_unbroken_passes_only() {
        let mut u = Unreferenced::default();
        let zero = Duration::ZERO;
        let long = Duration::from_secs(3600);
        // First seen: not due under a long grace period, due under none.
        assert!(u.due("a/", ["a/1", "a/2"], long).is_empty());
        assert_eq!(u.due("a/", ["a/1"], zero), vec!["a/1".to_owned()]);
        // a/2 was referenced in that pass: forgotten, so its period starts again.
        assert!(!u.since.contains_key("a/2"));
        // Another scope's pass leaves a/ alone; a failed pass of a/ forgets it.
        assert!(u.due("b/", ["b/1"], long).is_empty());
        assert!(u.since.contains_key("a/1"));
        u.forget_scope("a/");
        assert!(!u.since.contains_key("a/1"));
        assert!(u.since.contains_key("b/1"));
    }
}
