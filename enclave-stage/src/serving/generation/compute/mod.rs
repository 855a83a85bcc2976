//! The compute thread of a generation stage.
//!
//! - **Entry stage**: admits requests by KV memory ([`Scheduler`]), runs
//!   steps (token embedding + its layers) over the ready sequences and sends
//!   their hidden states on; the exit stage's sampled tokens come back on the
//!   feedback channel and make those sequences ready again.
//! - **Middle stages**: run their layers on each step and pass it on.
//! - **Exit stage**: runs its layers and the output head, samples, applies
//!   stop rules, streams sealed events or builds the sealed response, sends
//!   the tokens back, and signs the receipt once every stage's link is in.
//!
//! Every stage keeps a KV cache per sequence for its layers, reserved in full
//! (prompt + `max_tokens`) on the sequence's first step, and freed when the
//! request ends, fails or is cancelled. A step that fails is retried one
//! sequence at a time, so only the sequences that fail alone fail.

use super::model::GenModel;
use super::scheduler::{Admission, Scheduler, SchedulerLimits};
use crate::fault::Fault;
use crate::keys::StageKeys;
use crate::models::llama::{LlamaPart, SeqId};
use crate::request_ids::IdWindow;
use crate::stats::{RequestTimer, STATS};
use crate::work::{failure, Output, Work};
use candle_core::Tensor;
use proto::completions::stream_error_event;
use proto::digest::Sha256Digest;
use proto::frames::{
    ActivationMessage, ErrorKind, FeedbackMessage, GenerationContext, PipelineError, ResultMessage,
    StageTiming, StepSeq,
};
use proto::openai::ApiError;
use std::collections::HashMap;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::Sender;

mod exit;
mod feedback;
mod step;

use exit::{ExitState, Streaming};
use step::request_ids;

/// Budgets of a generation stage.
#[derive(Clone, Copy, Debug)]
pub struct GenLimits {
    /// KV-cache budget in tokens (the same number in every stage).
    pub kv_tokens: usize,
    /// Most tokens per step.
    pub step_tokens: usize,
    /// Most sequences per step.
    pub max_step_seqs: usize,
    /// Most requests waiting for KV room (entry stage).
    pub max_waiting: usize,
}

/// Key of a sequence in the KV caches: the request id and the choice side
/// by side, so no two (request, choice) pairs share a cache (the key was
/// once `request_id << 8 | choice`: ids `k · 2^56` apart collided).
fn seq_key(request_id: u64, choice: u32) -> SeqId {
    ((request_id as SeqId) << 32) | choice as SeqId
}

/// Chains one sequence's rows of one step into its running digest, so a
/// stage's "sent" equals the next stage's "received" when nothing changed.
fn chain(prev: Option<Sha256Digest>, s: &StepSeq, rows: &[u8]) -> Sha256Digest {
    let prev = prev.map(|d| d.0).unwrap_or([0; 32]);
    Sha256Digest::of_parts(
        "gen-rows/v1",
        &[&prev, &s.pos.to_be_bytes(), &s.len.to_be_bytes(), rows],
    )
}

fn combine(d: &[Option<Sha256Digest>]) -> Sha256Digest {
    let parts: Vec<[u8; 32]> = d
        .iter()
        .map(|x| x.map(|d| d.0).unwrap_or([0; 32]))
        .collect();
    let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
    Sha256Digest::of_parts("gen-seqs/v1", &refs)
}

struct GenRequest {
    ctx: GenerationContext,
    received: Vec<Option<Sha256Digest>>,
    sent: Vec<Option<Sha256Digest>>,
    upstream_links: Option<Vec<Vec<u8>>>,
    /// The receipt key of the stage the links came from.
    upstream_signer: Option<[u8; 32]>,
    /// Every choice has finished in this stage's view.
    done: bool,
    exit: Option<ExitState>,
    /// Earlier stages' timings (with their links).
    upstream_timings: Vec<StageTiming>,
    /// This stage's timing.
    timer: RequestTimer,
}

