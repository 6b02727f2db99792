//! Answers held in memory until their connection has written them.
//!
//! An answer rendered into memory stays there until the client has read it; a client that
//! reads slowly (or not at all, until the write timeout) keeps it. An [`AnswerBudget`] bounds
//! what such answers hold across every connection: an answer takes its share before it is
//! rendered and carries it in its body ([`held`]), so the share comes back when the body is
//! dropped (written out, or the connection gone), not when the handler returns. Shares are
//! counted in KiB (a semaphore's permits).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A budget of bytes for answers held until written.
#[derive(Debug, Clone)]
pub(super) struct AnswerBudget {
    kib: Arc<Semaphore>,
    capacity_kib: u32,
}

/// A share of an [`AnswerBudget`], given back when dropped.
pub(super) type Share = OwnedSemaphorePermit;

fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

impl AnswerBudget {
    /// A budget of `bytes`.
    pub(super) fn new(bytes: usize) -> Self {
        let capacity_kib =
            kib(bytes).clamp(1, u32::try_from(Semaphore::MAX_PERMITS).unwrap_or(u32::MAX));
        AnswerBudget {
            kib: Arc::new(Semaphore::new(capacity_kib as usize)),
            capacity_kib,
        }
    }

    /// Waits for a share of `bytes` (at most the whole budget, so that any answer can go);
    /// `None` only if the budget were closed, which it never is.
    pub(super) async fn hold(&self, bytes: usize) -> Option<Share> {
        let need = kib(bytes).min(self.capacity_kib);
        Arc::clone(&self.kib).acquire_many_owned(need).await.ok()
    }

    /// A share of as much of `want` bytes as is free now, and at least `floor` (waited for,
    /// at most `wait`: `None` past it), with the bytes it covers.
    pub(super) async fn grant(
        &self,
        want: usize,
        floor: usize,
        wait: Duration,
    ) -> Option<(Share, usize)> {
        let floor_kib = kib(floor).min(self.capacity_kib);
        let free = u32::try_from(self.kib.available_permits()).unwrap_or(u32::MAX);
        let take = kib(want).min(free).min(self.capacity_kib);
        if take >= floor_kib
            && let Ok(share) = Arc::clone(&self.kib).try_acquire_many_owned(take)
        {
            return Some((share, take as usize * 1024));
        }
        let share = tokio::time::timeout(wait, Arc::clone(&self.kib).acquire_many_owned(floor_kib))
            .await
            .ok()?
            .ok()?;
        Some((share, floor_kib as usize * 1024))
    }

    /// Waits for a share of `bytes` (at most the whole budget), at most `wait`: `None` past
    /// it.
    pub(super) async fn hold_within(&self, bytes: usize, wait: Duration) -> Option<Share> {
        tokio::time::timeout(wait, self.hold(bytes)).await.ok()?
    }

    /// Gives back what `share` holds beyond `bytes`.
    pub(super) fn fit(share: &mut Share, bytes: usize) {
        let keep = kib(bytes).max(1) as usize;
        if share.num_permits() > keep {
            drop(share.split(share.num_permits() - keep));
        }
    }

    /// Bytes free now.
    #[cfg(test)]
    pub(super) fn free_bytes(&self) -> usize {
        self.kib.available_permits() * 1024
    }
}

/// `body` with `share`, given back when the bytes are dropped.
pub(super) fn held(body: Vec<u8>, share: Share) -> Bytes {
    Bytes::from_owner(Held {
        body,
        _share: share,
    })
}

struct Held {
    body: Vec<u8>,
    _share: Share,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.body
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn grants_take_what_is_free_down_to_the_floor_and_come_back_when_dropped() {
        let budget = AnswerBudget::new(1 << 20);
        let wait = Duration::from_millis(50);
        let (first, bytes) = budget.grant(600 << 10, 64 << 10, wait).await.unwrap();
        assert_eq!(bytes, 600 << 10);
        // What is left, less than asked.
        let (second, bytes) = budget.grant(600 << 10, 64 << 10, wait).await.unwrap();
        assert_eq!(bytes, 424 << 10);
        // Nothing left: waits for the floor, then gives up.
        assert!(budget.grant(600 << 10, 64 << 10, wait).await.is_none());
        drop(second);
        let (mut third, bytes) = budget.grant(600 << 10, 64 << 10, wait).await.unwrap();
        assert_eq!(bytes, 424 << 10);
        assert!(budget.hold_within(1, wait).await.is_none());
        let body = held(vec![1; 10], first);
        assert_eq!(&body[..], &[1; 10]);
        // The body holds the first share until it is dropped.
        assert!(budget.hold_within(100 << 10, wait).await.is_none());
        drop(body);
        let fourth = budget.hold_within(100 << 10, wait).await.unwrap();
        assert_eq!(fourth.num_permits(), 100);
        // A share fitted to a smaller body gives the rest back.
        AnswerBudget::fit(&mut third, 10 << 10);
        assert_eq!(third.num_permits(), 10);
        assert_eq!(budget.free_bytes(), (1 << 20) - (110 << 10));
        drop((third, fourth));
        assert_eq!(budget.free_bytes(), 1 << 20);
        // An answer larger than the whole budget waits for all of it, not forever.
        let all = budget.hold(10 << 20).await.unwrap();
        assert_eq!(budget.free_bytes(), 0);
        drop(all);
    }
}
