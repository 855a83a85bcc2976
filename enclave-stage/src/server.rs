//! The stage's network side: accepts attested channels from the gateway
//! (host) and from the previous stage, dials and attests the next stage when
//! configured, and moves messages between the channels and the compute thread.

use crate::batcher::Seq;
use crate::compute::{failure, Output, Work};
use crate::engine::Engine;
use crate::generation::model::GenModel;
use crate::keys::StageKeys;
use proto::attestation::{attest_claims, AttestationProvider, Measurement};
use proto::channel::{
    self, ChannelLimits, ChannelReceiver, ChannelSender, LocalIdentity, PeerInfo,
};
use proto::chat::parse_chat;
use proto::completions::{context_length_error, parse_completions, Api, Prompt};
use proto::digest::Sha256Digest;
use proto::frames::{
    ActivationMessage, BatchItem, Envelope, ErrorKind, FeedbackMessage, GenerationContext,
    HostMessage, PipelineError, PromptInfo, RequestContext, SealedRequest, StageClaims, StageReply,
};
use proto::openai::{parse_embeddings, ApiEndpoint, ApiError};
use proto::policy::Policy;
use proto::receipt::{OpenedKey, ReceiptId, Sealing};
use proto::sealing::{open_request, seal_response, ReplayGuard, ResponseKeyMaterial, SealError};
use proto::transport::{self, Endpoint, Listener};
use rand::RngCore;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Mutex};

/// How long an encapsulated key is remembered to refuse replays.
const REPLAY_WINDOW: Duration = Duration::from_secs(600);
/// Most encapsulated keys remembered at once for requests clients sealed
/// to the enclave key.
const REPLAY_CAPACITY: usize = 1 << 20;
/// Most remembered for requests the host says it sealed (plain and
/// gateway-key clients): a partition of its own, so that host-sealed traffic
/// cannot fill the room meant for catching replays of clients' sealed
/// requests. A host that mislabels a client's request lands it here, where
/// a replay is still caught.
const HOST_SEALED_REPLAY_CAPACITY: usize = 1 << 19;
/// Most tokens a chat answer may take when the client sets no limit (less
/// where the context ends first). Admission reserves KV-cache room for the
/// whole limit, so "up to the context" would let one chat hold the budget.
pub const DEFAULT_CHAT_MAX_TOKENS: u32 = 1024;
/// Longest nonce accepted in an attestation request.
const MAX_NONCE: usize = 64;

/// The model a stage serves.
#[derive(Clone)]
pub enum StageModel {
    /// An embedding model (`/v1/embeddings`).
    Embedding(Arc<Engine>),
    /// A generation model (`/v1/completions` and `/v1/chat/completions`).
    Generation(Arc<GenModel>),
}

impl StageModel {
    /// What the stage claims in its evidence.
    pub fn claims(&self) -> &StageClaims {
        match self {
            StageModel::Embedding(e) => &e.claims,
            StageModel::Generation(g) => &g.claims,
        }
    }

    /// Whether the model serves API path `endpoint`.
    pub fn serves(&self, endpoint: &str) -> bool {
        match (self, ApiEndpoint::from_path(endpoint)) {
            (StageModel::Embedding(_), Some(e)) => !e.is_generation(),
            (StageModel::Generation(_), Some(e)) => e.is_generation(),
            (_, None) => false,
        }
    }
}

/// What a stage serves with, besides its queues.
pub struct StageSetup {
    /// The loaded model.
    pub model: StageModel,
    /// The stage's keys and boot evidence.
    pub keys: Arc<StageKeys>,
    /// Attestation provider (mock or Nitro).
    pub provider: Arc<dyn AttestationProvider>,
    /// Policy for neighbouring stages.
    pub policy: Policy,
    /// This binary's own measurement (for `trust_local_build`).
    pub local_measurement: Measurement,
    /// Most inputs per request.
    pub max_inputs: usize,
}

type SharedSender = Arc<Mutex<ChannelSender>>;