impl GenRequest {
    fn reserve(&self, choice: u32, context: usize) -> usize {
        let n = self.ctx.request.n.max(1);
        let prompt = self
            .ctx
            .prompts
            .get((choice / n) as usize)
            .map_or(0, |p| p.tokens as usize);
        (prompt + self.ctx.request.max_tokens as usize).min(context)
    }
}

/// A step's input.
enum StepInput {
    /// Entry: token ids per sequence (concatenated in row order).
    Tokens(Vec<u32>),
    /// Later stages: hidden rows `[tokens, hidden]`.
    Hidden(Tensor),
}

/// The generation compute loop.
pub struct Generator {
    model: Arc<GenModel>,
    part: LlamaPart,
    keys: Arc<StageKeys>,
    out: Sender<Output>,
    fault: Fault,
    limits: GenLimits,
    sched: Option<Scheduler>,
    requests: HashMap<u64, GenRequest>,
    next_step: u64,
    /// The ids registered in this configuration: none is ever given to
    /// two requests.
    begun: IdWindow,
}

impl Generator {
    /// A compute loop for `model`'s part `part`, sending to `out`.
    pub fn new(
        model: Arc<GenModel>,
        part: LlamaPart,
        keys: Arc<StageKeys>,
        out: Sender<Output>,
        limits: GenLimits,
    ) -> Self {
        let sched = model.claims.is_entry().then(|| {
            Scheduler::new(SchedulerLimits {
                kv_tokens: limits.kv_tokens,
                step_tokens: limits.step_tokens,
                max_step_seqs: limits.max_step_seqs,
                max_waiting: limits.max_waiting,
                num_stages: model.claims.num_stages as usize,
            })
        });
        Self {
            model,
            part,
            keys,
            out,
            fault: Fault::from_env(),
            limits,
            sched,
            requests: HashMap::new(),
            next_step: 0,
            begun: IdWindow::new(),
        }
    }

    fn is_exit(&self) -> bool {
        self.model.claims.is_exit()
    }

    /// KV-cache tokens this stage has allocated (derived from the caches).
    fn kv_tokens_used(&self) -> usize {
        self.part.kv_bytes_allocated() / self.part.bytes_per_token().max(1)
    }

    /// Runs until the work queue closes: drains everything queued, then runs
    /// steps while sequences are ready (entry stage).
    pub fn run(mut self, rx: Receiver<Work>) {
        loop {
            let ready = self.sched.as_ref().is_some_and(Scheduler::has_ready);
            let first = if ready {
                match rx.try_recv() {
                    Ok(w) => Some(w),
                    Err(std::sync::mpsc::TryRecvError::Empty) => None,
                    Err(_) => return,
                }
            } else {
                match rx.recv() {
                    Ok(w) => Some(w),
                    Err(_) => return,
                }
            };
            let mut next = first;
            while let Some(w) = next.take().or_else(|| rx.try_recv().ok()) {
                let ids = w.request_ids();
                self.contained(&ids, |g| g.handle(w));
            }
            if let Some(plan) = self.sched.as_mut().map(Scheduler::next_step) {
                if !plan.is_empty() {
                    let ids: Vec<u64> = plan.iter().map(|p| p.request_id).collect();
                    self.contained(&ids, |g| g.run_entry_step(plan));
                }
            }
            self.update_gauges();
        }
    }

