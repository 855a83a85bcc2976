//! Requests from the host (entry stage): the key id, the replay guard and
//! the opening of the sealed body, then validation (embeddings, completions,
//! chat with its template), tokenization and the request's envelope, handed
//! to the compute thread; errors after the body opened are sealed to the
//! client.

use super::{StageServer, DEFAULT_CHAT_MAX_TOKENS};
use crate::model::StageModel;
use crate::serving::embedding::batcher::Seq;
use crate::serving::embedding::compute::{admit_rows, rows_left};
use crate::serving::embedding::engine::Engine;
use crate::serving::generation::model::GenModel;
use crate::work::{failure, Work};
use proto::chat::{generic_messages, parse_chat};
use proto::completions::{context_length_error, parse_completions, Api, Prompt};
use proto::digest::Sha256Digest;
use proto::frames::{
    BatchItem, Envelope, ErrorKind, GenerationContext, PipelineError, PromptInfo, RequestContext,
    SealedRequest,
};
use proto::openai::{parse_embeddings, ApiEndpoint, ApiError};
use proto::receipt::{OpenedKey, ReceiptId, Sealing};
use proto::sealing::{open_request, seal_response, ReplayGuard, ResponseKeyMaterial, SealError};
use rand::RngCore;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How many full-size embeddings requests' rows (`max_inputs` each) the
/// entry stage queues before it answers 503 + `Retry-After`.
const QUEUED_REQUESTS: usize = 4;
/// Bytes of prompt text per context token past which a prompt is refused
/// untokenized: tokens of ordinary text are far shorter.
const MAX_BYTES_PER_TOKEN: usize = 32;

