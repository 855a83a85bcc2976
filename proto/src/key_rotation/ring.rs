//! [`KeyRing`]: the HPKE keys one holder accepts, current first, each
//! retiring on schedule once replaced; the one rotation logic that the
//! entry stage's keys and the gateway's own key both wrap.

use super::KeySet;
use crate::sealing::{KeyConfig, ServerKey};
use std::ops::RangeInclusive;
use std::time::{Duration, Instant};

/// How a ring picks the id of a new key among its free ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdChoice {
    /// At random (the entry stage: a restarted stage's old key id is
    /// unlikely to come back, so a client holding it is told to refetch).
    Random,
    /// The next free id after the current one, wrapping (the gateway).
    Next,
}

/// When a replaced key stops being accepted: on this process's monotonic
/// clock, and as published (Unix seconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retirement {
    /// The instant it is refused from.
    pub at: Instant,
    /// The same moment in Unix seconds, for the published key set.
    pub unix: u64,
}

/// A key and, once replaced, its retirement.
struct Held {
    key: ServerKey,
    retires: Option<Retirement>,
}

/// The keys a holder accepts: the current one first, then replaced ones
/// until they retire. Ids come from one range, and no two held keys share
/// an id. Time is passed in, so the ring itself is plain data.
pub struct KeyRing {
    ids: RangeInclusive<u8>,
    choice: IdChoice,
    held: Vec<Held>,
}

impl KeyRing {
    /// A ring with one fresh key: a random id of `ids` ([`IdChoice::Random`])
    /// or its first ([`IdChoice::Next`]).
    pub fn generate(ids: RangeInclusive<u8>, choice: IdChoice) -> Self {
        let mut ring = Self {
            ids,
            choice,
            held: Vec::new(),
        };
        let id = ring.free_id().unwrap_or(*ring.ids.start());
        ring.held.push(Held {
            key: ServerKey::generate(id),
            retires: None,
        });
        ring
    }

    /// A ring holding `first` (tests derive it from a seed).
    pub fn with_key(first: ServerKey, ids: RangeInclusive<u8>, choice: IdChoice) -> Self {
        Self {
            ids,
            choice,
            held: vec![Held {
                key: first,
                retires: None,
            }],
        }
    }

    /// The current key.
    pub fn current(&self) -> &ServerKey {
        &self.held[0].key
    }

    /// The key with `key_id`, if it is accepted at `now`.
    pub fn get(&self, key_id: u8, now: Instant) -> Option<ServerKey> {
        self.held
            .iter()
            .find(|h| h.key.key_id() == key_id && accepted(h, now))
            .map(|h| h.key.clone())
    }

    /// The configurations of the keys accepted at `now`, current first.
    pub fn configs(&self, now: Instant) -> Vec<KeyConfig> {
        self.held
            .iter()
            .filter(|h| accepted(h, now))
            .map(|h| h.key.config())
            .collect()
    }

    /// The ids of every held key, current first.
    pub fn held_ids(&self) -> Vec<u8> {
        self.held.iter().map(|h| h.key.key_id()).collect()
    }

    /// Makes a new current key and schedules the retirement of the one it
    /// replaces at `retire` (keys already retired by `now` are dropped
    /// first). Returns the new key's id, or `None` when every id of the
    /// range is held (overlaps longer than the rotation period): then
    /// nothing changes until a key retires.
    pub fn rotate(&mut self, now: Instant, retire: Retirement) -> Option<u8> {
        self.retire_due(now);
        let id = self.free_id()?;
        for h in self.held.iter_mut().filter(|h| h.retires.is_none()) {
            h.retires = Some(retire);
        }
        self.held.insert(
            0,
            Held {
                key: ServerKey::generate(id),
                retires: None,
            },
        );
        Some(id)
    }

    /// From now on draws ids from `ids` only: keys outside it are dropped,
    /// and if no key left is current a new one is made at once. Returns
    /// whether the held keys changed, and the new key's id if one was made.
    pub fn confine(&mut self, ids: RangeInclusive<u8>) -> (bool, Option<u8>) {
        self.ids = ids;
        let before = self.held.len();
        let range = self.ids.clone();
        self.held.retain(|h| range.contains(&h.key.key_id()));
        if self.held.iter().all(|h| h.retires.is_some()) {
            let id = self.free_id().unwrap_or(*self.ids.start());
            self.held.retain(|h| h.key.key_id() != id);
            self.held.insert(
                0,
                Held {
                    key: ServerKey::generate(id),
                    retires: None,
                },
            );
            return (true, Some(id));
        }
        (self.held.len() != before, None)
    }

