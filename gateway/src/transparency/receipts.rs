//! Receipt entries (`[transparency] log_receipts = true`): the digest of
//! every receipt the gateway keeps, never its content, appended to the log
//! in batches (one `flock`, one fsync and one signed checkpoint per batch,
//! every `receipt_batch_ms` at most), so that logging costs the request
//! nothing but a channel send. `GET /v1/receipts/{id}/inclusion` then
//! serves an RFC 9942 COSE receipt of the entry's inclusion.

use super::store::Log;
use proto::transparency::ReceiptEntry;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// The most entries appended at once.
const MAX_BATCH: usize = 4096;

/// Hands receipts to the batching task.
#[derive(Clone, Debug)]
pub struct ReceiptLogger {
    tx: mpsc::UnboundedSender<Vec<u8>>,
}

impl ReceiptLogger {
    /// Starts the task appending to `log` every `batch` at most.
    pub fn spawn(log: Arc<Mutex<Log>>, batch: Duration) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(run(log, rx, batch));
        Self { tx }
    }

    /// Queues `receipt`'s entry (a closed task is logged by the task).
    pub fn log(&self, receipt: &[u8]) {
        let _ = self.tx.send(ReceiptEntry::leaf_of(receipt));
    }
}

async fn run(log: Arc<Mutex<Log>>, mut rx: mpsc::UnboundedReceiver<Vec<u8>>, batch: Duration) {
    while let Some(first) = rx.recv().await {
        let mut leaves = vec![first];
        let until = tokio::time::Instant::now() + batch;
        while leaves.len() < MAX_BATCH {
            match tokio::time::timeout_at(until, rx.recv()).await {
                Ok(Some(l)) => leaves.push(l),
                Ok(None) | Err(_) => break,
            }
        }
        let n = leaves.len();
        let log = log.clone();
        match tokio::task::spawn_blocking(move || log.lock().unwrap().append(&leaves)).await {
            Ok(Ok(size)) => tracing::debug!(entries = n, size, "receipts logged"),
            Ok(Err(e)) => {
                tracing::error!(entries = n, error = %format!("{e:#}"), "receipts not logged")
            }
            Err(e) => tracing::error!(entries = n, error = %e, "receipts not logged"),
        }
    }
}
