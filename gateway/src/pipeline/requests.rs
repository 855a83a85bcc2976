//! Requests in flight: submitting a sealed request and following its answer
//! ([`Submission`]), routing the exit stage's results to their callers, and
//! the stages' attestation and statistics requests.

use super::{Answer, Failure, Pipeline, Reply, StageStatus, WholeReply};
use proto::attestation::Evidence;
use proto::frames::{HostMessage, RequestTelemetry, ResultMessage, SealedRequest, StageStats};
use proto::io::queue::QueuedSender;
use proto::receipt::Sealing;
use proto::sealing::SealedHeaders;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

impl Pipeline {
    pub(super) fn on_result(&self, m: ResultMessage) {
        let mut telemetry = None;
        let (request_id, reply, last) = match m {
            ResultMessage::Response {
                request_id,
                status,
                body,
                receipt,
                receipt_id,
                telemetry: t,
            } => {
                telemetry = t;
                let reply = Reply::Response(WholeReply {
                    status,
                    body,
                    receipt,
                    receipt_id,
                });
                (request_id, reply, true)
            }
            ResultMessage::Failed { request_id, error } => (request_id, Reply::Failed(error), true),
            ResultMessage::StreamStart {
                request_id,
                receipt_id,
            } => (request_id, Reply::StreamStart { receipt_id }, false),
            ResultMessage::StreamData { request_id, data } => {
                (request_id, Reply::StreamData(data), false)
            }
            ResultMessage::StreamEnd {
                request_id,
                data,
                receipt,
                telemetry: t,
            } => {
                telemetry = t;
                (request_id, Reply::StreamEnd { data, receipt }, true)
            }
        };
        let mut pending = self.pending.lock().unwrap();
        let w = if last {
            pending.remove(&request_id)
        } else {
            pending.get(&request_id).cloned()
        };
        match w {
            Some(w) => {
                let _ = w.send((reply, telemetry));
            }
            None => tracing::debug!(
                request_id,
                "answer for a request no longer waiting; dropped"
            ),
        }
    }

    /// Relays a sealed request to the entry stage and waits for its first
    /// answer (a whole response, a failure, or the start of a stream, whose
    /// rest comes through the returned [`Submission`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn submit(
        self: &Arc<Self>,
        endpoint: &str,
        headers: SealedHeaders,
        body: Vec<u8>,
        client_nonce: Option<Vec<u8>>,
        sealing: Sealing,
        timeout: Duration,
    ) -> Result<(Reply, Submission), Failure> {
        let entry = self.sender(0).map_err(|f| match f {
            Failure::NotReady(r) => Failure::NotSent(r),
            other => other,
        })?;
        // Ids reach the entry stage in increasing order (it refuses any
        // other): the id is drawn and the request queued under one lock.
        let mut next_id = self.next_id.lock().await;
        let request_id = *next_id;
        *next_id += 1;
        let (done, rx) = mpsc::unbounded_channel();
        self.pending.lock().unwrap().insert(request_id, done);
        let span = crate::telemetry::current_request_span();
        let trace = span.as_ref().and_then(crate::telemetry::trace_context);
        let mut sub = Submission {
            pipeline: self.clone(),
            request_id,
            rx,
            finished: false,
            span,
            submitted: Instant::now(),
            submitted_unix_ns: crate::stage_metrics::unix_ns(),
            streamed: false,
        };
        let msg = HostMessage::Request(SealedRequest {
            request_id,
            endpoint: endpoint.to_string(),
            headers,
            body,
            client_nonce,
            sealing,
            trace,
        });
        let sent = entry.send_msg(&msg).await;
        drop(next_id);
        if let Err(e) = sent {
            sub.finished = true;
            return Err(Failure::NotSent(format!("entry stage channel: {e}")));
        }
        let first = sub.next(timeout).await?;
        Ok((first, sub))
    }

    fn not_ready(&self) -> Failure {
        Failure::NotReady(self.not_ready_reason.lock().unwrap().clone())
    }

    fn sender(&self, index: usize) -> Result<QueuedSender, Failure> {
        match &*self.connected.lock().unwrap() {
            Some(c) => Ok(c.senders[index].clone()),
            None => Err(Failure::NotReady(
                self.not_ready_reason.lock().unwrap().clone(),
            )),
        }
    }

    /// Fresh evidence of every stage bound to `nonce`, with each stage's status.
    pub async fn attest(
        &self,
        nonce: &[u8],
        timeout: Duration,
    ) -> Result<Vec<(StageStatus, Evidence)>, Failure> {
        let stages = self.status().map_err(Failure::NotReady)?;
        let mut waits = Vec::new();
        for s in &stages {
            let i = s.index as usize;
            let (tx, rx) = oneshot::channel();
            self.attest_waiters
                .lock()
                .unwrap()
                .entry((i, nonce.to_vec()))
                .or_default()
                .push(tx);
            let sender = self.sender(i)?;
            let msg = HostMessage::Attest {
                nonce: nonce.to_vec(),
            };
            if let Err(e) = sender.send_msg(&msg).await {
                return Err(Failure::NotReady(format!("stage {i}: {e}")));
            }
            waits.push(rx);
        }
        let mut out = Vec::new();
        for (s, w) in stages.into_iter().zip(waits) {
            match tokio::time::timeout(timeout, w).await {
                Ok(Ok(ev)) => out.push((s, ev)),
                Ok(Err(_)) => {
                    return Err(Failure::NotReady("pipeline broke while attesting".into()))
                }
                Err(_) => return Err(Failure::Timeout),
            }
        }
        Ok(out)
    }

    /// Every stage's load counters (`None` for a stage that did not answer
    /// within `timeout`, or when the pipeline is down).
    pub async fn stats(&self, timeout: Duration) -> Vec<Option<StageStats>> {
        let n = self.stage_count();
        let mut waits = Vec::new();
        for i in 0..n {
            let Ok(sender) = self.sender(i) else {
                waits.push(None);
                continue;
            };
            let (tx, rx) = oneshot::channel();
            self.stats_waiters
                .lock()
                .unwrap()
                .entry(i)
                .or_default()
                .push(tx);
            let sent = sender.send_msg(&HostMessage::Stats).await;
            waits.push(sent.is_ok().then_some(rx));
        }
        let mut out = Vec::new();
        for w in waits {
            out.push(match w {
                Some(rx) => tokio::time::timeout(timeout, rx)
                    .await
                    .ok()
                    .and_then(Result::ok),
                None => None,
            });
        }
        out
    }
}