impl StageServer {
    /// Opens, validates and tokenizes a sealed request, then hands its
    /// context and sequences to the compute thread. Errors after the body is
    /// open are sealed to the client.
    /// `epoch` is the configuration epoch of the host channel it came on.
    pub(super) async fn accept_request(&self, req: SealedRequest, epoch: u64) {
        let exit = self.model.claims().is_exit();
        let request_id = req.request_id;
        let (plaintext, key) = match self.open(&req) {
            Ok(v) => v,
            Err(e) => return self.gate.emit(failure(exit, request_id, e)).await,
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
        let reject =
            |api: ApiError| failure(exit, request_id, sealed_error(api, ErrorKind::BadInput));
        if !self.model.serves(&req.endpoint) {
            let api = ApiError {
                status: 404,
                message: format!("This model does not serve {}.", req.endpoint),
                kind: "invalid_request_error".into(),
                param: None,
                code: Some("unknown_url".into()),
            };
            return self.gate.emit(reject(api)).await;
        }
        let engine = match &self.model {
            StageModel::Embedding(e) => e.clone(),
            StageModel::Generation(g) => {
                return self
                    .accept_completion(g.clone(), req, plaintext, key.clone(), epoch, &sealed_error)
                    .await
            }
        };
        let parsed =
            parse_embeddings(&plaintext, self.max_inputs, engine.hidden_size()).and_then(|r| {
                if r.model == self.model.claims().model_id {
                    Ok(r)
                } else {
                    Err(ApiError::model_not_found(&r.model))
                }
            });
        let mut request = match parsed {
            Ok(r) => r,
            Err(api) => return self.gate.emit(reject(api)).await,
        };
        let inputs = std::mem::take(&mut request.inputs);
        let n_inputs = inputs.len() as u32;
        let seqs = match self.tokenize(&engine, request_id, inputs).await {
            Ok(s) => s,
            Err(e) => {
                return self
                    .gate
                    .emit(reject(ApiError::invalid(Some("input"), e)))
                    .await;
            }
        };
        // A bounded queue: past it, 503 and retry (before the replay guard
        // remembers the request, so the client's retry is not a replay).
        let rows = seqs.len();
        if !admit_rows(rows, self.max_inputs * QUEUED_REQUESTS) {
            let api = ApiError {
                status: 503,
                message: "The server is at capacity for embeddings; retry shortly.".into(),
                kind: "server_error".into(),
                param: None,
                code: Some("overloaded".into()),
            };
            let mut err = sealed_error(api, ErrorKind::BadInput);
            err.retry_after_secs = Some(1);
            return self.gate.emit(failure(exit, request_id, err)).await;
        }
        if let Err(e) = self.record_replay(&req) {
            rows_left(rows);
            return self.gate.emit(failure(exit, request_id, e)).await;
        }
        let mut receipt_id = [0u8; 16];
        rand::rngs::OsRng.fill_bytes(&mut receipt_id);
        let ctx = RequestContext {
            env: envelope(req, receipt_id, &plaintext, key),
            request,
            n_inputs,
        };
        if !self
            .gate
            .submit(epoch, [Work::Begin(Box::new(ctx)), Work::Seqs(seqs)])
        {
            rows_left(rows);
            tracing::info!("a request outlived its pipeline; dropped");
        }
    }

    /// Validates and tokenizes a completions request, then hands it to the
    /// compute thread (which admits it by KV memory).
    pub(super) async fn accept_completion(
        &self,
        model: Arc<GenModel>,
        req: SealedRequest,
        plaintext: Vec<u8>,
        key: ResponseKeyMaterial,
        epoch: u64,
        sealed_error: &(dyn Fn(ApiError, ErrorKind) -> PipelineError + Send + Sync),
    ) {
        let request_id = req.request_id;
        let replay = (req.headers.clone(), req.sealing);
        let prepared = self
            .prepare_completion(model, req, &plaintext, key)
            .await
            .map_err(|api| sealed_error(api, ErrorKind::BadInput))
            .and_then(|p| self.record_replay_of(&replay.0, replay.1).map(|()| p));
        match prepared {
            Ok((ctx, prompts)) => {
                let work = Work::BeginGeneration {
                    ctx: Box::new(ctx),
                    prompts,
                };
                if !self.gate.submit(epoch, [work]) {
                    tracing::info!("a request outlived its pipeline; dropped");
                }
            }
            Err(err) => {
                self.gate
                    .emit(failure(self.model.claims().is_exit(), request_id, err))
                    .await
            }
        }
    }

    /// Parses, checks and tokenizes a completions request: its context for
    /// later stages and its prompts' token ids.
    pub(super) async fn prepare_completion(
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
                // A template that takes tools gets them its own way; any
                // other, the generic convention (`proto::tools`).
                let text = if template.takes_tools() {
                    template.render(&chat.messages, &chat.tools)
                } else {
                    template.render(&generic_messages(&chat.messages, &chat.tools), &[])
                }
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
        if request.model != self.model.claims().model_id {
            return Err(ApiError::model_not_found(&request.model));
        }
        let prompts = std::mem::take(&mut request.prompts);
        // Text that cannot fit the context is refused before it is
        // tokenized (bounding the tokenizer's work, whatever the body size).
        let max_bytes = cfg.max_seq_len * MAX_BYTES_PER_TOKEN;
        if let Some(n) = prompts.iter().find_map(|p| match p {
            Prompt::Text(t) if t.len() > max_bytes => Some(t.len()),
            _ => None,
        }) {
            return Err(ApiError {
                code: Some("context_length_exceeded".into()),
                ..ApiError::invalid(
                    Some(prompt_param),
                    format!(
                        "The prompt is {n} bytes of text; at most {max_bytes} bytes are taken \
                         for this model's {}-token context. Please reduce your prompt.",
                        cfg.max_seq_len
                    ),
                )
            });
        }
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
        // A grammar that does not compile is refused here, after the cheap
        // checks and before any model work (compiling is bounded by the
        // engine's fuel; off the runtime).
        if request.constrained() {
            let m = model.clone();
            let r = request.clone();
            tokio::task::spawn_blocking(move || match m.grammars.as_ref() {
                Some(g) => g.check(&r),
                None => Err(ApiError::invalid(
                    Some("response_format"),
                    "This model has no end-of-sequence token, so no grammar can end.",
                )),
            })
            .await
            .map_err(|e| {
                ApiError::invalid(Some("response_format"), format!("grammar task: {e}"))
            })??;
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

    /// Refuses a replay of a request that opened and validated (only such
    /// a request is remembered, so garbage cannot fill the guard). The
    /// partition it is remembered in follows the host's `sealing` label,
    /// which the stage cannot verify, so a replay is looked for in both:
    /// relabelling a client's request does not let it through again.
    pub(super) fn record_replay(&self, req: &SealedRequest) -> Result<(), PipelineError> {
        self.record_replay_of(&req.headers, req.sealing)
    }

    fn record_replay_of(
        &self,
        headers: &proto::sealing::SealedHeaders,
        sealing: Sealing,
    ) -> Result<(), PipelineError> {
        let enc = &headers.enc;
        let mut guards = self.replay.lock().expect("replay guard lock");
        let ReplayGuards { client, host } = &mut *guards;
        let (guard, other) = match sealing {
            Sealing::Enclave => (client, host),
            Sealing::Gateway | Sealing::Plain => (host, client),
        };
        let now = Instant::now();
        // Fresh at the moment it is recorded (validation took time since
        // `open`): the guard then outlasts every moment it is fresh.
        proto::sealing::check_fresh(headers, proto::sealing::unix_now())
            .map_err(|e| replay_refusal(e, Duration::ZERO))?;
        if other.contains(enc, now) {
            return Err(replay_refusal(SealError::Replay, Duration::ZERO));
        }
        guard
            .check_and_insert(enc, now)
            .map_err(|e| replay_refusal(e, guard.retry_after(now)))
    }

    /// Checks the key id, opens the body and checks its sealing time
    /// (replays are refused once it validated: [`Self::record_replay`]).
    pub(super) fn open(
        &self,
        req: &SealedRequest,
    ) -> Result<(Vec<u8>, ResponseKeyMaterial), PipelineError> {
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
            .and_then(|k| k.get(req.headers.key_id))
            .ok_or_else(|| PipelineError {
                kind: ErrorKind::UnknownKey,
                ..sealing_error(
                    400,
                    format!(
                        "{}; fetch the current keys from /.well-known/hpke-keys",
                        SealError::UnknownKeyId(req.headers.key_id)
                    ),
                )
            })?;
        let (plaintext, material) = open_request(&key, &req.headers, &req.body)
            .map_err(|e| sealing_error(400, format!("the sealed request cannot be opened: {e}")))?;
        // Its sealing time opened with it (bound in the HPKE info): an old
        // request is refused outright, so no replay outlives the guard.
        proto::sealing::check_fresh(&req.headers, proto::sealing::unix_now()).map_err(|e| {
            PipelineError {
                kind: ErrorKind::Stale,
                ..sealing_error(400, format!("the sealed request is refused: {e}"))
            }
        })?;
        Ok((plaintext, material))
    }

    pub(super) async fn tokenize(
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
}

/// The two partitions of the replay guard.
pub(super) struct ReplayGuards {
    /// Requests clients sealed to the enclave key.
    pub(super) client: ReplayGuard,
    /// Requests the host says it sealed.
    pub(super) host: ReplayGuard,
}

/// The answer to a request the replay guard refused: a replay is a 400; a
/// full guard is a 503 with `Retry-After` (when its oldest entry leaves the
/// window), so clients retry instead of failing.
pub(super) fn replay_refusal(e: SealError, retry_after: Duration) -> PipelineError {
    let (status, retry_after_secs) = match e {
        SealError::ReplayCacheFull => (503, Some(retry_after.as_secs().max(1) as u32)),
        _ => (400, None),
    };
    PipelineError {
        kind: match e {
            SealError::Stale { .. } => ErrorKind::Stale,
            _ => ErrorKind::Sealing,
        },
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
pub(super) fn envelope(
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
        digest_salt: {
            let mut salt = [0u8; 32];
            rand::rngs::OsRng.fill_bytes(&mut salt);
            salt
        },
        client_nonce: req.client_nonce,
        sealing: req.sealing,
        opened: OpenedKey::of(req.headers.key_id, &req.headers.enc),
        response_key,
        trace: req.trace,
    }
}

/// Requests with at most this many bytes of text are tokenized inline.
const INLINE_TOKENIZE_BYTES: usize = 2048;

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
