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
use super::output::{ChoiceOut, ChoiceRules};
use super::scheduler::{Admission, Planned, Scheduler, SchedulerLimits};
use crate::compute::{failure, Output, Work};
use crate::fault::Fault;
use crate::keys::StageKeys;
use crate::llama::{LlamaPart, SeqSlice};
use crate::sampling::SamplingParams;
use crate::stats::{unix_ns, RequestTimer, STATS};
use anyhow::{anyhow, bail, Result};
use candle_core::Tensor;
use proto::chat::{chat_chunk_event, chat_completion_id, chat_response, Delta};
use proto::completions::{
    completion_id, completions_response, stream_error_event, stream_text_event, stream_usage_event,
    Api, FinishReason, StreamIdentity, Usage, STREAM_DONE,
};
use proto::digest::Sha256Digest;
use proto::frames::{
    ActivationMessage, BatchItem, ErrorKind, FeedbackMessage, GenerationContext, NextToken,
    PipelineError, RequestTelemetry, ResultMessage, StageTiming, StepBatch, StepSeq,
};
use proto::openai::ApiError;
use proto::receipt::{link_digest, sign_link, sign_receipt, Link, ReceiptBody, ReceiptVersion};
use proto::sealing::{seal_response, seal_response_with_trailer, ResponseSealer};
use proto::tensor::TensorFrame;
use std::collections::HashMap;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::Sender;

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