/// A request in flight: the rest of its answer. Dropping it before the
/// answer is complete (the client went away, or timed out) forgets the
/// request here and tells the entry stage to drop it in every stage.
pub struct Submission {
    pipeline: Arc<Pipeline>,
    request_id: u64,
    rx: mpsc::UnboundedReceiver<Answer>,
    finished: bool,
    /// The request's trace span (tracing on); kept open until the answer ends.
    span: Option<tracing::Span>,
    submitted: Instant,
    submitted_unix_ns: u64,
    /// A stream's first bytes came (time to first token is measured there).
    streamed: bool,
}

impl Submission {
    /// The next part of the answer, within `timeout`.
    pub async fn next(&mut self, timeout: Duration) -> Result<Reply, Failure> {
        match tokio::time::timeout(timeout, self.rx.recv()).await {
            Ok(Some((r, telemetry))) => {
                self.observe(&r, telemetry.as_ref());
                if matches!(
                    r,
                    Reply::Response(_) | Reply::Failed(_) | Reply::StreamEnd { .. }
                ) {
                    self.finished = true;
                }
                Ok(r)
            }
            Ok(None) => {
                self.finished = true;
                Err(self.pipeline.not_ready())
            }
            Err(_) => Err(Failure::Timeout),
        }
    }
}

impl Submission {
    /// Metrics and the trace span from an answer: time to first token when
    /// a stream's first bytes come, counts and stage spans at the end.
    fn observe(&mut self, r: &Reply, telemetry: Option<&RequestTelemetry>) {
        let p = &self.pipeline;
        if matches!(r, Reply::StreamData(_)) && !self.streamed {
            self.streamed = true;
            p.usage.first_token(self.submitted.elapsed());
        }
        let Some(t) = telemetry else { return };
        if !self.streamed && p.is_generation() {
            if let Some(first) = t.first_token_unix_ns {
                let ns = first.saturating_sub(self.submitted_unix_ns);
                p.usage.first_token(Duration::from_nanos(ns));
            }
        }
        p.usage.finished(t);
        if let Some(span) = &self.span {
            crate::telemetry::record_outcome(span, &p.model_id, p.is_generation(), t);
        }
    }
}

impl Drop for Submission {
    fn drop(&mut self) {
        if let Some(span) = &self.span {
            // The OpenTelemetry layer ends a span at its last exit: a stream's
            // span ends here, with the stream, not with the response headers.
            span.in_scope(|| {});
        }
        self.pipeline
            .pending
            .lock()
            .unwrap()
            .remove(&self.request_id);
        if self.finished {
            return;
        }
        let Ok(entry) = self.pipeline.sender(0) else {
            return;
        };
        let request_id = self.request_id;
        tracing::info!(
            request_id,
            "client stopped waiting; cancelling in the stages"
        );
        if entry
            .try_send_msg(&HostMessage::Cancel { request_id })
            .is_err()
        {
            // The queue is full: wait for room off this (synchronous) drop.
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = entry.send_msg(&HostMessage::Cancel { request_id }).await;
                });
            }
        }
    }
}
