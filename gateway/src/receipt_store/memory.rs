//! Receipts in this process's memory (`[receipts] store = "memory"`): the
//! newest `capacity` receipts are kept; older ones are dropped first.

use super::Stored;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Receipts by id, and their ids oldest first.
type Kept = (HashMap<[u8; 16], Stored>, VecDeque<[u8; 16]>);

/// The in-memory store.
pub struct MemoryStore {
    capacity: usize,
    inner: Mutex<Kept>,
}

impl MemoryStore {
    /// A store keeping at most `capacity` receipts (0 keeps none).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            inner: Mutex::new((HashMap::new(), VecDeque::new())),
        }
    }

    /// Keeps a receipt (and the salt of its digests, if known, and its owner).
    pub fn insert(&self, id: [u8; 16], receipt: Stored) {
        if self.capacity == 0 {
            return;
        }
        let mut g = self.inner.lock().unwrap();
        let (map, order) = &mut *g;
        if map.insert(id, receipt).is_none() {
            order.push_back(id);
        }
        while order.len() > self.capacity {
            if let Some(old) = order.pop_front() {
                map.remove(&old);
            }
        }
    }

    /// A kept receipt.
    pub fn get(&self, id: &[u8; 16]) -> Option<Stored> {
        self.inner.lock().unwrap().0.get(id).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::receipt::ReceiptTrailer;

    #[test]
    fn keeps_the_newest() {
        let kept = |b: u8| Stored {
            trailer: ReceiptTrailer {
                receipt: vec![b],
                digest_salt: None,
            },
            owner: Some("team-a".into()),
        };
        let s = MemoryStore::new(2);
        s.insert([1; 16], kept(1));
        s.insert([2; 16], kept(2));
        s.insert([3; 16], kept(3));
        assert_eq!(s.get(&[1; 16]), None);
        assert_eq!(s.get(&[3; 16]), Some(kept(3)));
        assert_eq!(MemoryStore::new(0).get(&[1; 16]), None);
    }
}
