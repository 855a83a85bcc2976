//! Request ids that name one request each for as long as a pipeline lives.
//!
//! The host picks request ids, and an id the host gave two requests would
//! merge them (one context, one set of KV rows, one answer). The entry
//! stage takes ids from its host channel only in increasing order, but it
//! admits requests concurrently (a long template render or tokenization
//! does not hold back a short request behind it), so requests begin at
//! the compute threads in the order their admissions finish, not in id
//! order. [`IdWindow`] accepts an id at most once in that order: every id
//! begun is remembered until [`IdWindow::CAPACITY`] newer ones have begun;
//! then the lowest is forgotten and every id at or below it is refused.
//!
//! Every stage of a pipeline sees the same requests begin in the same
//! order (each passes them on as it begins them), and a refused id leaves
//! the window as it was, so a later stage accepts exactly what the entry
//! stage accepted. An id refused for being below the window's floor is an
//! admission that took as long as [`IdWindow::CAPACITY`] others: far past
//! what the bounded admission work allows.

use std::collections::BTreeSet;

/// The ids begun in one configuration, as far back as the window reaches.
#[derive(Debug, Default)]
pub struct IdWindow {
    /// Every id at or below this one is refused.
    floor: Option<u64>,
    /// The ids begun above the floor.
    begun: BTreeSet<u64>,
}

impl IdWindow {
    /// How many begun ids are remembered (a few hundred KiB at most).
    pub const CAPACITY: usize = 16_384;

    /// An empty window: every id may begin once.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `id` may begin: it never began in this window and is above
    /// its floor. Changes nothing.
    pub fn check(&self, id: u64) -> Result<(), String> {
        if let Some(floor) = self.floor.filter(|&f| id <= f) {
            return Err(format!(
                "request id {id} is at or below the oldest id still remembered ({floor}); refused"
            ));
        }
        if self.begun.contains(&id) {
            return Err(format!("request id {id} was used before; refused"));
        }
        Ok(())
    }

    /// Records `id` as begun ([`Self::check`] first); past
    /// [`Self::CAPACITY`], the lowest id remembered becomes the floor.
    pub fn begin(&mut self, id: u64) -> Result<(), String> {
        self.check(id)?;
        self.begun.insert(id);
        if self.begun.len() > Self::CAPACITY {
            self.floor = self.begun.pop_first();
        }
        Ok(())
    }

    /// Forgets every id (a new configuration: a new pipeline).
    pub fn clear(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_begin_once_in_any_order() {
        let mut w = IdWindow::new();
        for id in [5, 3, 9, 4] {
            w.begin(id).unwrap();
        }
        for id in [5, 3, 9, 4] {
            assert!(w.begin(id).is_err(), "{id} began twice");
        }
        assert!(w.check(6).is_ok());
        w.clear();
        assert!(w.begin(5).is_ok());
    }

    #[test]
    fn past_capacity_the_lowest_becomes_the_floor() {
        let mut w = IdWindow::new();
        // 0 is admitted slowly: every other id begins first.
        for id in 1..=IdWindow::CAPACITY as u64 + 1 {
            w.begin(id).unwrap();
        }
        assert_eq!(w.begun.len(), IdWindow::CAPACITY);
        // 1 was forgotten but is still refused, as is everything below it.
        assert!(w.begin(1).is_err());
        assert!(w.begin(0).is_err());
        assert!(w.begin(2).is_err(), "2 is remembered");
        w.begin(IdWindow::CAPACITY as u64 + 2).unwrap();
        assert!(w.begin(2).is_err(), "2 is now the floor");
    }

    #[test]
    fn a_refused_id_leaves_the_window_as_it_was() {
        let mut a = IdWindow::new();
        let mut b = IdWindow::new();
        for id in [10, 12, 11] {
            a.begin(id).unwrap();
            b.begin(id).unwrap();
        }
        assert!(a.begin(12).is_err());
        assert_eq!(a.begun, b.begun);
        assert_eq!(a.floor, b.floor);
    }
}
