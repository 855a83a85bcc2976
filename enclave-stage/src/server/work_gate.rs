//! The door to the compute thread, kept per configuration epoch: work
//! reaches the compute thread only from channels of the current epoch, so
//! nothing of a torn-down pipeline follows its `Work::Reset`; and the
//! queue the compute thread's answers leave by.

use crate::work::{Output, Work};
use std::sync::Mutex;
use tokio::sync::mpsc;

/// The compute thread's input, gated by epoch, and its output queue.
pub(super) struct WorkGate {
    /// Configuration epoch: bumped when the owner's host channel closes
    /// (the pipeline it served is gone).
    epoch: Mutex<u64>,
    work: std::sync::mpsc::Sender<Work>,
    out: mpsc::Sender<Output>,
}

impl WorkGate {
    /// A gate at epoch 0 in front of `work`, answering through `out`.
    pub(super) fn new(work: std::sync::mpsc::Sender<Work>, out: mpsc::Sender<Output>) -> Self {
        Self {
            epoch: Mutex::new(0),
            work,
            out,
        }
    }

    /// The current configuration epoch.
    pub(super) fn current(&self) -> u64 {
        *self.epoch.lock().unwrap()
    }

    /// Hands `works` to the compute thread if the stage is still in
    /// configuration `epoch`; `false` (nothing sent) if the pipeline they
    /// came from was torn down since. Checked and sent under one lock, so
    /// no work of an old epoch can follow its `Work::Reset`.
    pub(super) fn submit(&self, epoch: u64, works: impl IntoIterator<Item = Work>) -> bool {
        let current = self.epoch.lock().unwrap();
        if *current != epoch {
            return false;
        }
        for w in works {
            if self.work.send(w).is_err() {
                tracing::error!("compute thread is gone");
                return false;
            }
        }
        true
    }

    /// Starts a new epoch and tells the compute thread to drop every
    /// request of the old one.
    pub(super) fn reset(&self) {
        let mut epoch = self.epoch.lock().unwrap();
        *epoch += 1;
        if self.work.send(Work::Reset).is_err() {
            tracing::error!("compute thread is gone");
        }
    }

    /// Queues an answer made without the compute thread (a refusal of a
    /// request before it reached it) behind the compute thread's own.
    pub(super) async fn emit(&self, o: Output) {
        let _ = self.out.send(o).await;
    }
}
