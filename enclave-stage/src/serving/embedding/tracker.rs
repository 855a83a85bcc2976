//! Per-request bookkeeping in a stage: which rows of a request have passed,
//! the digests of what the stage received and sent for it, the receipt links
//! of earlier stages, and, once the request is complete here, this stage's
//! signed link (and at the exit stage the response, its receipt and its
//! sealing to the client).
//!
//! Row digests make "what a stage received and sent for this request"
//! well defined although micro-batches mix requests: each row's digest
//! covers its input index, token count and the unpadded bytes of its hidden
//! states exactly as they travel; a request's digest combines its rows in
//! index order. Stage *i*'s sent digest therefore equals stage *i+1*'s
//! received digest when nothing was changed in between.

use crate::keys::StageKeys;
use crate::receipt_link;
use crate::request_ids::IdWindow;
use crate::stats::RequestTimer;
use proto::digest::Sha256Digest;
use proto::frames::{
    ActivationMessage, BatchItem, ErrorKind, PipelineError, RequestContext, RequestTelemetry,
    ResultMessage, StageClaims, StageTiming,
};
use proto::openai::{embeddings_response, ApiError};
use proto::sealing::{seal_response, seal_response_with_trailer};
use proto::tensor::TensorFrame;
use std::collections::HashMap;

/// Digest of one row of a `[batch, seq, hidden]` f32 frame: index, token
/// count and the first `tokens` positions of the row.
pub fn row_digest(frame: &TensorFrame, row: usize, item: &BatchItem) -> Option<Sha256Digest> {
    let d = frame.dims();
    if d.len() != 3 || row >= d[0] || item.tokens as usize > d[1] {
        return None;
    }
    let start = row * d[1] * d[2] * 4;
    let len = item.tokens as usize * d[2] * 4;
    let bytes = frame.data.get(start..start + len)?;
    Some(Sha256Digest::of_parts(
        "row/v1",
        &[&item.index.to_be_bytes(), &item.tokens.to_be_bytes(), bytes],
    ))
}

fn combine(rows: &[Option<Sha256Digest>]) -> Option<Sha256Digest> {
    let parts: Option<Vec<[u8; 32]>> = rows.iter().map(|r| r.map(|d| d.0)).collect();
    let parts = parts?;
    let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
    Some(Sha256Digest::of_parts("rows/v1", &refs))
}

struct Request {
    ctx: RequestContext,
    remaining: u32,
    received: Vec<Option<Sha256Digest>>,
    sent: Vec<Option<Sha256Digest>>,
    vectors: Vec<Option<Vec<f32>>>,
    tokens: Vec<u32>,
    upstream_links: Option<Vec<Vec<u8>>>,
    /// The receipt key of the stage the links came from.
    upstream_signer: Option<[u8; 32]>,
    upstream_timings: Vec<StageTiming>,
    timer: RequestTimer,
}

/// What a finished request produces.
pub enum Finished {
    /// Links to send to the next stage.
    Links(ActivationMessage),
    /// The sealed response and receipt for the gateway.
    Response(ResultMessage),
}

/// All requests in flight in this stage.
pub struct Tracker {
    requests: HashMap<u64, Request>,
    claims: StageClaims,
    /// The ids begun in this configuration: none is ever given to two
    /// requests.
    begun: IdWindow,
}

impl Tracker {
    /// A tracker for a stage with these claims.
    pub fn new(claims: StageClaims) -> Self {
        Self {
            requests: HashMap::new(),
            claims,
            begun: IdWindow::new(),
        }
    }

    /// Whether a request with this id may begin: an id begins at most once
    /// in a configuration ([`IdWindow`]), so a reused one is refused, never
    /// merged.
    pub fn may_begin(&self, request_id: u64) -> Result<(), String> {
        self.begun.check(request_id)
    }

    /// Starts tracking a request ([`Self::may_begin`] checked first).
    pub fn begin(&mut self, ctx: RequestContext) {
        let n = ctx.n_inputs as usize;
        let entry = self.claims.is_entry();
        let began = self.begun.begin(ctx.env.request_id);
        debug_assert!(began.is_ok(), "may_begin was not checked first");
        self.requests.insert(
            ctx.env.request_id,
            Request {
                ctx,
                remaining: n as u32,
                received: vec![None; n],
                sent: vec![None; n],
                vectors: vec![None; n],
                tokens: vec![0; n],
                upstream_links: entry.then(Vec::new),
                upstream_signer: None,
                upstream_timings: Vec::new(),
                timer: RequestTimer::start(),
            },
        );
    }

    /// Requests being tracked.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    /// Whether no request is being tracked.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// A request took part in a micro-batch that began at `began` and took `took`.
    pub fn computed(
        &mut self,
        request_id: u64,
        began: std::time::Instant,
        took: std::time::Duration,
    ) {
        if let Some(r) = self.requests.get_mut(&request_id) {
            r.timer.computed(began, took);
        }
    }

    /// Whether a request is being tracked (rows of failed requests are ignored).
    pub fn knows(&self, request_id: u64) -> bool {
        self.requests.contains_key(&request_id)
    }

    /// Records the digest of a received row (stages after the first). A
    /// row outside its request's inputs, or one that came before, is an
    /// error (the request must fail: rows are never merged or replaced).
    pub fn received_row(
        &mut self,
        item: &BatchItem,
        digest: Option<Sha256Digest>,
    ) -> Result<(), String> {
        let Some(r) = self.requests.get_mut(&item.request_id) else {
            return Ok(());
        };
        match r.received.get_mut(item.index as usize) {
            Some(slot @ None) if r.sent[item.index as usize].is_none() => {
                *slot = digest;
                Ok(())
            }
            Some(_) => Err(format!("input {} arrived twice", item.index)),
            None => Err(format!("input {} is not one of the request's", item.index)),
        }
    }