/// Requests with at most this many bytes of text are tokenized inline.
const INLINE_TOKENIZE_BYTES: usize = 2048;

/// Where this stage's output currently goes.
struct Sink {
    id: u64,
    tx: SharedSender,
    /// The host channel that configured a next-stage sink; told when the
    /// next stage is lost so the gateway rebuilds the pipeline instead of
    /// waiting on outputs that can no longer arrive.
    host: Option<SharedSender>,
}

/// Everything the connection handlers share.
pub struct StageServer {
    model: StageModel,
    keys: Arc<StageKeys>,
    provider: Arc<dyn AttestationProvider>,
    policy: Policy,
    local_measurement: Measurement,
    replay: std::sync::Mutex<ReplayGuards>,
    limits: ChannelLimits,
    work: std::sync::mpsc::Sender<Work>,
    out: mpsc::Sender<Output>,
    sink: Mutex<Option<Sink>>,
    /// Generation exit stage: the attested channel back to the entry stage.
    feedback: Mutex<Option<SharedSender>>,
    next_sink: AtomicU64,
    max_inputs: usize,
}

impl StageServer {
    /// A server for `engine`; `work` feeds the compute thread, `out` is its output queue.
    pub fn new(
        setup: StageSetup,
        work: std::sync::mpsc::Sender<Work>,
        out: mpsc::Sender<Output>,
    ) -> Arc<Self> {
        let stage_index = setup.model.claims().stage_index;
        Arc::new(Self {
            model: setup.model,
            keys: setup.keys,
            provider: setup.provider,
            policy: setup.policy,
            local_measurement: setup.local_measurement,
            replay: std::sync::Mutex::new(ReplayGuards {
                client: ReplayGuard::new(REPLAY_WINDOW, REPLAY_CAPACITY),
                host: ReplayGuard::new(
                    REPLAY_WINDOW,
                    crate::fault::Fault::from_env()
                        .host_replay_capacity(stage_index)
                        .unwrap_or(HOST_SEALED_REPLAY_CAPACITY),
                ),
            }),
            limits: ChannelLimits::default(),
            work,
            out,
            sink: Mutex::new(None),
            feedback: Mutex::new(None),
            next_sink: AtomicU64::new(1),
            max_inputs: setup.max_inputs,
        })
    }

    fn identity(&self) -> LocalIdentity {
        LocalIdentity::stage(self.provider.clone(), self.model.claims().clone())
    }

    fn claims(&self) -> &StageClaims {
        self.model.claims()
    }

    /// Whether a peer is the exit stage dialling this entry stage to send
    /// sampled tokens back (generation pipelines of two or more stages).
    fn is_feedback_peer(&self, peer: &PeerInfo) -> bool {
        let me = self.claims();
        matches!(self.model, StageModel::Generation(_))
            && me.is_entry()
            && me.num_stages > 1
            && peer
                .claims
                .as_ref()
                .is_some_and(|c| c.stage_index + 1 == me.num_stages)
    }

    /// Checks the exit stage that dials the entry stage for feedback (or
    /// that the entry stage's exit dials): policy, position, same pipeline.
    fn check_loop_peer(&self, peer: &PeerInfo, want_index: u32) -> Result<(), String> {
        let (Some(doc), Some(c)) = (&peer.document, &peer.claims) else {
            return Err("peer presented no evidence".into());
        };
        self.policy
            .check(doc, c, Some(&self.local_measurement))
            .map_err(|e| e.to_string())?;
        let me = self.claims();
        if c.stage_index != want_index {
            return Err(format!(
                "peer is stage {}, expected stage {want_index}",
                c.stage_index
            ));
        }
        if c.num_stages != me.num_stages || c.manifest_sha256 != me.manifest_sha256 {
            return Err("peer serves a different pipeline or model manifest".into());
        }
        Ok(())
    }