    /// Runs `f`; if it panics, fails `request_ids` (what the work was
    /// about) and goes on, so that one request's poison does not stop the
    /// stage's compute thread for every other (issue 47).
    fn contained(&mut self, request_ids: &[u64], f: impl FnOnce(&mut Self)) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(self)));
        if r.is_err() {
            let mut ids = request_ids.to_vec();
            ids.sort_unstable();
            ids.dedup();
            self.fail(
                &ids,
                &anyhow::anyhow!("a panic in this stage's compute thread"),
            );
        }
    }

    /// Publishes this stage's gauges (requests, waiting, sequences, KV).
    fn update_gauges(&self) {
        let (waiting, active) = match &self.sched {
            Some(s) => (s.waiting(), s.active_seqs()),
            None => (0, self.requests.values().map(|r| r.received.len()).sum()),
        };
        STATS.gauges(self.requests.len(), waiting, active, self.kv_tokens_used());
    }

    /// Counts a step that began at `began` (ends now) in the stage's
    /// counters and in each of its requests' timings.
    fn record_step(&mut self, seqs: &[StepSeq], began: Instant) {
        let took = began.elapsed();
        let tokens = seqs.iter().map(|s| s.len as u64).sum();
        STATS.batch(seqs.len(), tokens, took);
        for id in request_ids(seqs) {
            if let Some(r) = self.requests.get_mut(&id) {
                r.timer.computed(began, took);
            }
        }
    }

    fn handle(&mut self, w: Work) {
        match w {
            Work::BeginGeneration { ctx, prompts } => self.begin_entry(*ctx, prompts),
            Work::Activation(ActivationMessage::BeginGeneration(ctx)) => self.begin(*ctx),
            Work::Activation(ActivationMessage::Step(b)) => self.run_upstream_step(b),
            Work::Feedback(FeedbackMessage::Tokens(t)) => self.feedback(t),
            Work::Feedback(FeedbackMessage::Dropped { request_id }) => {
                if let Some(s) = self.sched.as_mut() {
                    s.remove(request_id);
                }
                self.forget(request_id);
            }
            Work::Links {
                request_id,
                links,
                timings,
                signer,
            } => self.upstream_links(request_id, links, timings, signer),
            Work::Failed { request_id, error } => self.upstream_failed(request_id, error),
            Work::Cancel { request_id } => self.cancel(request_id),
            Work::Reset => self.reset(),
            Work::Begin(_) | Work::Seqs(_) | Work::Batch(_) | Work::Activation(_) => {
                tracing::warn!("embedding work sent to a generation stage; ignored")
            }
        }
    }

    fn send(&self, o: Output) {
        if self.out.blocking_send(o).is_err() {
            tracing::error!("output queue closed; dropping output");
        }
    }

    fn now_ms() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0)
    }

    /// The error for a request: details sealed to its client when its key is known.
    fn error_for(&self, request_id: u64, api: &ApiError, kind: ErrorKind) -> PipelineError {
        let message = format!(
            "stage {}: request failed with status {}",
            self.model.claims.stage_index, api.status
        );
        let env = self.requests.get(&request_id).map(|r| &r.ctx.env);
        crate::work::sealed_error(env, api, kind, message)
    }

    // ---- request lifecycle ----

    /// Registers a request; `false` (and the request failed) when its id
    /// was used before in this configuration ([`IdWindow`]; a live request
    /// with that id fails too rather than share its sequences), or when the
    /// exit stage cannot seal to its response key.
    fn register(&mut self, ctx: GenerationContext) -> bool {
        let request_id = ctx.env.request_id;
        if let Err(why) = self.begun.begin(request_id) {
            tracing::warn!(request_id, %why, "request id refused");
            let api = ApiError::internal("the request id was reused; refused");
            let err = self.error_for(request_id, &api, ErrorKind::Internal);
            if let Some(s) = self.sched.as_mut() {
                s.remove(request_id);
            }
            if self.forget(request_id).is_some() && self.is_exit() {
                self.send_feedback(FeedbackMessage::Dropped { request_id });
            }
            self.send(failure(self.is_exit(), request_id, err));
            return false;
        }
        let n = ctx.prompts.len() * ctx.request.n as usize;
        let exit = match self.is_exit().then(|| self.exit_state(&ctx)).transpose() {
            Ok(exit) => exit,
            Err(e) => {
                let message = match e {
                    exit::ExitSetupError::Key(e) => {
                        tracing::error!(request_id = ctx.env.request_id, error = %e, "unusable response key");
                        "the request's response key is unusable"
                    }
                    exit::ExitSetupError::Grammar => {
                        // The entry stage compiled it: only a stage that
                        // disagrees with it gets here. No detail is logged
                        // (it may quote the client's schema).
                        tracing::error!(
                            request_id = ctx.env.request_id,
                            "the answer's grammar does not compile at the exit stage"
                        );
                        "the answer's grammar does not compile at the exit stage"
                    }
                };
                let err = PipelineError {
                    kind: ErrorKind::Internal,
                    status: 500,
                    message: message.into(),
                    retry_after_secs: None,
                    sealed_body: None,
                };
                self.send(failure(true, ctx.env.request_id, err));
                return false;
            }
        };
        let entry = self.model.claims.is_entry();
        self.requests.insert(
            ctx.env.request_id,
            GenRequest {
                received: vec![None; n],
                sent: vec![None; n],
                upstream_links: entry.then(Vec::new),
                upstream_signer: None,
                done: false,
                exit,
                ctx,
                upstream_timings: Vec::new(),
                timer: RequestTimer::start(),
            },
        );
        true
    }

    /// Entry stage: a newly opened request with its tokenized prompts.
    fn begin_entry(&mut self, ctx: GenerationContext, prompts: Vec<Vec<u32>>) {
        let request_id = ctx.env.request_id;
        let context = self.model.config.max_seq_len;
        let n = ctx.request.n.max(1) as usize;
        let max_tokens = ctx.request.max_tokens;
        let mut choices = Vec::new();
        for p in &prompts {
            let reserve = (p.len() + max_tokens as usize).min(context);
            for _ in 0..n {
                choices.push((p.clone(), reserve));
            }
        }
        if !self.register(ctx.clone()) {
            return;
        }
        let sched = self.sched.as_mut().expect("entry stage");
        let reject = match sched.offer(request_id, choices) {
            Admission::Running | Admission::Waiting => None,
            Admission::TooLarge { need, capacity } => Some((
                ApiError {
                    code: Some("kv_cache_budget_exceeded".into()),
                    ..ApiError::invalid(
                        Some("max_tokens"),
                        format!(
                            "This request needs KV-cache room for {need} tokens (prompt + \
                             max_tokens, for each of its choices), more than the {capacity} \
                             this server holds. Reduce max_tokens, n or the prompt."
                        ),
                    )
                },
                None,
            )),
            Admission::Busy => Some((
                ApiError {
                    status: 503,
                    message: "The server is at capacity for completions; retry shortly.".into(),
                    kind: "server_error".into(),
                    param: None,
                    code: Some("overloaded".into()),
                },
                Some(2),
            )),
        };
        if let Some((api, retry)) = reject {
            let mut err = self.error_for(request_id, &api, ErrorKind::BadInput);
            err.retry_after_secs = retry;
            err.message = format!("completions request refused with status {}", api.status);
            self.requests.remove(&request_id);
            self.send(failure(self.is_exit(), request_id, err));
            return;
        }
        if self.is_exit() {
            self.start_stream(request_id);
        } else {
            self.send(Output::Activation(ActivationMessage::BeginGeneration(
                Box::new(ctx),
            )));
        }
    }

    /// Later stages: a request announced by the previous stage.
    fn begin(&mut self, ctx: GenerationContext) {
        let request_id = ctx.env.request_id;
        let forward = (!self.is_exit()).then(|| ctx.clone());
        if !self.register(ctx) {
            return;
        }
        match forward {
            Some(ctx) => self.send(Output::Activation(ActivationMessage::BeginGeneration(
                Box::new(ctx),
            ))),
            None => self.start_stream(request_id),
        }
    }

    fn start_stream(&mut self, request_id: u64) {
        let Some(r) = self.requests.get(&request_id) else {
            return;
        };
        if r.exit.as_ref().is_some_and(|e| e.stream.is_some()) {
            self.send(Output::Result(ResultMessage::StreamStart {
                request_id,
                receipt_id: r.ctx.env.receipt_id,
            }));
        }
    }

    /// Frees a request's KV caches in this stage and stops tracking it.
    fn forget(&mut self, request_id: u64) -> Option<GenRequest> {
        let r = self.requests.remove(&request_id)?;
        for c in 0..r.received.len() as u32 {
            self.part.free(seq_key(request_id, c));
        }
        Some(r)
    }

    /// The pipeline was torn down: frees every request's sequences and KV
    /// caches (nothing is sent: its channels are gone).
    fn reset(&mut self) {
        if let Some(s) = self.sched.as_mut() {
            s.clear();
        }
        self.begun.clear();
        let ids: Vec<u64> = self.requests.keys().copied().collect();
        let n = ids.len();
        for id in ids {
            self.forget(id);
        }
        if n > 0 {
            tracing::info!(requests = n, "requests of a torn-down pipeline freed");
        }
    }

    fn cancel(&mut self, request_id: u64) {
        if let Some(s) = self.sched.as_mut() {
            s.remove(request_id);
        }
        if self.forget(request_id).is_some() {
            tracing::info!(request_id, "request cancelled by the client; freed");
            let err = crate::work::cancelled();
            self.send(failure(self.is_exit(), request_id, err));
        }
    }

    fn upstream_failed(&mut self, request_id: u64, error: PipelineError) {
        let r = self.forget(request_id);
        if self.is_exit() {
            self.send_feedback(FeedbackMessage::Dropped { request_id });
            if let Some(stream) = r.and_then(|r| r.exit).and_then(|e| e.stream) {
                return self.end_stream_with_error(request_id, stream, &error);
            }
        }
        self.send(failure(self.is_exit(), request_id, error));
    }

    fn end_stream_with_error(&self, request_id: u64, mut s: Streaming, error: &PipelineError) {
        let api = ApiError {
            status: error.status,
            message: if error.status == 499 {
                "The request was cancelled.".into()
            } else {
                format!(
                    "Generation failed in the pipeline (status {}); the output above is incomplete.",
                    error.status
                )
            },
            kind: "server_error".into(),
            param: None,
            code: Some("generation_failed".into()),
        };
        // Events held for their time slice go out before the error.
        let mut last = s.take_pending();
        last.extend(stream_error_event(&api));
        let data = s.sealer.seal(&last, true).unwrap_or_default();
        self.send(Output::Result(ResultMessage::StreamEnd {
            request_id,
            data,
            receipt: None,
            telemetry: None,
        }));
    }

    /// Fails requests in this stage: frees them and tells the next stage
    /// (or the gateway, or the stream's client).
    fn fail(&mut self, request_ids: &[u64], error: &anyhow::Error) {
        for &request_id in request_ids {
            if !self.requests.contains_key(&request_id) {
                continue;
            }
            tracing::warn!(request_id, error = %error, "sequence failed in this stage");
            let api = ApiError::internal(format!(
                "stage {} failed on this request",
                self.model.claims.stage_index
            ));
            let err = self.error_for(request_id, &api, ErrorKind::Internal);
            if let Some(s) = self.sched.as_mut() {
                s.remove(request_id);
            }
            let r = self.forget(request_id);
            if self.is_exit() {
                self.send_feedback(FeedbackMessage::Dropped { request_id });
                if let Some(stream) = r.and_then(|r| r.exit).and_then(|e| e.stream) {
                    self.end_stream_with_error(request_id, stream, &err);
                    continue;
                }
            }
            self.send(failure(self.is_exit(), request_id, err));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::seq_key;

    #[test]
    fn sequence_keys_do_not_collide() {
        // These pairs shared a cache under `request_id << 8 | choice`.
        let k = 5u64;
        assert_ne!(seq_key(k, 0), seq_key(k + (1 << 56), 0));
        assert_ne!(seq_key(k, 0), seq_key(k + (3 << 56), 0));
        assert_ne!(seq_key(1, 0), seq_key(0, 256));
        assert_ne!(seq_key(u64::MAX, u32::MAX), seq_key(u64::MAX - 1, u32::MAX));
        assert_eq!(seq_key(7, 3), seq_key(7, 3));
    }
}