/// Key of a sequence in the KV caches.
fn seq_key(request_id: u64, choice: u32) -> u64 {
    (request_id << 8) | choice as u64
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

/// The response `id`: `cmpl-…` or `chatcmpl-…` and the receipt id.
fn response_id(api: Api, receipt_id: &[u8; 16]) -> String {
    match api {
        Api::Completions => completion_id(receipt_id),
        Api::Chat => chat_completion_id(receipt_id),
    }
}

fn combine(d: &[Option<Sha256Digest>]) -> Sha256Digest {
    let parts: Vec<[u8; 32]> = d
        .iter()
        .map(|x| x.map(|d| d.0).unwrap_or([0; 32]))
        .collect();
    let refs: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
    Sha256Digest::of_parts("gen-seqs/v1", &refs)
}

struct Streaming {
    identity: StreamIdentity,
    sealer: ResponseSealer,
    /// Every plaintext byte of the event stream so far (the receipt binds it).
    bytes: Vec<u8>,
    /// Per choice: whether its first chat chunk (the role) has gone out.
    started: Vec<bool>,
}

impl Streaming {
    /// The events for choice `index` after a step: its new `text` and, on
    /// its last step, why it ended. Chat sends the role first, then content,
    /// then an empty delta with the finish reason.
    fn events(&mut self, index: u32, text: &str, finish: Option<FinishReason>) -> Vec<u8> {
        let id = &self.identity;
        let mut out = Vec::new();
        match id.api {
            Api::Completions => {
                if !text.is_empty() || finish.is_some() {
                    out = stream_text_event(id, index, text, finish);
                }
            }
            Api::Chat => {
                if let Some(started) = self.started.get_mut(index as usize) {
                    if !*started {
                        *started = true;
                        out.extend(chat_chunk_event(id, index, Delta::Role));
                    }
                }
                if !text.is_empty() {
                    out.extend(chat_chunk_event(id, index, Delta::Content(text)));
                }
                if let Some(f) = finish {
                    out.extend(chat_chunk_event(id, index, Delta::Finish(f)));
                }
            }
        }
        out
    }
}

struct ExitState {
    rules: ChoiceRules,
    choices: Vec<ChoiceOut>,
    stream: Option<Streaming>,
    prompt_tokens: u64,
    finished: usize,
    /// Unix ns when this request's first token was sampled.
    first_token_unix_ns: Option<u64>,
}

struct GenRequest {
    ctx: GenerationContext,
    received: Vec<Option<Sha256Digest>>,
    sent: Vec<Option<Sha256Digest>>,
    upstream_links: Option<Vec<Vec<u8>>>,
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
                self.handle(w);
            }
            if let Some(plan) = self.sched.as_mut().map(Scheduler::next_step) {
                if !plan.is_empty() {
                    self.run_entry_step(plan);
                }
            }
            self.update_gauges();
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
            } => self.upstream_links(request_id, links, timings),
            Work::Failed { request_id, error } => self.upstream_failed(request_id, error),
            Work::Cancel { request_id } => self.cancel(request_id),
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
        let sealed_body = self
            .requests
            .get(&request_id)
            .and_then(|r| seal_response(&r.ctx.response_key, &api.body_bytes()).ok());
        PipelineError {
            kind,
            status: api.status,
            message: format!(
                "stage {}: request failed with status {}",
                self.model.claims.stage_index, api.status
            ),
            retry_after_secs: None,
            sealed_body,
        }
    }

    // ---- request lifecycle ----

    /// Registers a request; `false` (and the request failed) when the exit
    /// stage cannot seal to its response key.
    fn register(&mut self, ctx: GenerationContext) -> bool {
        let n = ctx.prompts.len() * ctx.request.n as usize;
        let exit = match self.is_exit().then(|| self.exit_state(&ctx)).transpose() {
            Ok(exit) => exit,
            Err(e) => {
                tracing::error!(request_id = ctx.request_id, error = %e, "unusable response key");
                let err = PipelineError {
                    kind: ErrorKind::Internal,
                    status: 500,
                    message: "the request's response key is unusable".into(),
                    retry_after_secs: None,
                    sealed_body: None,
                };
                self.send(failure(true, ctx.request_id, err));
                return false;
            }
        };
        let entry = self.model.claims.is_entry();
        self.requests.insert(
            ctx.request_id,
            GenRequest {
                received: vec![None; n],
                sent: vec![None; n],
                upstream_links: entry.then(Vec::new),
                done: false,
                exit,
                ctx,
                upstream_timings: Vec::new(),
                timer: RequestTimer::start(),
            },
        );
        true
    }

    fn exit_state(&self, ctx: &GenerationContext) -> Result<ExitState, proto::sealing::SealError> {
        let r = &ctx.request;
        let cfg = &self.model.config;
        let tok = self.model.tokenizer.as_ref();
        let params = SamplingParams {
            temperature: r.temperature,
            top_p: r.top_p,
            seed: ctx.seed,
        };
        let n = r.n.max(1) as usize;
        let mut choices = Vec::new();
        let mut prompt_tokens = 0u64;
        for (pi, p) in ctx.prompts.iter().enumerate() {
            let prefix = match (&p.ids, tok) {
                (Some(ids), Some(t)) if r.echo => super::output::Detokenize::text(t, ids),
                _ => String::new(),
            };
            prompt_tokens += p.tokens as u64;
            for j in 0..n {
                let index = (pi * n + j) as u32;
                choices.push(ChoiceOut::new(
                    index,
                    params,
                    index as u64,
                    p.tokens as usize,
                    prefix.clone(),
                    r.logprobs.is_some(),
                ));
            }
        }
        let stream = match r.stream {
            true => Some(Streaming {
                identity: StreamIdentity {
                    id: response_id(r.api, &ctx.receipt_id),
                    created: ctx.created,
                    model: self.model.claims.model_id.clone(),
                    include_usage: r.include_usage,
                    api: r.api,
                },
                sealer: ResponseSealer::new(&ctx.response_key)?,
                bytes: Vec::new(),
                started: vec![false; choices.len()],
            }),
            false => None,
        };
        Ok(ExitState {
            rules: ChoiceRules {
                max_tokens: r.max_tokens,
                context: cfg.max_seq_len,
                stop: r.stop.clone(),
                eos: cfg.eos_token_id,
                logprobs: r.logprobs,
                presence_penalty: r.presence_penalty,
                frequency_penalty: r.frequency_penalty,
                logit_bias: r.logit_bias.clone(),
            },
            choices,
            stream,
            prompt_tokens,
            finished: 0,
            first_token_unix_ns: None,
        })
    }

    /// Entry stage: a newly opened request with its tokenized prompts.
    fn begin_entry(&mut self, ctx: GenerationContext, prompts: Vec<Vec<u32>>) {
        let request_id = ctx.request_id;
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
        let request_id = ctx.request_id;
        if !self.is_exit() {
            self.send(Output::Activation(ActivationMessage::BeginGeneration(
                Box::new(ctx.clone()),
            )));
        }
        if self.register(ctx) && self.is_exit() {
            self.start_stream(request_id);
        }
    }

    fn start_stream(&mut self, request_id: u64) {
        let Some(r) = self.requests.get(&request_id) else {
            return;
        };
        if r.exit.as_ref().is_some_and(|e| e.stream.is_some()) {
            self.send(Output::Result(ResultMessage::StreamStart {
                request_id,
                receipt_id: r.ctx.receipt_id,
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

    fn cancel(&mut self, request_id: u64) {
        if let Some(s) = self.sched.as_mut() {
            s.remove(request_id);
        }
        if self.forget(request_id).is_some() {
            tracing::info!(request_id, "request cancelled by the client; freed");
            let err = PipelineError {
                kind: ErrorKind::Internal,
                status: 499,
                message: "the client closed the request".into(),
                retry_after_secs: None,
                sealed_body: None,
            };
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
        let data = s
            .sealer
            .seal(&stream_error_event(&api), true)
            .unwrap_or_default();
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

    fn send_feedback(&mut self, m: FeedbackMessage) {
        if self.model.claims.is_entry() {
            // One-stage pipeline: the feedback loop is in this thread.
            if let FeedbackMessage::Tokens(t) = m {
                self.feedback(t);
            }
        } else {
            self.send(Output::Feedback(m));
        }
    }

    // ---- steps ----

    fn run_entry_step(&mut self, plan: Vec<Planned>) {
        let seqs: Vec<StepSeq> = plan
            .iter()
            .map(|p| StepSeq {
                request_id: p.request_id,
                choice: p.choice,
                pos: p.pos,
                len: p.tokens.len() as u32,
            })
            .collect();
        let ids: Vec<u32> = plan.iter().flat_map(|p| p.tokens.iter().copied()).collect();
        let reserves: Vec<usize> = plan.iter().map(|p| p.reserve).collect();
        self.run_step(seqs, StepInput::Tokens(ids), Some(reserves));
    }

    fn run_upstream_step(&mut self, b: StepBatch) {
        let hidden = self.model.config.hidden_size;
        let dims = b.hidden.dims();
        let total: u32 = b.seqs.iter().map(|s| s.len).sum();
        let values = match b.hidden.to_f32() {
            Ok(v) if dims == [total as usize, hidden] => v,
            _ => {
                let ids = request_ids(&b.seqs);
                return self.fail(
                    &ids,
                    &anyhow!("step shape {dims:?} does not fit its sequences"),
                );
            }
        };
        // Digest what we received, row by row.
        let mut off = 0usize;
        for s in &b.seqs {
            let len = s.len as usize * hidden * 4;
            if let Some(r) = self.requests.get_mut(&s.request_id) {
                if let Some(slot) = r.received.get_mut(s.choice as usize) {
                    *slot = Some(chain(*slot, s, &b.hidden.data[off..off + len]));
                }
            }
            off += len;
        }
        let t = match Tensor::from_vec(values, (total as usize, hidden), self.part.device()) {
            Ok(t) => t,
            Err(e) => return self.fail(&request_ids(&b.seqs), &e.into()),
        };
        self.run_step(b.seqs, StepInput::Hidden(t), None);
    }

    /// Runs a step; on failure retries each sequence alone.
    fn run_step(&mut self, seqs: Vec<StepSeq>, input: StepInput, reserves: Option<Vec<usize>>) {
        // Sequences of requests dropped meanwhile (failed, cancelled) are skipped.
        let keep: Vec<bool> = seqs
            .iter()
            .map(|s| self.requests.contains_key(&s.request_id))
            .collect();
        let (seqs, input, reserves) = if keep.iter().all(|&k| k) {
            (seqs, input, reserves)
        } else {
            match select(&seqs, &input, reserves.as_deref(), &keep) {
                Ok(v) => v,
                Err(e) => return self.fail(&request_ids(&seqs), &e),
            }
        };
        if seqs.is_empty() {
            return;
        }
        match self.try_step(&seqs, &input, reserves.as_deref()) {
            Ok(()) => {}
            Err(e) if seqs.len() > 1 => {
                tracing::warn!(seqs = seqs.len(), error = %e, "step failed; retrying its sequences one by one");
                for i in 0..seqs.len() {
                    let mut only = vec![false; seqs.len()];
                    only[i] = true;
                    match select(&seqs, &input, reserves.as_deref(), &only) {
                        Ok((s, inp, res)) => self.run_step(s, inp, res),
                        Err(e) => self.fail(&[seqs[i].request_id], &e),
                    }
                }
            }
            Err(e) => self.fail(&request_ids(&seqs), &e),
        }
    }

    fn try_step(
        &mut self,
        seqs: &[StepSeq],
        input: &StepInput,
        reserves: Option<&[usize]>,
    ) -> Result<()> {
        let items: Vec<BatchItem> = seqs
            .iter()
            .map(|s| BatchItem {
                request_id: s.request_id,
                index: s.choice,
                tokens: s.len,
            })
            .collect();
        let ids = match input {
            StepInput::Tokens(ids) => Some(ids.as_slice()),
            StepInput::Hidden(_) => None,
        };
        if self
            .fault
            .fires_step(self.model.claims.stage_index, &items, ids)
        {
            bail!("injected fault");
        }
        let began = Instant::now();
        // Reserve KV room on each sequence's first step.
        for (i, s) in seqs.iter().enumerate() {
            let key = seq_key(s.request_id, s.choice);
            if self.part.cache(key).is_some() {
                continue;
            }
            let want = match reserves {
                Some(r) => r[i],
                None => self
                    .requests
                    .get(&s.request_id)
                    .map_or(0, |r| r.reserve(s.choice, self.model.config.max_seq_len)),
            }
            .max((s.pos + s.len) as usize);
            let used = self.kv_tokens_used();
            if used + want > self.limits.kv_tokens {
                bail!(
                    "KV budget exceeded: {used} + {want} tokens > {}",
                    self.limits.kv_tokens
                );
            }
            self.part.reserve(key, want)?;
        }
        let slices: Vec<SeqSlice> = seqs
            .iter()
            .map(|s| {
                SeqSlice::new(
                    seq_key(s.request_id, s.choice),
                    s.pos as usize,
                    s.len as usize,
                )
            })
            .collect();
        let hidden = match input {
            StepInput::Tokens(ids) => self.part.embed(ids)?,
            StepInput::Hidden(h) => h.clone(),
        };
        let out = self.part.forward(&hidden, &slices)?;
        if self.is_exit() {
            let logits = self.part.logits_last(&out, &slices)?.to_vec2::<f32>()?;
            self.record_step(seqs, began);
            self.sample(seqs, logits);
        } else {
            let values = out.flatten_all()?.to_vec1::<f32>()?;
            let frame = TensorFrame::from_f32(
                &[
                    values.len() / self.model.config.hidden_size,
                    self.model.config.hidden_size,
                ],
                &values,
            );
            let h = self.model.config.hidden_size * 4;
            let mut off = 0usize;
            for s in seqs {
                let len = s.len as usize * h;
                if let Some(r) = self.requests.get_mut(&s.request_id) {
                    if let Some(slot) = r.sent.get_mut(s.choice as usize) {
                        *slot = Some(chain(*slot, s, &frame.data[off..off + len]));
                    }
                }
                off += len;
            }
            self.record_step(seqs, began);
            let step_id = self.next_step;
            self.next_step += 1;
            self.send(Output::Activation(ActivationMessage::Step(StepBatch {
                step_id,
                seqs: seqs.to_vec(),
                hidden: frame,
            })));
        }
        Ok(())
    }

    /// Exit stage: samples one token per sequence, streams what may be
    /// streamed, sends the tokens back, finishes requests.
    fn sample(&mut self, seqs: &[StepSeq], mut logits: Vec<Vec<f32>>) {
        // An Arc clone, so the tokenizer can be borrowed while requests change.
        let model = self.model.clone();
        let Some(tok) = model.tokenizer.as_ref() else {
            return;
        };
        let mut next = Vec::with_capacity(seqs.len());
        let mut events: HashMap<u64, Vec<u8>> = HashMap::new();
        let mut completed = Vec::new();
        for (s, row) in seqs.iter().zip(logits.iter_mut()) {
            let Some(r) = self.requests.get_mut(&s.request_id) else {
                continue;
            };
            let Some(ex) = r.exit.as_mut() else { continue };
            if ex.first_token_unix_ns.is_none() {
                ex.first_token_unix_ns = Some(unix_ns());
            }
            let Some(choice) = ex.choices.get_mut(s.choice as usize) else {
                continue;
            };
            let token = choice.step(row, &ex.rules, tok);
            let finish = choice.finish();
            if let Some(st) = ex.stream.as_mut() {
                let text = choice.take_stream_text(&ex.rules.stop);
                let ev = st.events(choice.index(), &text, finish);
                if !ev.is_empty() {
                    events.entry(s.request_id).or_default().extend(ev);
                }
            }
            if finish.is_some() {
                ex.finished += 1;
                if ex.finished == ex.choices.len() {
                    r.done = true;
                    completed.push(s.request_id);
                }
            }
            next.push(NextToken {
                request_id: s.request_id,
                choice: s.choice,
                token,
                finished: finish.is_some(),
            });
        }
        // Seal each stream's events of this step as one chunk.
        let mut ids: Vec<u64> = events.keys().copied().collect();
        ids.sort_unstable();
        for request_id in ids {
            let ev = events.remove(&request_id).expect("listed");
            let Some(st) = self
                .requests
                .get_mut(&request_id)
                .and_then(|r| r.exit.as_mut())
                .and_then(|e| e.stream.as_mut())
            else {
                continue;
            };
            st.bytes.extend_from_slice(&ev);
            match st.sealer.seal(&ev, false) {
                Ok(data) => self.send(Output::Result(ResultMessage::StreamData {
                    request_id,
                    data,
                })),
                Err(e) => self.fail(&[request_id], &anyhow!("sealing a stream chunk: {e}")),
            }
        }
        self.send_feedback(FeedbackMessage::Tokens(next));
        for request_id in completed {
            self.try_finish(request_id);
        }
    }

    /// Entry stage: tokens from the exit stage.
    fn feedback(&mut self, tokens: Vec<NextToken>) {
        let Some(sched) = self.sched.as_mut() else {
            tracing::warn!("feedback tokens at a stage that is not the entry; ignored");
            return;
        };
        let mut completed = Vec::new();
        for t in tokens {
            if sched.feed(t.request_id, t.choice, t.token, t.finished) {
                completed.push(t.request_id);
            }
        }
        for request_id in completed {
            if let Some(r) = self.requests.get_mut(&request_id) {
                r.done = true;
            }
            self.try_finish(request_id);
        }
    }

    fn upstream_links(&mut self, request_id: u64, links: Vec<Vec<u8>>, timings: Vec<StageTiming>) {
        let exit = self.is_exit();
        let Some(r) = self.requests.get_mut(&request_id) else {
            return;
        };
        r.upstream_links = Some(links);
        r.upstream_timings = timings;
        // Middle stages: the previous stage finished, so every step of this
        // request has passed through here.
        if !exit {
            r.done = true;
        }
        self.try_finish(request_id);
    }

    /// Signs this stage's link once the request is complete here; at the
    /// exit stage, seals the response (or the stream's end) with the receipt.
    fn try_finish(&mut self, request_id: u64) {
        let ready = self
            .requests
            .get(&request_id)
            .is_some_and(|r| r.done && r.upstream_links.is_some());
        if !ready {
            return;
        }
        let Some(r) = self.forget(request_id) else {
            return;
        };
        match self.finish(r) {
            Ok(o) => self.send(o),
            Err(e) => {
                tracing::error!(request_id, error = %e, "finishing a request failed");
                let err = PipelineError {
                    kind: ErrorKind::Internal,
                    status: 500,
                    message: format!("finishing the request failed: {e}"),
                    retry_after_secs: None,
                    sealed_body: None,
                };
                self.send(failure(self.is_exit(), request_id, err));
            }
        }
    }

    fn finish(&self, r: GenRequest) -> Result<Output> {
        let c = &self.model.claims;
        let upstream = r.upstream_links.clone().unwrap_or_default();
        let mut timings = r.upstream_timings.clone();
        timings.push(r.timer.finish(c.stage_index));
        let received = if self.model.claims.is_entry() {
            r.ctx.request_digest
        } else {
            combine(&r.received)
        };
        let mut link = Link {
            receipt_id: r.ctx.receipt_id,
            stage_index: c.stage_index,
            layers: [c.layer_start, c.layer_end],
            evidence_digest: self.keys.evidence_digest,
            received_digest: received,
            sent_digest: combine(&r.sent),
            prev_link_digest: upstream.last().map(|l| link_digest(l)),
            // The entry stage binds which key it opened: what makes the
            // receipt's `sealing` checkable by the client (docs/receipts.md).
            opened: c.is_entry().then_some(r.ctx.opened),
        };
        if !self.is_exit() {
            let mut links = upstream;
            links.push(sign_link(&self.keys.receipt, &link));
            return Ok(Output::Activation(ActivationMessage::Links {
                request_id: r.ctx.request_id,
                links: links.into_iter().map(serde_bytes::ByteBuf::from).collect(),
                timings,
            }));
        }
        let ex = r.exit.ok_or_else(|| anyhow!("exit state missing"))?;
        let usage = Usage {
            prompt_tokens: ex.prompt_tokens,
            completion_tokens: ex
                .choices
                .iter()
                .map(|c| c.completion_tokens() as u64)
                .sum(),
        };
        let telemetry = RequestTelemetry {
            stages: timings,
            input_tokens: usage.prompt_tokens,
            output_tokens: usage.completion_tokens,
            finish_reasons: ex
                .choices
                .iter()
                .filter_map(|c| c.finish().map(|f| f.as_str().to_string()))
                .collect(),
            first_token_unix_ns: ex.first_token_unix_ns,
        };
        let (body, stream) = match ex.stream {
            Some(mut st) => {
                let mut tail = Vec::new();
                if st.identity.include_usage {
                    tail.extend(stream_usage_event(&st.identity, usage));
                }
                tail.extend_from_slice(STREAM_DONE);
                st.bytes.extend_from_slice(&tail);
                (std::mem::take(&mut st.bytes), Some((st, tail)))
            }
            None => {
                let choices: Vec<_> = ex.choices.into_iter().map(ChoiceOut::into_choice).collect();
                let api = r.ctx.request.api;
                let body = match api {
                    Api::Completions => completions_response,
                    Api::Chat => chat_response,
                };
                let v = body(
                    &response_id(api, &r.ctx.receipt_id),
                    r.ctx.created,
                    &c.model_id,
                    &choices,
                    usage,
                );
                (serde_json::to_vec(&v)?, None)
            }
        };
        let response_digest = Sha256Digest::of(&body);
        link.sent_digest = response_digest;
        let receipt = sign_receipt(
            &self.keys.receipt,
            &ReceiptBody {
                version: ReceiptVersion::CURRENT,
                receipt_id: r.ctx.receipt_id,
                issued_at_ms: Self::now_ms(),
                endpoint: r.ctx.endpoint.clone(),
                model_id: c.model_id.clone(),
                manifest_digest: c.manifest_sha256,
                request_digest: r.ctx.request_digest,
                response_digest,
                client_nonce: r.ctx.client_nonce.clone(),
                sequence: self.keys.next_sequence(),
                mock: self.keys.mock,
                sealing: r.ctx.sealing,
                // The exit stage's link rides in the receipt, under its
                // signature: one Ed25519 signature per request fewer.
                chain: upstream,
                exit_link: link,
            },
        );
        Ok(match stream {
            // The sealed stream or body ends with the receipt as its trailer
            // (the client's copy); the host gets it beside the bytes.
            Some((mut st, tail)) => {
                let mut data = st.sealer.seal(&tail, false).map_err(|e| anyhow!("{e}"))?;
                data.extend(
                    st.sealer
                        .finish_with_trailer(&receipt)
                        .map_err(|e| anyhow!("{e}"))?,
                );
                Output::Result(ResultMessage::StreamEnd {
                    request_id: r.ctx.request_id,
                    data,
                    receipt: Some(receipt),
                    telemetry: Some(telemetry),
                })
            }
            None => Output::Result(ResultMessage::Response {
                request_id: r.ctx.request_id,
                status: 200,
                body: seal_response_with_trailer(&r.ctx.response_key, &body, &receipt)
                    .map_err(|e| anyhow!("{e}"))?,
                receipt,
                receipt_id: r.ctx.receipt_id,
                telemetry: Some(telemetry),
            }),
        })
    }
}

fn request_ids(seqs: &[StepSeq]) -> Vec<u64> {
    let mut ids: Vec<u64> = seqs.iter().map(|s| s.request_id).collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

type Selected = (Vec<StepSeq>, StepInput, Option<Vec<usize>>);

/// The sequences of a step marked in `keep`, with their input rows.
fn select(
    seqs: &[StepSeq],
    input: &StepInput,
    reserves: Option<&[usize]>,
    keep: &[bool],
) -> Result<Selected> {
    let mut out_seqs = Vec::new();
    let mut out_res = Vec::new();
    let mut ids = Vec::new();
    let mut rows = Vec::new();
    let mut off = 0usize;
    for (i, s) in seqs.iter().enumerate() {
        let len = s.len as usize;
        if keep[i] {
            out_seqs.push(*s);
            if let Some(r) = reserves {
                out_res.push(r[i]);
            }
            match input {
                StepInput::Tokens(t) => ids.extend_from_slice(&t[off..off + len]),
                StepInput::Hidden(h) => rows.push(h.narrow(0, off, len)?),
            }
        }
        off += len;
    }
    let input = match input {
        StepInput::Tokens(_) => StepInput::Tokens(ids),
        StepInput::Hidden(_) if rows.is_empty() => StepInput::Tokens(Vec::new()),
        StepInput::Hidden(_) => StepInput::Hidden(Tensor::cat(&rows, 0)?),
    };
    Ok((out_seqs, input, reserves.map(|_| out_res)))
}