    /// Checks an attested peer against the policy and that it is our
    /// neighbour at `offset` (-1 upstream, +1 downstream) serving the same model.
    fn check_neighbour(&self, peer: &PeerInfo, offset: i64) -> Result<(), String> {
        let (Some(doc), Some(c)) = (&peer.document, &peer.claims) else {
            return Err("peer presented no evidence".into());
        };
        self.policy
            .check(doc, c, Some(&self.local_measurement))
            .map_err(|e| e.to_string())?;
        let me = self.claims();
        let want = me.stage_index as i64 + offset;
        if c.stage_index as i64 != want {
            return Err(format!(
                "peer is stage {}, expected stage {want}",
                c.stage_index
            ));
        }
        if c.num_stages != me.num_stages || c.manifest_sha256 != me.manifest_sha256 {
            return Err("peer serves a different pipeline or model manifest".into());
        }
        let adjacent = if offset < 0 {
            c.layer_end == me.layer_start
        } else {
            c.layer_start == me.layer_end
        };
        if !adjacent {
            return Err(format!(
                "peer layers [{}, {}) are not adjacent to ours [{}, {})",
                c.layer_start, c.layer_end, me.layer_start, me.layer_end
            ));
        }
        Ok(())
    }

    /// Accepts connections forever.
    pub async fn serve(self: Arc<Self>, listener: Listener) {
        loop {
            match listener.accept().await {
                Ok((stream, peer)) => {
                    let this = self.clone();
                    tokio::spawn(async move { this.handle(stream, peer).await });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    async fn handle(self: Arc<Self>, stream: transport::BoxStream, addr: String) {
        let check = |p: &PeerInfo| {
            if p.is_host() {
                Ok(())
            } else if self.is_feedback_peer(p) {
                self.check_loop_peer(p, self.claims().num_stages - 1)
            } else {
                self.check_neighbour(p, -1)
            }
        };
        let (tx, rx, peer) =
            match channel::respond(stream, &self.identity(), self.limits, &check).await {
                Ok(v) => v,
                Err(e) => {
                    tracing::warn!(peer = %addr, error = %e, "handshake failed");
                    return;
                }
            };
        if peer.is_host() {
            tracing::info!(peer = %addr, "host channel open");
            self.host_session(Arc::new(Mutex::new(tx)), rx).await;
        } else if self.is_feedback_peer(&peer) {
            tracing::info!(peer = %addr, "feedback channel from the exit stage open (attested)");
            self.feedback_session(rx).await;
        } else {
            tracing::info!(peer = %addr, "upstream stage channel open (attested)");
            self.upstream_session(rx).await;
        }
    }

    async fn host_session(self: &Arc<Self>, tx: SharedSender, mut rx: ChannelReceiver) {
        let mut my_sink: Option<u64> = None;
        loop {
            let msg = match rx.recv_msg::<HostMessage>().await {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "host channel error");
                    break;
                }
            };
            let reply = match msg {
                HostMessage::Configure { next, feedback } => {
                    match self.configure(next, feedback, &tx).await {
                        Ok(id) => {
                            if id.is_some() {
                                my_sink = id;
                            }
                            Some(StageReply::Configured {
                                boot_evidence: self.keys.boot_evidence.clone(),
                            })
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "configuration failed");
                            Some(StageReply::ConfigureFailed(e))
                        }
                    }
                }
                HostMessage::Cancel { request_id } => {
                    if self.work.send(Work::Cancel { request_id }).is_err() {
                        tracing::error!("compute thread is gone");
                    }
                    None
                }
                HostMessage::Request(req) => {
                    if !self.model.claims().is_entry() {
                        tracing::warn!("request sent to a non-entry stage; closing");
                        break;
                    }
                    self.accept_request(req).await;
                    None
                }
                HostMessage::Stats => Some(StageReply::Stats(crate::stats::STATS.snapshot())),
                HostMessage::Attest { nonce } => {
                    if nonce.len() > MAX_NONCE {
                        tracing::warn!("attestation nonce too long; closing");
                        break;
                    }
                    match attest_claims(
                        self.provider.as_ref(),
                        &self.claims().receipt_key,
                        self.claims(),
                        &nonce,
                    ) {
                        Ok(evidence) => Some(StageReply::Evidence { nonce, evidence }),
                        Err(e) => {
                            tracing::error!(error = %e, "attestation failed");
                            break;
                        }
                    }
                }
            };
            if let Some(reply) = reply {
                if tx.lock().await.send_msg(&reply).await.is_err() {
                    break;
                }
            }
        }
        let mut sink = self.sink.lock().await;
        if sink.as_ref().map(|s| s.id) == my_sink && my_sink.is_some() {
            tracing::warn!("the gateway channel that received our output closed");
            *sink = None;
        }
    }

    /// Connects to another stage and runs the attested channel handshake
    /// as initiator; `check` judges the peer's evidence and claims.
    async fn dial(
        &self,
        ep: &Endpoint,
        what: &str,
        check: channel::PeerCheck<'_>,
    ) -> Result<(ChannelSender, ChannelReceiver), String> {
        let stream = transport::connect(ep)
            .await
            .map_err(|e| format!("connecting to {what} at {ep}: {e}"))?;
        let (tx, rx, _peer) = channel::initiate(stream, &self.identity(), self.limits, check)
            .await
            .map_err(|e| format!("{what} at {ep}: {e}"))?;
        Ok((tx, rx))
    }

    /// Sets the output sink: the next stage, or (exit stage) this host channel.
    async fn configure(
        self: &Arc<Self>,
        next: Option<String>,
        feedback: Option<String>,
        host_tx: &SharedSender,
    ) -> Result<Option<u64>, String> {
        let id = self.next_sink.fetch_add(1, Ordering::Relaxed);
        match (&feedback, &self.model) {
            (Some(ep), StageModel::Generation(_))
                if self.model.claims().is_exit() && !self.model.claims().is_entry() =>
            {
                let ep: Endpoint = ep.parse()?;
                let check = |p: &PeerInfo| self.check_loop_peer(p, 0);
                let (tx, _rx) = self.dial(&ep, "the entry stage", &check).await?;
                *self.feedback.lock().await = Some(Arc::new(Mutex::new(tx)));
                tracing::info!(entry = %ep, "connected and attested the entry stage for feedback");
            }
            (None, StageModel::Generation(_))
                if self.model.claims().is_exit() && !self.model.claims().is_entry() =>
            {
                return Err(
                    "a generation exit stage needs the entry stage's endpoint (feedback)".into(),
                )
            }
            (None, _) => {}
            (Some(_), _) => {
                return Err("only a generation exit stage takes a feedback endpoint".into())
            }
        }
        match (next, self.model.claims().is_exit()) {
            (None, true) => {
                *self.sink.lock().await = Some(Sink {
                    id,
                    tx: host_tx.clone(),
                    host: None,
                });
                tracing::info!("configured as exit stage: output goes to the gateway");
                Ok(Some(id))
            }
            (Some(ep), false) => {
                let ep: Endpoint = ep.parse()?;
                let check = |p: &PeerInfo| self.check_neighbour(p, 1);
                let (tx, rx) = self.dial(&ep, "next stage", &check).await?;
                let tx = Arc::new(Mutex::new(tx));
                *self.sink.lock().await = Some(Sink {
                    id,
                    tx,
                    host: Some(host_tx.clone()),
                });
                let this = self.clone();
                let next = ep.to_string();
                tokio::spawn(async move {
                    let mut rx = rx;
                    let r = rx.recv().await.map(|m| m.map(|b| b.len()));
                    this.downstream_lost(
                        id,
                        format!("next stage at {next} closed its channel ({r:?})"),
                    )
                    .await;
                });
                tracing::info!(next = %ep, "connected and attested the next stage");
                Ok(None)
            }
            (None, false) => Err("this stage is not the exit stage; it needs a next stage".into()),
            (Some(_), true) => Err("the exit stage has no next stage".into()),
        }
    }

    /// Opens, validates and tokenizes a sealed request, then hands its
    /// context and sequences to the compute thread. Errors after the body is
    /// open are sealed to the client.
    async fn accept_request(&self, req: SealedRequest) {
        let exit = self.model.claims().is_exit();
        let request_id = req.request_id;
        let (plaintext, key) = match self.open(&req) {
            Ok(v) => v,
            Err(e) => return self.emit(failure(exit, request_id, e)).await,
        };
        // The details (which may echo request content, e.g. a model name) go
        // only into the sealed body; the host sees the status and a generic line.
        let sealed_error = |api: ApiError, kind: ErrorKind| PipelineError {
            kind,
            status: api.status,
            message: format!(
                "request rejected with status {} (details sealed to the client)",
                api.status
            ),
            retry_after_secs: None,
            sealed_body: seal_response(&key, &api.body_bytes()).ok(),
        };
        if !self.model.serves(&req.endpoint) {
            let api = ApiError {
                status: 404,
                message: format!("This model does not serve {}.", req.endpoint),
                kind: "invalid_request_error".into(),
                param: None,
                code: Some("unknown_url".into()),
            };
            return self
                .emit(failure(
                    exit,
                    request_id,
                    sealed_error(api, ErrorKind::BadInput),
                ))
                .await;
        }
        let engine = match &self.model {
            StageModel::Embedding(e) => e.clone(),
            StageModel::Generation(g) => {
                return self
                    .accept_completion(g.clone(), req, plaintext, key.clone(), &sealed_error)
                    .await
            }
        };
        let parsed =
            parse_embeddings(&plaintext, self.max_inputs, engine.hidden_size()).and_then(|r| {
                if r.model == self.claims().model_id {
                    Ok(r)
                } else {
                    Err(ApiError::model_not_found(&r.model))
                }
            });
        let mut request = match parsed {
            Ok(r) => r,
            Err(api) => {
                return self
                    .emit(failure(
                        exit,
                        request_id,
                        sealed_error(api, ErrorKind::BadInput),
                    ))
                    .await
            }
        };
        let inputs = std::mem::take(&mut request.inputs);
        let n_inputs = inputs.len() as u32;
        let seqs = match self.tokenize(&engine, request_id, inputs).await {
            Ok(s) => s,
            Err(e) => {
                let api = ApiError::invalid(Some("input"), e);
                return self
                    .emit(failure(
                        exit,
                        request_id,
                        sealed_error(api, ErrorKind::BadInput),
                    ))
                    .await;
            }
        };
        let mut receipt_id = [0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut receipt_id);
        let ctx = RequestContext {
            env: envelope(req, receipt_id, &plaintext, key),
            request,
            n_inputs,
        };
        if self.work.send(Work::Begin(Box::new(ctx))).is_err()
            || self.work.send(Work::Seqs(seqs)).is_err()
        {
            tracing::error!("compute thread is gone");
        }
    }

    /// Validates and tokenizes a completions request, then hands it to the
    /// compute thread (which admits it by KV memory).
    async fn accept_completion(
        &self,
        model: Arc<GenModel>,
        req: SealedRequest,
        plaintext: Vec<u8>,
        key: ResponseKeyMaterial,
        sealed_error: &(dyn Fn(ApiError, ErrorKind) -> PipelineError + Send + Sync),
    ) {
        let request_id = req.request_id;
        match self.prepare_completion(model, req, &plaintext, key).await {
            Ok((ctx, prompts)) => {
                let work = Work::BeginGeneration {
                    ctx: Box::new(ctx),
                    prompts,
                };
                if self.work.send(work).is_err() {
                    tracing::error!("compute thread is gone");
                }
            }
            Err(api) => {
                let err = sealed_error(api, ErrorKind::BadInput);
                self.emit(failure(self.model.claims().is_exit(), request_id, err))
                    .await
            }
        }
    }

    /// Parses, checks and tokenizes a completions request: its context for
    /// later stages and its prompts' token ids.
    async fn prepare_completion(
        &self,
        model: Arc<GenModel>,
        req: SealedRequest,
        plaintext: &[u8],
        key: ResponseKeyMaterial,
    ) -> Result<(GenerationContext, Vec<Vec<u32>>), ApiError> {
        let cfg = &model.config;
        let vocab = cfg.vocab_size as u32;
        // A chat request becomes one text prompt: the model's chat template
        // over its messages, rendered here, inside the stage.
        let (mut request, default_limit) =
            if ApiEndpoint::from_path(&req.endpoint) == Some(ApiEndpoint::ChatCompletions) {
                let chat = parse_chat(plaintext, vocab, DEFAULT_CHAT_MAX_TOKENS)?;
                let template = model.chat_template.as_ref().ok_or_else(|| {
                    ApiError::invalid(
                        Some("messages"),
                        "This model has no chat template; use /v1/completions.",
                    )
                })?;
                let text = template
                    .render(&chat.messages)
                    .map_err(|e| ApiError::invalid(Some("messages"), e))?;
                let mut r = chat.request;
                r.prompts = vec![Prompt::Text(text)];
                (r, !chat.max_tokens_given)
            } else {
                (parse_completions(plaintext, vocab)?, false)
            };
        let prompt_param = match request.api {
            Api::Chat => "messages",
            Api::Completions => "prompt",
        };
        if request.model != self.claims().model_id {
            return Err(ApiError::model_not_found(&request.model));
        }
        let prompts = std::mem::take(&mut request.prompts);
        let total_bytes: usize = prompts
            .iter()
            .map(|p| match p {
                Prompt::Text(t) => t.len(),
                Prompt::Tokens(t) => t.len() * 4,
            })
            .sum();
        let m = model.clone();
        let ids = off_runtime_if_large(total_bytes, move || {
            prompts
                .into_iter()
                .enumerate()
                .map(|(i, p)| match p {
                    Prompt::Text(t) => m.tokenize(&t).map_err(|e| format!("prompt {i}: {e}")),
                    Prompt::Tokens(ids) => Ok(ids),
                })
                .collect::<Result<Vec<_>, String>>()
        })
        .await
        .map_err(|e| ApiError::invalid(Some(prompt_param), e))?;
        if default_limit {
            // No limit from the client: answer up to the default, or to
            // what the context leaves.
            let longest = ids.iter().map(Vec::len).max().unwrap_or(0);
            let left = cfg.max_seq_len.saturating_sub(longest).max(1);
            request.max_tokens = request.max_tokens.min(left as u32);
        }
        let context = cfg.max_seq_len;
        for p in &ids {
            if p.is_empty() {
                return Err(ApiError::invalid(
                    Some(prompt_param),
                    "A prompt is empty (no tokens).",
                ));
            }
            if p.len() + request.max_tokens as usize > context {
                let mut e = context_length_error(context, p.len(), request.max_tokens);
                e.param = Some(prompt_param.into());
                return Err(e);
            }
        }
        let mut receipt_id = [0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut receipt_id);
        let seed = request.seed.unwrap_or_else(|| rand::rngs::OsRng.next_u64());
        let echo = request.echo;
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let ctx = GenerationContext {
            env: envelope(req, receipt_id, plaintext, key),
            request,
            prompts: ids
                .iter()
                .map(|p| PromptInfo {
                    tokens: p.len() as u32,
                    ids: echo.then(|| p.clone()),
                })
                .collect(),
            seed,
            created,
        };
        Ok((ctx, ids))
    }

    /// Checks the key id, refuses replays, and opens the body.
    fn open(&self, req: &SealedRequest) -> Result<(Vec<u8>, ResponseKeyMaterial), PipelineError> {
        let sealing_error = |status: u16, message: String| PipelineError {
            kind: ErrorKind::Sealing,
            status,
            message,
            retry_after_secs: None,
            sealed_body: None,
        };
        let key = self
            .keys
            .hpke
            .as_ref()
            .filter(|k| k.key_id() == req.headers.key_id)
            .ok_or_else(|| {
                sealing_error(
                    400,
                    format!(
                        "{}; fetch the current keys from /.well-known/hpke-keys",
                        SealError::UnknownKeyId(req.headers.key_id)
                    ),
                )
            })?;
        let (plaintext, material) = open_request(key, &req.headers, &req.body)
            .map_err(|e| sealing_error(400, format!("the sealed request cannot be opened: {e}")))?;
        // Only an authenticated body counts against the replay window.
        let mut guards = self.replay.lock().expect("replay guard lock");
        let guard = match req.sealing {
            Sealing::Enclave => &mut guards.client,
            Sealing::Gateway | Sealing::Plain => &mut guards.host,
        };
        let now = Instant::now();
        guard
            .check_and_insert(&req.headers.enc, now)
            .map_err(|e| replay_refusal(e, guard.retry_after(now)))?;
        Ok((plaintext, material))
    }

    async fn tokenize(
        &self,
        engine: &Arc<Engine>,
        request_id: u64,
        inputs: Vec<String>,
    ) -> Result<Vec<Seq>, String> {
        let total_bytes: usize = inputs.iter().map(|t| t.len()).sum();
        let engine = engine.clone();
        let tokenize = move || {
            inputs
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let ids = engine.tokenize(t).map_err(|e| format!("input {i}: {e}"))?;
                    Ok(Seq {
                        item: BatchItem {
                            request_id,
                            index: i as u32,
                            tokens: ids.len() as u32,
                        },
                        ids,
                    })
                })
                .collect::<Result<Vec<_>, String>>()
        };
        off_runtime_if_large(total_bytes, tokenize).await
    }

    /// Entry stage of a generation pipeline: sampled tokens from the exit stage.
    async fn feedback_session(&self, mut rx: ChannelReceiver) {
        loop {
            match rx.recv_msg::<FeedbackMessage>().await {
                Ok(Some(m)) => {
                    if self.work.send(Work::Feedback(m)).is_err() {
                        tracing::error!("compute thread is gone");
                        return;
                    }
                }
                Ok(None) => {
                    tracing::info!("exit stage closed the feedback channel");
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "feedback channel error");
                    return;
                }
            }
        }
    }

    async fn upstream_session(&self, mut rx: ChannelReceiver) {
        loop {
            let work = match rx.recv_msg::<ActivationMessage>().await {
                Ok(Some(ActivationMessage::Begin(ctx))) => Work::Begin(ctx),
                Ok(Some(m @ ActivationMessage::BeginGeneration(_)))
                | Ok(Some(m @ ActivationMessage::Step(_))) => Work::Activation(m),
                Ok(Some(ActivationMessage::Batch(b))) => Work::Batch(b),
                Ok(Some(ActivationMessage::Links {
                    request_id,
                    links,
                    timings,
                })) => Work::Links {
                    request_id,
                    links: links.into_iter().map(|l| l.into_vec()).collect(),
                    timings,
                },
                Ok(Some(ActivationMessage::Failed { request_id, error })) => {
                    Work::Failed { request_id, error }
                }
                Ok(None) => {
                    tracing::info!("upstream stage closed the channel");
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "upstream channel error");
                    return;
                }
            };
            if self.work.send(work).is_err() {
                tracing::error!("compute thread is gone");
                return;
            }
        }
    }

    async fn emit(&self, o: Output) {
        let _ = self.out.send(o).await;
    }

    /// Drops sink `id` (if still current) and tells the host that set it up.
    async fn downstream_lost(&self, id: u64, reason: String) {
        let sink = {
            let mut s = self.sink.lock().await;
            if s.as_ref().map(|s| s.id) != Some(id) {
                return;
            }
            s.take()
        };
        tracing::warn!(reason = %reason, "downstream lost");
        if let Some(host) = sink.and_then(|s| s.host) {
            let _ = host
                .lock()
                .await
                .send_msg(&StageReply::DownstreamLost(reason))
                .await;
        }
    }

    /// Sends compute output to the current sink, forever.
    pub async fn write_outputs(self: Arc<Self>, mut rx: mpsc::Receiver<Output>) {
        while let Some(o) = rx.recv().await {
            let bytes = match o {
                Output::Activation(m) => proto::cbor::to_vec(&m),
                Output::Result(m) => proto::cbor::to_vec(&StageReply::Result(m)),
                Output::Feedback(m) => {
                    let fb = self.feedback.lock().await.clone();
                    match fb {
                        Some(tx) => {
                            if let Err(e) = tx.lock().await.send_msg(&m).await {
                                tracing::warn!(error = %e, "feedback channel to the entry stage failed");
                                *self.feedback.lock().await = None;
                            }
                        }
                        None => tracing::warn!("no feedback channel; dropping sampled tokens"),
                    }
                    continue;
                }
            };
            let sink = self
                .sink
                .lock()
                .await
                .as_ref()
                .map(|s| (s.id, s.tx.clone()));
            let Some((id, tx)) = sink else {
                tracing::warn!("no downstream configured; dropping a micro-batch output");
                continue;
            };
            let r = tx.lock().await.send(&bytes).await;
            if let Err(e) = r {
                self.downstream_lost(id, format!("sending downstream failed: {e}"))
                    .await;
            }
        }
    }
}

