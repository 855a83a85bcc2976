//! Streamed answers: the exit stage's sealed chunks passed on as they come
//! (relayed, opened, or opened and sealed again), with an idle timeout and
//! cancellation when the client stops reading or goes away; the receipt
//! kept when the stream ends.

use super::{keep_receipt, Owner, Service, StreamAnswer};
use crate::metrics::{Metrics, StreamCut};
use crate::openai_error::ApiError;
use crate::pipeline::{Failure, Reply, Submission};
use crate::receipt_store::ReceiptStore;
use bytes::Bytes;
use proto::receipt::ReceiptTrailer;
use proto::sealing::{ClientResponseKey, ResponseOpener, ResponseSealer, SealLimits};
use std::sync::Arc;
use std::time::Duration;

/// How the gateway passes a stream's sealed bytes to its client.
pub(super) enum StreamMode {
    /// The client sealed to the enclave key: ciphertext as it comes.
    Relay,
    /// A plain client: the gateway opens the stream it sealed the request for.
    Open(ClientResponseKey),
    /// The client sealed to the gateway's key: open, and seal again to it.
    Reseal(ClientResponseKey, ResponseSealer),
}

impl StreamMode {
    fn is_plain(&self) -> bool {
        matches!(self, StreamMode::Open(_))
    }
}

impl Service {
    /// Starts passing the exit stage's messages on to the client. If the
    /// client goes away, or stops reading for the route's deadline, the
    /// submission is dropped and the request is cancelled in the stages.
    pub(super) fn stream(
        &self,
        owner: &Owner,
        sub: Submission,
        receipt_id: [u8; 16],
        mode: StreamMode,
    ) -> StreamAnswer {
        let sealed = !mode.is_plain();
        // A short queue: what a client does not read waits in the socket.
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
        // A stream may run long; only a silence this long ends it.
        let idle = self.routes.for_route(crate::timeouts::COMPLETIONS);
        let kept_for = Kept {
            receipts: self.receipts.clone(),
            log: self.receipt_log.clone(),
            id: receipt_id,
            owner: owner.clone(),
        };
        tokio::spawn(pump(sub, mode, tx, kept_for, self.metrics.clone(), idle));
        StreamAnswer {
            receipt_id,
            sealed,
            chunks: rx,
        }
    }
}

/// Where a stream's receipt is kept, under which id, and whose it is.
struct Kept {
    receipts: Arc<ReceiptStore>,
    log: Option<crate::transparency::receipts::ReceiptLogger>,
    id: [u8; 16],
    owner: Owner,
}

async fn pump(
    mut sub: Submission,
    mut mode: StreamMode,
    tx: tokio::sync::mpsc::Sender<Bytes>,
    kept_for: Kept,
    metrics: Arc<Metrics>,
    idle: Duration,
) {
    let mut opener = match &mode {
        StreamMode::Open(k) | StreamMode::Reseal(k, _) => {
            Some(ResponseOpener::new(k, SealLimits::default()))
        }
        StreamMode::Relay => None,
    };
    loop {
        let (data, last, receipt) = match sub.next(idle).await {
            Ok(Reply::StreamData(d)) => (d, false, None),
            Ok(Reply::StreamEnd { data, receipt }) => (data, true, receipt),
            other => {
                // The pipeline broke or went silent: say so to a plain client.
                let why = match other {
                    Err(Failure::Timeout) => "The stream stalled and was closed.".to_string(),
                    Err(Failure::NotReady(r) | Failure::NotSent(r)) => {
                        format!("The pipeline failed mid-stream: {r}")
                    }
                    _ => "The exit stage answered out of order.".to_string(),
                };
                tracing::warn!(error = %why, "stream ended early");
                cut_by_pipeline(&mode, &tx, &metrics, why).await;
                return;
            }
        };
        let out = match (&mut mode, opener.as_mut()) {
            (StreamMode::Relay, _) => Ok(data),
            (StreamMode::Open(_), Some(o)) => o.feed(&data).map(|parts| parts.concat()),
            (StreamMode::Reseal(_, sealer), Some(o)) => o.feed(&data).and_then(|parts| {
                // The stage's trailer (its receipt) goes on to the client.
                match (last, o.trailer()) {
                    (true, Some(trailer)) => {
                        let mut out = sealer.seal(&parts.concat(), false)?;
                        out.extend(sealer.finish_with_trailer(trailer)?);
                        Ok(out)
                    }
                    _ => sealer.seal(&parts.concat(), last),
                }
            }),
            _ => Ok(Vec::new()),
        };
        let out = match out {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "a stream chunk from the exit stage does not open");
                cut_by_pipeline(&mode, &tx, &metrics, UNOPENED.into()).await;
                return;
            }
        };
        if let Some(receipt) = receipt {
            // A stream the gateway opened ends with the stage's trailer: the
            // salt of the receipt's digests is kept with the receipt.
            let digest_salt = opener
                .as_ref()
                .and_then(|o| o.trailer())
                .and_then(|t| ReceiptTrailer::decode(t).ok())
                .and_then(|t| t.digest_salt);
            let trailer = ReceiptTrailer {
                receipt,
                digest_salt,
            };
            keep_receipt(
                &kept_for.receipts,
                kept_for.log.as_ref(),
                &metrics,
                kept_for.id,
                trailer,
                &kept_for.owner,
            )
            .await;
        }
        if !out.is_empty() {
            match tokio::time::timeout(idle, tx.send(Bytes::from(out))).await {
                Ok(Ok(())) => {}
                // The client went away: dropping `sub` cancels the request.
                Ok(Err(_)) => {
                    metrics.stream_cut(StreamCut::ClientGone);
                    return;
                }
                // The client stopped reading (the queue and the socket are
                // full): give its sequences back rather than wait forever.
                Err(_) => {
                    tracing::warn!(
                        idle_secs = idle.as_secs(),
                        "a stream's client stopped reading; cancelled"
                    );
                    metrics.stream_cut(StreamCut::ClientStalled);
                    return;
                }
            }
        }
        if last {
            // Chunks that opened before a bad one were passed on; the
            // stream is whole only if its final chunk opened too.
            if opener.as_ref().is_some_and(|o| !o.is_complete()) {
                tracing::error!("the exit stage's stream ended without a final chunk that opens");
                cut_by_pipeline(&mode, &tx, &metrics, UNOPENED.into()).await;
            }
            return;
        }
    }
}

const UNOPENED: &str = "The exit stage's stream did not open; it was cut short.";

/// Counts a stream the pipeline cut short and, for a plain client, ends it
/// with an error event (a sealed stream just ends: its opener sees it
/// truncated).
async fn cut_by_pipeline(
    mode: &StreamMode,
    tx: &tokio::sync::mpsc::Sender<Bytes>,
    metrics: &Metrics,
    why: String,
) {
    metrics.stream_cut(StreamCut::Pipeline);
    if mode.is_plain() {
        let e = ApiError::from_stage(503, why);
        let mut ev = b"data: ".to_vec();
        ev.extend(e.body_bytes());
        ev.extend(b"\n\n");
        let _ = tx.send(Bytes::from(ev)).await;
    }
}
