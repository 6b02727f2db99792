//! Admission of request bodies: one byte budget ([`DbConfig::ingest_inflight_bytes`]) for
//! every body read at once (ingest, stream appends, JSON requests) and for what decoding them
//! holds (decompressed bytes, an `INSERT`'s rows).
//!
//! Invariants:
//! - A body reserves what it holds, as it comes: a [`BodyReservation`] grows with the bytes
//!   that arrived (and the buffer they sit in), never by what a body might send. A client
//!   that sends slowly holds only what it sent; one that declares much and sends little
//!   holds little.
//! - Waiting is bounded: all the waits of one reservation together last at most
//!   [`BodyBudget::wait`] (`ingest_admission_timeout_seconds`); past it the request is refused
//!   ([`AdmissionTimeout`]: 503 with `Retry-After`, nothing applied).
//! - One reservation holds at most its share: the whole budget, or, where requests name an
//!   owner (a key), half of it per owner, so one key cannot take the whole budget while
//!   other keys wait. A request that would need more than its share is counted at its share
//!   (so none waits for ever; the body limits bound what it really holds).
//! - Owners are the configured keys' names, never client input, so the per-owner map is as
//!   small as the configuration.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::DbConfig;
use crate::ingest::AdmissionTimeout;

/// Budget permits count KiB, so a `u32` covers any growth.
const UNIT: usize = 1024;

/// The byte budget of request bodies.
#[derive(Debug)]
pub(crate) struct BodyBudget {
    global: Arc<Semaphore>,
    /// The global budget, in units.
    units: usize,
    /// What one owner may hold, in units.
    owner_units: usize,
    owners: Mutex<HashMap<Arc<str>, Arc<Semaphore>>>,
    /// The longest one reservation waits in all.
    wait: Duration,
}

impl BodyBudget {
    pub(crate) fn new(config: &DbConfig) -> Self {
        let units = config
            .ingest_inflight_bytes
            .div_ceil(UNIT)
            .clamp(1, Semaphore::MAX_PERMITS);
        BodyBudget {
            global: Arc::new(Semaphore::new(units)),
            units,
            owner_units: (units / 2).max(1),
            owners: Mutex::new(HashMap::new()),
            wait: config.ingest_admission_timeout,
        }
    }

    /// A reservation holding nothing yet; `owner` (a key's name) puts it under that owner's
    /// share as well.
    pub(crate) fn reservation(&self, owner: Option<&Arc<str>>) -> BodyReservation {
        let owner = owner.map(|name| {
            let mut owners = self.owners.lock().unwrap_or_else(|e| e.into_inner());
            owners
                .entry(name.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(self.owner_units)))
                .clone()
        });
        let cap_units = if owner.is_some() {
            self.owner_units
        } else {
            self.units
        };
        BodyReservation {
            global: self.global.clone(),
            owner,
            held: None,
            owner_held: None,
            units: 0,
            cap_units,
            waited: Duration::ZERO,
            wait: self.wait,
            budget: self.units.saturating_mul(UNIT),
        }
    }

    /// Bytes of the budget held now (metrics, tests).
    pub(crate) fn held_bytes(&self) -> usize {
        self.units
            .saturating_sub(self.global.available_permits())
            .saturating_mul(UNIT)
    }
}

/// What one request holds of the [`BodyBudget`]; given back when dropped.
#[derive(Debug)]
pub(crate) struct BodyReservation {
    global: Arc<Semaphore>,
    owner: Option<Arc<Semaphore>>,
    held: Option<OwnedSemaphorePermit>,
    owner_held: Option<OwnedSemaphorePermit>,
    /// Units held.
    units: usize,
    /// The most units it may hold.
    cap_units: usize,
    /// How long its grows waited so far, and may wait in all.
    waited: Duration,
    wait: Duration,
    budget: usize,
}