/// Runs tokenizer work `f` over `bytes` of text: small inputs tokenize in
/// microseconds, so inline rather than pay a thread hand-off; large ones go
/// to the blocking pool so they never stall the runtime.
async fn off_runtime_if_large<T: Send + 'static>(
    bytes: usize,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> Result<T, String> {
    if bytes <= INLINE_TOKENIZE_BYTES {
        f()
    } else {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| format!("tokenizer task failed: {e}"))?
    }
}

/// The two partitions of the replay guard.
struct ReplayGuards {
    /// Requests clients sealed to the enclave key.
    client: ReplayGuard,
    /// Requests the host says it sealed.
    host: ReplayGuard,
}

/// The answer to a request the replay guard refused: a replay is a 400; a
/// full guard is a 503 with `Retry-After` (when its oldest entry leaves the
/// window), so clients retry instead of failing.
fn replay_refusal(e: SealError, retry_after: Duration) -> PipelineError {
    let (status, retry_after_secs) = match e {
        SealError::ReplayCacheFull => (503, Some(retry_after.as_secs().max(1) as u32)),
        _ => (400, None),
    };
    PipelineError {
        kind: ErrorKind::Sealing,
        status,
        message: match retry_after_secs {
            Some(s) => format!("refused: {e}; retry in {s} s"),
            None => format!("refused: {e}"),
        },
        retry_after_secs,
        sealed_body: None,
    }
}

