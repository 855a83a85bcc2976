//! Admissions in progress at the entry stage. The host channel's loop only
//! reads messages; each request's admission (opening, template render,
//! tokenization, grammar compile) runs as a task of its own, so one
//! client's long prompt does not delay another's short one. Bounds: at
//! most [`MAX_QUEUED`] requests between the host channel and the compute
//! thread (past it the host channel waits: backpressure on the host), and
//! at most one admission doing its CPU work per core.
//!
//! A request cancelled while it is being admitted never reaches the compute
//! thread: the host's `Cancel` and the admission's hand-over to the compute
//! thread take one lock, so a cancellation is either seen by the admission
//! or sent to the compute thread after the request's work.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, SemaphorePermit};

/// Most requests taken off the host channel and not yet handed to the
/// compute thread.
pub(super) const MAX_QUEUED: usize = 256;

/// The admissions in progress, by configuration epoch and request id:
/// whether the host cancelled each meanwhile.
type Open = Arc<Mutex<HashMap<(u64, u64), bool>>>;

/// The entry stage's admissions in progress and their bounds.
pub(super) struct Admissions {
    queued: Arc<Semaphore>,
    working: Semaphore,
    open: Open,
}

/// One request's place among the admissions in progress, from the moment
/// it was read off the host channel until it is handed on or dropped.
pub(super) struct Ticket {
    key: (u64, u64),
    open: Open,
    _queued: OwnedSemaphorePermit,
}

/// What became of an admitted request at the hand-over.
pub(super) enum HandOver<T> {
    /// Handed on: what the hand-over returned.
    Done(T),
    /// The host cancelled it during admission: nothing was handed on.
    Cancelled,
}

impl Admissions {
    /// Bounds for a stage with `cores` cores for admission work (at least 2).
    pub(super) fn new(cores: usize) -> Self {
        Self {
            queued: Arc::new(Semaphore::new(MAX_QUEUED)),
            working: Semaphore::new(cores.max(2)),
            open: Arc::default(),
        }
    }

    /// Waits for room for one more request (the host channel waits with
    /// it), then records request `id` of configuration `epoch` as being
    /// admitted.
    pub(super) async fn enter(&self, epoch: u64, id: u64) -> Ticket {
        let queued = self
            .queued
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        lock(&self.open).insert((epoch, id), false);
        Ticket {
            key: (epoch, id),
            open: self.open.clone(),
            _queued: queued,
        }
    }

    /// Waits for a core for an admission's CPU work.
    pub(super) async fn work(&self) -> SemaphorePermit<'_> {
        self.working
            .acquire()
            .await
            .expect("the semaphore is never closed")
    }

    /// The host cancels request `id`: marked, if it is still being
    /// admitted; else `send` (the cancellation to the compute thread) runs,
    /// under the same lock as every hand-over.
    pub(super) fn cancel(&self, epoch: u64, id: u64, send: impl FnOnce()) {
        let mut open = lock(&self.open);
        match open.get_mut(&(epoch, id)) {
            Some(cancelled) => *cancelled = true,
            None => send(),
        }
    }

    /// Requests being admitted now.
    #[cfg(test)]
    pub(super) fn in_progress(&self) -> usize {
        lock(&self.open).len()
    }
}

impl Ticket {
    /// Ends the admission: runs `hand_on` (the work to the compute thread)
    /// unless the host cancelled the request meanwhile.
    pub(super) fn hand_over<T>(self, hand_on: impl FnOnce() -> T) -> HandOver<T> {
        let mut open = lock(&self.open);
        match open.remove(&self.key) {
            Some(true) => HandOver::Cancelled,
            _ => HandOver::Done(hand_on()),
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // Refused, failed or handed over: no longer being admitted.
        lock(&self.open).remove(&self.key);
    }
}

fn lock(open: &Open) -> std::sync::MutexGuard<'_, HashMap<(u64, u64), bool>> {
    open.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_cancel_during_admission_stops_the_hand_over() {
        let a = Admissions::new(2);
        let t = a.enter(1, 7).await;
        let mut sent = false;
        a.cancel(1, 7, || sent = true);
        assert!(
            !sent,
            "the compute thread was told of a request it never saw"
        );
        assert!(matches!(t.hand_over(|| ()), HandOver::Cancelled));
        assert_eq!(a.in_progress(), 0);
    }

    #[tokio::test]
    async fn a_cancel_after_the_hand_over_goes_to_the_compute_thread() {
        let a = Admissions::new(2);
        let t = a.enter(1, 7).await;
        assert!(matches!(t.hand_over(|| 5), HandOver::Done(5)));
        let mut sent = false;
        a.cancel(1, 7, || sent = true);
        assert!(sent);
        // Another epoch's request of the same id is another request.
        let _t = a.enter(2, 7).await;
        let mut sent = false;
        a.cancel(1, 7, || sent = true);
        assert!(sent);
    }

    #[tokio::test]
    async fn a_dropped_ticket_leaves_and_gives_its_room_back() {
        let a = Admissions::new(2);
        let tickets: Vec<_> = enter_many(&a, MAX_QUEUED).await;
        assert_eq!(a.in_progress(), MAX_QUEUED);
        assert_eq!(a.queued.available_permits(), 0);
        drop(tickets);
        assert_eq!(a.in_progress(), 0);
        assert_eq!(a.queued.available_permits(), MAX_QUEUED);
    }

    async fn enter_many(a: &Admissions, n: usize) -> Vec<Ticket> {
        let mut v = Vec::new();
        for id in 0..n as u64 {
            v.push(a.enter(0, id).await);
        }
        v
    }
}
