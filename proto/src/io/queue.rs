//! One writer task per channel: whoever sends hands a whole encoded message
//! to a queue, and only the writer task touches the [`ChannelSender`].
//!
//! Enqueueing is cancel-safe (a message is either queued whole or not at
//! all), so a task that may be dropped at any await (an HTTP handler whose
//! client went away, an aborted key pusher) can send on a channel that
//! other requests share without ever leaving half a record on the wire or
//! a spent nonce behind ([`ChannelSender::send`] itself is not cancel-safe:
//! it poisons the sender when cancelled). Messages go out in the order they
//! were queued.
//!
//! Every queued message is wiped once written, or when it is dropped unsent
//! (encoded messages carry response keys and digest salts).

use super::channel::ChannelSender;
use crate::channel::ChannelError;
use crate::wipe::WipeOnDrop;
use serde::Serialize;
use tokio::sync::mpsc;

/// Messages a writer task holds before senders wait for room.
pub const QUEUE_DEPTH: usize = 64;

enum Command {
    Message(WipeOnDrop),
    Shutdown,
}

/// A cloneable handle to a channel's writer task.
#[derive(Clone)]
pub struct QueuedSender {
    tx: mpsc::Sender<Command>,
}

impl QueuedSender {
    /// Starts the writer task that owns `sender`. It writes queued messages
    /// in order until one fails (then later sends fail) or until
    /// [`Self::shutdown`], which closes the sending direction after what was
    /// queued before it.
    pub fn spawn(mut sender: ChannelSender) -> Self {
        let (tx, mut rx) = mpsc::channel::<Command>(QUEUE_DEPTH);
        tokio::spawn(async move {
            while let Some(c) = rx.recv().await {
                match c {
                    Command::Message(m) => {
                        if let Err(e) = sender.send(&m).await {
                            tracing::debug!(error = %e, "channel writer stopped");
                            break;
                        }
                    }
                    Command::Shutdown => break,
                }
            }
            sender.shutdown().await;
        });
        Self { tx }
    }

    /// Queues one encoded message, waiting for room. Cancel-safe. An error
    /// means the writer stopped (the channel failed or was shut down); a
    /// queued message may still fail to be written, which later sends and
    /// the peer's side notice.
    pub async fn send(&self, msg: Vec<u8>) -> Result<(), ChannelError> {
        self.tx
            .send(Command::Message(WipeOnDrop(msg)))
            .await
            .map_err(|_| ChannelError::Poisoned)
    }

    /// Queues a CBOR-encoded value ([`Self::send`]).
    pub async fn send_msg<T: Serialize>(&self, value: &T) -> Result<(), ChannelError> {
        self.send(crate::cbor::to_vec(value)).await
    }

    /// Queues a CBOR-encoded value without waiting (for `Drop` paths); an
    /// error when the queue is full or the writer stopped.
    pub fn try_send_msg<T: Serialize>(&self, value: &T) -> Result<(), ChannelError> {
        self.tx
            .try_send(Command::Message(WipeOnDrop(crate::cbor::to_vec(value))))
            .map_err(|_| ChannelError::Poisoned)
    }

    /// Closes the sending direction once everything queued before is
    /// written, and waits until the writer has stopped.
    pub async fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown).await;
        self.tx.closed().await;
    }

    /// Whether the writer has stopped.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}
