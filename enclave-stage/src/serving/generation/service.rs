//! The generation model as a stage serves it: the start of its compute
//! thread ([`LoadedModel`]) and the entry stage's admission of a request
//! ([`ServedModel`]: a chat's template rendered, the prompts checked
//! against the context and tokenized, a grammar compiled once to refuse a
//! bad one before any model work).

use super::compute::{GenLimits, Generator};
use super::model::GenModel;
use crate::model::{
    spawn_compute, Admission, ComputeSetup, LoadedModel, OpenedRequest, Pending, Refusal,
    ServedModel, StageModel,
};
use crate::work::Work;
use anyhow::{Context, Result};
use proto::chat::{generic_messages, parse_chat};
use proto::completions::{context_length_error, parse_completions, Api, Prompt};
use proto::frames::{GenerationContext, PromptInfo, StageClaims};
use proto::manifest::LoadedManifest;
use proto::openai::{ApiEndpoint, ApiError};
use rand::RngCore;
use std::sync::Arc;

/// Most tokens a chat answer may take when the client sets no limit (less
/// where the context ends first). Admission reserves KV-cache room for the
/// whole limit, so "up to the context" would let one chat hold the budget.
pub const DEFAULT_CHAT_MAX_TOKENS: u32 = 1024;

/// Bytes of prompt text per context token past which a prompt is refused
/// untokenized: tokens of ordinary text are far shorter.
const MAX_BYTES_PER_TOKEN: usize = 32;

impl LoadedModel for GenModel {
    fn manifest_and_claims(&mut self) -> (&LoadedManifest, &mut StageClaims) {
        (&self.manifest, &mut self.claims)
    }

    fn start(self: Box<Self>, setup: ComputeSetup) -> Result<StageModel> {
        let part = self.load_part().context("loading the weights")?;
        tracing::info!(
            weights = %part.format(),
            weight_mib = part.weight_bytes() >> 20,
            "weights loaded"
        );
        let l = setup.limits;
        tracing::info!(
            kv_cache_tokens = l.kv_cache_tokens,
            kv_cache_mib = (l.kv_cache_tokens * part.bytes_per_token()) >> 20,
            "KV-cache budget"
        );
        let model = Arc::new(*self);
        let limits = GenLimits {
            kv_tokens: l.kv_cache_tokens,
            step_tokens: l.token_budget,
            max_step_seqs: l.max_step_seqs,
            max_waiting: l.max_waiting,
        };
        let gen = Generator::new(model.clone(), part, setup.keys, setup.out, limits);
        let work = setup.work;
        spawn_compute(move || gen.run(work))?;
        Ok(Arc::new(Generation(model)))
    }
}

/// A serving generation stage.
struct Generation(Arc<GenModel>);

impl ServedModel for Generation {
    fn claims(&self) -> &StageClaims {
        &self.0.claims
    }

    fn serves(&self, endpoint: ApiEndpoint) -> bool {
        endpoint.is_generation()
    }

    fn has_feedback(&self) -> bool {
        true
    }

    fn admit<'a>(&'a self, request: OpenedRequest<'a>) -> Pending<'a, Result<Admission, Refusal>> {
        // Template render, tokenization and the grammar compile are CPU
        // work of a size the client chooses: on the blocking pool, so the
        // stage's runtime thread keeps moving everyone else's messages.
        let model = self.0.clone();
        let endpoint = request.endpoint;
        let plaintext = request.plaintext.to_vec();
        Box::pin(async move {
            let (request, prompts) =
                tokio::task::spawn_blocking(move || prepare(&model, endpoint, &plaintext))
                    .await
                    .map_err(|_| ApiError::internal("the request could not be prepared"))??;
            Ok(Admission {
                work: Box::new(move |env| vec![work(env, request, prompts)]),
                release: None,
            })
        })
    }
}

/// The compute thread's work for an admitted request: its context for
/// later stages and its prompts' token ids.
fn work(
    env: proto::frames::Envelope,
    request: proto::completions::CompletionsRequest,
    prompts: Vec<Vec<u32>>,
) -> Work {
    let seed = request.seed.unwrap_or_else(|| rand::rngs::OsRng.next_u64());
    let echo = request.echo;
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let ctx = GenerationContext {
        env,
        request,
        prompts: prompts
            .iter()
            .map(|p| PromptInfo {
                tokens: p.len() as u32,
                ids: echo.then(|| p.clone()),
            })
            .collect(),
        seed,
        created,
        feedback_key: proto::feedback::FeedbackKey::random(),
    };
    Work::BeginGeneration {
        ctx: Box::new(ctx),
        prompts,
    }
}

/// Parses, checks and tokenizes a completions or chat request: the request
/// (its prompts taken out) and its prompts' token ids.
fn prepare(
    model: &GenModel,
    endpoint: ApiEndpoint,
    plaintext: &[u8],
) -> Result<(proto::completions::CompletionsRequest, Vec<Vec<u32>>), ApiError> {
    let cfg = &model.config;
    let vocab = cfg.vocab_size as u32;
    // A chat request becomes one text prompt: the model's chat template
    // over its messages, rendered here, inside the stage.
    let (mut request, default_limit) = if endpoint == ApiEndpoint::ChatCompletions {
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
    if request.model != model.claims.model_id {
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
    // A raw prompt gets the BOS the model's tokenizer adds; a rendered
    // chat's template wrote its own.
    let raw = request.api == Api::Completions;
    let ids = prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| match p {
            Prompt::Text(t) => model
                .tokenize(&t, raw)
                .map_err(|e| format!("prompt {i}: {e}")),
            Prompt::Tokens(ids) => Ok(ids),
        })
        .collect::<Result<Vec<_>, String>>()
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
        match model.grammars.as_ref() {
            Some(g) => g.check(&request)?,
            None => {
                return Err(ApiError::invalid(
                    Some("response_format"),
                    "This model has no end-of-sequence token, so no grammar can end.",
                ))
            }
        }
    }
    Ok((request, ids))
}
