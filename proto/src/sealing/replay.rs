//! Replay protection for sealed requests.

use super::error::SealError;
use super::KEY_LEN;
use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

/// Remembers the encapsulated keys of sealed requests for a retention
/// window and rejects a second request with the same one.
///
/// Memory is bounded by `capacity` entries. Entries older than the window
/// are evicted (oldest first). When the guard is full of entries still
/// inside their window, a new request is **refused**
/// ([`SealError::ReplayCacheFull`], answer 503 and retry) rather than
/// forgetting an entry: the guard never silently stops detecting a replay
/// inside the window. Size `capacity` for the peak request rate times the
/// window. A request replayed after the window has passed is not detected.
///
/// Check a request only after its first chunk authenticates, so that
/// garbage encapsulated keys cannot fill the guard.
#[derive(Debug)]
pub struct ReplayGuard {
    window: Duration,
    capacity: usize,
    seen: HashSet<[u8; KEY_LEN]>,
    order: VecDeque<(Instant, [u8; KEY_LEN])>,
}

impl ReplayGuard {
    /// A guard remembering keys for `window`, holding at most `capacity`.
    pub fn new(window: Duration, capacity: usize) -> Self {
        Self {
            window,
            capacity,
            seen: HashSet::new(),
            order: VecDeque::new(),
        }
    }

    /// Whether `enc` was seen within the window (recording nothing), for a
    /// caller that keeps several partitions and must catch a replay in any.
    pub fn contains(&mut self, enc: &[u8; KEY_LEN], now: Instant) -> bool {
        self.evict(now);
        self.seen.contains(enc)
    }

    fn evict(&mut self, now: Instant) {
        while let Some((t, k)) = self.order.front() {
            if now.saturating_duration_since(*t) < self.window {
                break;
            }
            self.seen.remove(k);
            self.order.pop_front();
        }
    }

    /// Records `enc` as seen at `now`; [`SealError::Replay`] if it was seen
    /// within the window, [`SealError::ReplayCacheFull`] if there is no room.
    pub fn check_and_insert(&mut self, enc: &[u8; KEY_LEN], now: Instant) -> Result<(), SealError> {
        self.evict(now);
        if self.seen.contains(enc) {
            return Err(SealError::Replay);
        }
        if self.seen.len() >= self.capacity {
            return Err(SealError::ReplayCacheFull);
        }
        // Keep the queue ordered even if callers' clocks interleave: an entry
        // is never evicted earlier than its own window ends.
        let t = self.order.back().map_or(now, |(last, _)| now.max(*last));
        self.seen.insert(*enc);
        self.order.push_back((t, *enc));
        Ok(())
    }

    /// How long until the oldest remembered key leaves the window (when
    /// the guard is full: how long until there is room again).
    pub fn retry_after(&self, now: Instant) -> Duration {
        self.order.front().map_or(Duration::ZERO, |(t, _)| {
            self.window
                .saturating_sub(now.saturating_duration_since(*t))
        })
    }

    /// Number of remembered keys.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether no key is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}