    /// Records a row this stage finished: the digest of what it sends on, or
    /// (exit stage) the pooled vector.
    pub fn finished_row(
        &mut self,
        item: &BatchItem,
        sent: Option<Sha256Digest>,
        vector: Option<Vec<f32>>,
    ) {
        if let Some(r) = self.requests.get_mut(&item.request_id) {
            let i = item.index as usize;
            if i < r.sent.len() && r.sent[i].is_none() && r.vectors[i].is_none() {
                r.sent[i] = sent;
                r.vectors[i] = vector;
                r.tokens[i] = item.tokens;
                r.remaining = r.remaining.saturating_sub(1);
            }
        }
    }

    /// Records the earlier stages' links and timings, and the receipt key
    /// of the stage they came from.
    pub fn upstream_links(
        &mut self,
        request_id: u64,
        links: Vec<Vec<u8>>,
        timings: Vec<StageTiming>,
        signer: [u8; 32],
    ) {
        if let Some(r) = self.requests.get_mut(&request_id) {
            r.upstream_links = Some(links);
            r.upstream_signer = Some(signer);
            r.upstream_timings = timings;
        }
    }

    /// Stops tracking a failed request; returns the failure to send on,
    /// with the error body sealed to the client when its key is known.
    pub fn fail(&mut self, request_id: u64, kind: ErrorKind, message: String) -> PipelineError {
        let api = ApiError::internal(message.clone());
        let r = self.requests.remove(&request_id);
        crate::work::sealed_error(r.as_ref().map(|r| &r.ctx.env), &api, kind, message)
    }

    /// Forgets a request that failed upstream.
    pub fn forget(&mut self, request_id: u64) {
        self.requests.remove(&request_id);
    }

    /// Stops tracking every request (a new configuration begins).
    pub fn clear(&mut self) {
        self.requests.clear();
        self.begun.clear();
    }

    /// If the request is complete in this stage, signs this stage's link and
    /// returns what to send on.
    pub fn try_finish(
        &mut self,
        request_id: u64,
        keys: &StageKeys,
        issued_at_ms: u64,
    ) -> Option<Result<Finished, PipelineError>> {
        let r = self.requests.get(&request_id)?;
        if r.remaining > 0 || r.upstream_links.is_none() {
            return None;
        }
        let r = self.requests.remove(&request_id)?;
        Some(self.finish(r, keys, issued_at_ms))
    }

    fn finish(
        &self,
        r: Request,
        keys: &StageKeys,
        issued_at_ms: u64,
    ) -> Result<Finished, PipelineError> {
        let fail = |m: &str| PipelineError {
            kind: ErrorKind::Internal,
            status: 500,
            message: m.to_string(),
            retry_after_secs: None,
            sealed_body: seal_response(
                &r.ctx.env.response_key,
                &ApiError::internal(m).body_bytes(),
            )
            .ok(),
        };
        let upstream = r.upstream_links.clone().unwrap_or_default();
        let mut timings = r.upstream_timings.clone();
        timings.push(r.timer.finish(self.claims.stage_index));
        let c = &self.claims;
        let link = receipt_link::link(
            c,
            keys,
            &r.ctx.env,
            &upstream,
            r.upstream_signer.as_ref(),
            || combine(&r.received).ok_or_else(|| fail("a received row is missing its digest")),
            Sha256Digest([0; 32]),
            |why| {
                tracing::error!(request_id = r.ctx.env.request_id, reason = %why, "receipt chain refused; nothing signed");
                fail("the pipeline's data for this request did not match between stages")
            },
        )?;
        if !c.is_exit() {
            let mut link = link;
            link.sent_digest =
                combine(&r.sent).ok_or_else(|| fail("a sent row is missing its digest"))?;
            return Ok(Finished::Links(receipt_link::pass_on(
                keys, &r.ctx.env, &link, upstream, timings,
            )));
        }
        let vectors: Option<Vec<Vec<f32>>> = r.vectors.into_iter().collect();
        let vectors = vectors.ok_or_else(|| fail("a row is missing its vector"))?;
        let body = embeddings_response(&r.ctx.request, &c.model_id, &vectors, &r.tokens);
        let telemetry = RequestTelemetry {
            stages: timings,
            input_tokens: r.tokens.iter().map(|&t| t as u64).sum(),
            ..Default::default()
        }
        .for_host(r.ctx.env.sealing);
        let body = serde_json::to_vec(&body).map_err(|_| fail("response encoding failed"))?;
        let receipt = receipt_link::sign_exit_receipt(
            c,
            keys,
            &r.ctx.env,
            link,
            upstream,
            &body,
            issued_at_ms,
        );
        // The receipt travels twice: beside the body for the host (headers,
        // the receipt store) and as the sealed body's trailer for the client.
        let trailer = receipt_link::client_trailer(&r.ctx.env, &receipt);
        let sealed = seal_response_with_trailer(&r.ctx.env.response_key, &body, &trailer)
            .map_err(|_| fail("sealing the response failed"))?;
        Ok(Finished::Response(ResultMessage::Response {
            request_id: r.ctx.env.request_id,
            status: 200,
            body: sealed,
            receipt,
            receipt_id: r.ctx.env.receipt_id,
            telemetry: Some(telemetry),
        }))
    }
}