/// The envelope of an opened request: its ids, the digest of its exact
/// plaintext, the client's nonce, how and with which key it was sealed, and
/// the key that seals the answer.
fn envelope(
    req: SealedRequest,
    receipt_id: ReceiptId,
    plaintext: &[u8],
    response_key: ResponseKeyMaterial,
) -> Envelope {
    Envelope {
        request_id: req.request_id,
        receipt_id,
        endpoint: req.endpoint,
        request_digest: Sha256Digest::of(plaintext),
        client_nonce: req.client_nonce,
        sealing: req.sealing,
        opened: OpenedKey::of(req.headers.key_id, &req.headers.enc),
        response_key,
        trace: req.trace,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_replay_guard_asks_to_retry() {
        let full = replay_refusal(SealError::ReplayCacheFull, Duration::from_millis(2500));
        assert_eq!((full.status, full.retry_after_secs), (503, Some(2)));
        assert!(full.message.contains("retry in 2 s"), "{}", full.message);
        let soon = replay_refusal(SealError::ReplayCacheFull, Duration::ZERO);
        assert_eq!(soon.retry_after_secs, Some(1));
        let replay = replay_refusal(SealError::Replay, Duration::from_secs(9));
        assert_eq!((replay.status, replay.retry_after_secs), (400, None));
    }
}
