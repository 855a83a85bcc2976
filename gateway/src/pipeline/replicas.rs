//! A model served by several replicas of its pipeline (`replicas = N`):
//! each replica is a whole chain of stages, attested and connected on its
//! own ([`Pipeline`]); a replica whose evidence fails the policy or whose
//! stage died is simply not ready, and is used again once it has been
//! re-attested. Requests go to the least-loaded ready replica; a request
//! sealed by the client goes to the replica whose entry stage holds its key
//! (each replica's entry stage draws its key ids from its own range, so a
//! key id names one replica).

use super::Pipeline;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The replicas of one model's pipeline, replica 0 first.
pub struct Replicas {
    members: Vec<Arc<Pipeline>>,
    /// Rotates the order among equally loaded replicas.
    turn: AtomicUsize,
}

/// The HPKE key ids replica `index` of `count` draws from: 1-127 cut into
/// `count` equal ranges (at most [`MAX_REPLICAS`] replicas, so that each
/// range has room for rotated keys).
pub fn key_ids(index: usize, count: usize) -> std::ops::RangeInclusive<u8> {
    let size = 127 / count.clamp(1, MAX_REPLICAS);
    let lo = 1 + index * size;
    lo as u8..=(lo + size - 1) as u8
}

/// Most replicas of one pipeline (each needs 4 key ids of the 127).
pub const MAX_REPLICAS: usize = 31;

impl Replicas {
    /// The replicas, replica 0 first (each with its `replica` index set).
    pub fn new(members: Vec<Arc<Pipeline>>) -> Arc<Self> {
        assert!(!members.is_empty(), "a model needs at least one replica");
        Arc::new(Self {
            members,
            turn: AtomicUsize::new(0),
        })
    }

    /// Replica 0: every replica serves the same model (id, manifest,
    /// endpoints), so this one speaks for them.
    pub fn primary(&self) -> &Arc<Pipeline> {
        &self.members[0]
    }

    /// Every replica, ready or not.
    pub fn members(&self) -> &[Arc<Pipeline>] {
        &self.members
    }

    /// The model id.
    pub fn model_id(&self) -> &str {
        &self.primary().model_id
    }

    /// The ready replicas, least loaded first: by the requests this
    /// gateway has in flight at each (what the entry stage queues, and
    /// what holds KV-cache room in a generation pipeline); equal loads take
    /// turns.
    pub fn by_load(&self) -> Vec<&Arc<Pipeline>> {
        let n = self.members.len();
        let start = self.turn.fetch_add(1, Ordering::Relaxed);
        let mut ready: Vec<(usize, usize, &Arc<Pipeline>)> = (0..n)
            .map(|k| (start + k) % n)
            .map(|i| &self.members[i])
            .filter(|p| p.epoch().is_some())
            .enumerate()
            .map(|(order, p)| (p.in_flight(), order, p))
            .collect();
        ready.sort_by_key(|(load, order, _)| (*load, *order));
        ready.into_iter().map(|(_, _, p)| p).collect()
    }

    /// The ready replica whose entry stage accepts `key_id` with `aead`.
    pub fn holding(&self, key_id: u8, aead: proto::sealing::Aead) -> Option<&Arc<Pipeline>> {
        self.members.iter().find(|p| p.accepts(key_id, aead))
    }

    /// `Ok` while some replica is connected and verified, else why none is.
    pub fn ready(&self) -> Result<(), String> {
        if self.members.iter().any(|p| p.epoch().is_some()) {
            Ok(())
        } else {
            Err(self.not_ready_reason())
        }
    }

    /// Why no replica serves (each replica's reason).
    pub fn not_ready_reason(&self) -> String {
        let reasons: Vec<String> = self
            .members
            .iter()
            .filter_map(|p| p.status().err())
            .collect();
        if self.members.len() == 1 {
            reasons.into_iter().next().unwrap_or_default()
        } else {
            let all: Vec<String> = reasons
                .iter()
                .enumerate()
                .map(|(i, r)| format!("replica {i}: {r}"))
                .collect();
            format!("no replica is ready ({})", all.join("; "))
        }
    }

    /// Readiness (any replica) and connection counters (summed) for
    /// `/metrics`.
    pub fn health(&self) -> crate::metrics::PipelineHealth {
        let mut h = self.primary().health();
        for p in &self.members[1..] {
            let more = p.health();
            h.ready |= more.ready;
            h.reconnects += more.reconnects;
            h.attestation_failures += more.attestation_failures;
        }
        h
    }

    /// A ready replica by index, or the least loaded when `None`.
    pub fn ready_member(&self, index: Option<usize>) -> Result<&Arc<Pipeline>, String> {
        match index {
            Some(i) => {
                let p = self
                    .members
                    .get(i)
                    .ok_or_else(|| format!("there is no replica {i}"))?;
                p.status()
                    .map(|_| p)
                    .map_err(|r| format!("replica {i}: {r}"))
            }
            None => self
                .by_load()
                .into_iter()
                .next()
                .ok_or_else(|| self.not_ready_reason()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_id_ranges_are_disjoint_and_wide_enough() {
        assert_eq!(key_ids(0, 1), 1..=127);
        for count in 1..=MAX_REPLICAS {
            let ranges: Vec<_> = (0..count).map(|i| key_ids(i, count)).collect();
            for (i, r) in ranges.iter().enumerate() {
                assert!(r.end() - r.start() >= 3, "{count}: {r:?}");
                assert!(*r.start() >= 1 && *r.end() <= 127);
                if i > 0 {
                    assert!(ranges[i - 1].end() < r.start(), "{count}: overlap");
                }
            }
        }
    }
}