impl BodyReservation {
    /// Grows the reservation to cover `bytes` (never shrinks it), waiting for room within
    /// what is left of the request's wait. Past its share, it stays at its share.
    pub(crate) async fn grow_to(&mut self, bytes: usize) -> Result<(), AdmissionTimeout> {
        let want = bytes.div_ceil(UNIT).min(self.cap_units);
        if want <= self.units {
            return Ok(());
        }
        let more = u32::try_from(want - self.units).unwrap_or(u32::MAX);
        let started = tokio::time::Instant::now();
        let left = self.wait.saturating_sub(self.waited);
        let acquired = tokio::time::timeout(left, async {
            let owner = match &self.owner {
                Some(owner) => Some(owner.clone().acquire_many_owned(more).await.ok()?),
                None => None,
            };
            let global = self.global.clone().acquire_many_owned(more).await.ok()?;
            Some((owner, global))
        })
        .await;
        self.waited = self.waited.saturating_add(started.elapsed());
        let Ok(Some((owner, global))) = acquired else {
            // Timed out (or a closed semaphore, which none is): what it held stays held
            // until the request lets go.
            return Err(AdmissionTimeout {
                waited: self.waited,
                budget: self.budget,
            });
        };
        merge(&mut self.held, global);
        if let Some(owner) = owner {
            merge(&mut self.owner_held, owner);
        }
        self.units += usize::try_from(more).unwrap_or(usize::MAX);
        Ok(())
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.units.saturating_mul(UNIT)
    }

    /// Gives back everything held (a body refused and being drained holds nothing).
    pub(crate) fn release(&mut self) {
        self.held = None;
        self.owner_held = None;
        self.units = 0;
    }
}

fn merge(held: &mut Option<OwnedSemaphorePermit>, more: OwnedSemaphorePermit) {
    match held {
        Some(permit) => permit.merge(more),
        None => *held = Some(more),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(bytes: usize, wait_ms: u64) -> BodyBudget {
        let mut config = DbConfig::new("unused");
        config.ingest_inflight_bytes = bytes;
        config.ingest_admission_timeout = Duration::from_millis(wait_ms);
        BodyBudget::new(&config)
    }

    /// A reservation grows with what it covers, gives it back when dropped, and never holds
    /// past its share.
    #[tokio::test]
    async fn reservations_grow_and_release() {
        let budget = budget(64 * UNIT, 50);
        let mut a = budget.reservation(None);
        assert_eq!(budget.held_bytes(), 0);
        a.grow_to(1).await.expect("room");
        assert_eq!(a.bytes(), UNIT);
        a.grow_to(10 * UNIT).await.expect("room");
        a.grow_to(5 * UNIT).await.expect("never shrinks");
        assert_eq!(budget.held_bytes(), 10 * UNIT);
        // More than the whole budget: counted at the whole budget.
        let mut b = budget.reservation(None);
        drop(a);
        b.grow_to(1 << 30).await.expect("the whole budget");
        assert_eq!(b.bytes(), 64 * UNIT);
        drop(b);
        assert_eq!(budget.held_bytes(), 0);
    }

    /// A full budget refuses within the wait, and a refused reservation keeps what it held
    /// until dropped.
    #[tokio::test]
    async fn a_full_budget_refuses_within_the_wait() {
        let budget = budget(8 * UNIT, 100);
        let mut hog = budget.reservation(None);
        hog.grow_to(8 * UNIT).await.expect("room");
        let mut other = budget.reservation(None);
        let started = std::time::Instant::now();
        let refused = other.grow_to(UNIT).await.expect_err("no room");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(refused.waited >= Duration::from_millis(100));
        // The wait is for the request in all: a second try does not wait again.
        let started = std::time::Instant::now();
        other.grow_to(UNIT).await.expect_err("no room");
        assert!(started.elapsed() < Duration::from_millis(50));
        drop(hog);
        let mut third = budget.reservation(None);
        third
            .grow_to(8 * UNIT)
            .await
            .expect("room once the hog let go");
    }

    /// One owner holds at most half the budget: another owner still gets in.
    #[tokio::test]
    async fn one_owner_cannot_take_the_whole_budget() {
        let budget = budget(8 * UNIT, 50);
        let a: Arc<str> = Arc::from("key-0");
        let b: Arc<str> = Arc::from("key-1");
        let mut first = budget.reservation(Some(&a));
        first.grow_to(8 * UNIT).await.expect("its share");
        assert_eq!(first.bytes(), 4 * UNIT);
        let mut second = budget.reservation(Some(&a));
        second
            .grow_to(UNIT)
            .await
            .expect_err("the owner's share is taken");
        let mut other = budget.reservation(Some(&b));
        other
            .grow_to(4 * UNIT)
            .await
            .expect("another owner's share");
    }
}