    /// Drops the keys retired by `now`; whether any went.
    pub fn retire_due(&mut self, now: Instant) -> bool {
        let before = self.held.len();
        self.held.retain(|h| accepted(h, now));
        self.held.len() != before
    }

    /// The earliest scheduled retirement.
    pub fn next_retirement(&self) -> Option<Instant> {
        self.held
            .iter()
            .filter_map(|h| h.retires.map(|r| r.at))
            .min()
    }

    /// The held keys as a key set issued at `issued_at` (Unix seconds), to
    /// be signed and published.
    pub fn key_set(&self, issued_at: u64) -> KeySet {
        KeySet {
            issued_at,
            keys: self
                .held
                .iter()
                .map(|h| (h.key.config(), h.retires.map(|r| r.unix)))
                .collect(),
        }
    }

    /// An id of the range that no held key has, as [`IdChoice`] says.
    fn free_id(&self) -> Option<u8> {
        let free = |id: &u8| self.held.iter().all(|h| h.key.key_id() != *id);
        match self.choice {
            IdChoice::Random => {
                use rand::seq::IteratorRandom;
                self.ids.clone().filter(free).choose(&mut rand::rngs::OsRng)
            }
            IdChoice::Next => {
                // After the current key's id, wrapping; an empty ring starts
                // at the range's first id.
                let from = self
                    .held
                    .first()
                    .map_or(*self.ids.end(), |h| h.key.key_id());
                let after = self.ids.clone().filter(|id| *id > from);
                let before = self.ids.clone().filter(|id| *id <= from);
                after.chain(before).find(free)
            }
        }
    }
}

/// A retirement `overlap` after `now` (Unix time `unix_now`).
pub fn retirement(now: Instant, overlap: Duration, unix_now: u64) -> Retirement {
    Retirement {
        at: now + overlap,
        unix: unix_now + overlap.as_secs_f64().ceil() as u64,
    }
}

fn accepted(h: &Held, now: Instant) -> bool {
    h.retires.is_none_or(|r| r.at > now)
}

#[cfg(test)]
mod tests {
    use super::{retirement, IdChoice, KeyRing};
    use crate::sealing::ServerKey;
    use std::time::{Duration, Instant};

    #[test]
    fn a_replaced_key_is_accepted_until_it_retires() {
        let mut ring = KeyRing::with_key(ServerKey::derive(5, b"k"), 1..=127, IdChoice::Random);
        let now = Instant::now();
        let id = ring
            .rotate(now, retirement(now, Duration::from_secs(60), 1_000))
            .unwrap();
        assert_ne!(id, 5);
        assert_eq!(ring.current().key_id(), id);
        assert!(ring.get(5, now).is_some() && ring.get(id, now).is_some());
        let set = ring.key_set(7);
        assert_eq!(set.keys[1].1, Some(1_060), "the retirement is published");
        let later = now + Duration::from_secs(61);
        assert!(ring.get(5, later).is_none());
        assert_eq!(ring.configs(later).len(), 1);
        assert_eq!(ring.next_retirement().map(|t| t > now), Some(true));
        assert!(ring.retire_due(later));
        assert_eq!(ring.held_ids(), [id]);
    }

    #[test]
    fn next_ids_wrap_and_a_full_range_skips_the_rotation() {
        let mut ring = KeyRing::generate(0xfd..=0xff, IdChoice::Next);
        assert_eq!(ring.current().key_id(), 0xfd, "the range's first id");
        let now = Instant::now();
        let long = retirement(now, Duration::from_secs(3600), 0);
        assert_eq!(ring.rotate(now, long), Some(0xfe));
        assert_eq!(ring.rotate(now, long), Some(0xff));
        assert_eq!(ring.rotate(now, long), None, "every id held");
        assert_eq!(ring.held_ids(), [0xff, 0xfe, 0xfd]);
        // Once one retires, its id comes round again.
        let soon = retirement(now, Duration::ZERO, 0);
        let mut ring = KeyRing::generate(0xfe..=0xff, IdChoice::Next);
        ring.rotate(now, soon);
        assert_eq!(
            ring.rotate(now + Duration::from_millis(1), soon),
            Some(0xfe)
        );
    }

    #[test]
    fn confining_replaces_a_key_outside_the_range() {
        let mut ring = KeyRing::with_key(ServerKey::derive(5, b"k"), 1..=127, IdChoice::Random);
        assert_eq!(ring.confine(5..=20), (false, None));
        let (changed, id) = ring.confine(40..=43);
        assert!(changed);
        let id = id.unwrap();
        assert!((40..=43).contains(&id));
        assert_eq!(ring.held_ids(), [id]);
    }
}
