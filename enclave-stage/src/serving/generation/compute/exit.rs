//! The exit stage's side of a generation request: its per-choice output
//! state and stream, and finishing (the response or the stream's tail, the
//! receipt over the exact bytes, sealed to the client).

use super::{combine, GenRequest, Generator};
use crate::sampling::SamplingParams;
use crate::serving::generation::grammar::grammar_text;
use crate::serving::generation::output::{ChoiceOut, ChoiceRules};
use crate::work::{failure, Output};
use anyhow::{anyhow, Result};
use proto::chat::{chat_chunk_event, chat_completion_id, Delta};
use proto::completions::{
    completion_id, stream_text_event, stream_usage_event, Api, Choice, FinishReason,
    StreamIdentity, Usage, STREAM_DONE,
};
use proto::frames::{
    ErrorKind, GenerationContext, PipelineError, RequestTelemetry, ResultMessage, StageTiming,
};
use proto::sealing::{seal_response_with_trailer, ResponseSealer};
use proto::tools::{parse_calls, undecided, CallStream, CALL_TAG};

/// The response `id`: `cmpl-…` or `chatcmpl-…` and the receipt id.
pub(super) fn response_id(api: Api, receipt_id: &[u8; 16]) -> String {
    match api {
        Api::Completions => completion_id(receipt_id),
        Api::Chat => chat_completion_id(receipt_id),
    }
}

/// Whether a streamed chat choice with tools is an answer or calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Its start could still be either (nothing but role sent yet).
    Undecided,
    /// Text: content deltas.
    Content,
    /// Tool calls: tool-call deltas.
    Calls,
}

pub(super) struct Streaming {
    identity: StreamIdentity,
    pub(super) sealer: ResponseSealer,
    /// Every plaintext byte of the event stream so far (the receipt binds it).
    pub(super) bytes: Vec<u8>,
    /// Per choice: whether its first chat chunk (the role) has gone out.
    started: Vec<bool>,
    /// The response's receipt id (tool-call ids derive from it).
    receipt_id: [u8; 16],
    /// Per choice, with tools: what it is, and its calls sent so far.
    calls: Option<Vec<(Kind, CallStream)>>,
    /// Events not sealed yet (`stream_options.coalesce_ms`).
    pending: Vec<u8>,
    /// The time slice events are held for; zero: sealed every step.
    slice: std::time::Duration,
    /// When the last chunk was sealed (none yet: the first goes at once).
    sealed_at: Option<std::time::Instant>,
}

impl Streaming {
    /// Takes a step's events: the bytes to seal now as one chunk, if their
    /// time slice is over (the first chunk and every chunk without
    /// coalescing go at once); else they wait for a later step or the end.
    pub(super) fn take_chunk(
        &mut self,
        events: Vec<u8>,
        now: std::time::Instant,
    ) -> Option<Vec<u8>> {
        self.bytes.extend_from_slice(&events);
        self.pending.extend(events);
        let due = self
            .sealed_at
            .is_none_or(|t| now.duration_since(t) >= self.slice);
        if !due || self.pending.is_empty() {
            return None;
        }
        self.sealed_at = Some(now);
        Some(std::mem::take(&mut self.pending))
    }

    /// The events still held back, to go before the stream's last ones.
    pub(super) fn take_pending(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.pending)
    }

    /// The events for `choice` after a step: its new text (or tool-call
    /// pieces) and, on its last step, why it ended. Chat sends the role
    /// first, then content or calls, then an empty delta with the finish
    /// reason.
    pub(super) fn events(&mut self, choice: &mut ChoiceOut, stop: &[String]) -> Vec<u8> {
        let index = choice.index();
        let finish = choice.finish();
        let id = &self.identity;
        let mut out = Vec::new();
        match id.api {
            Api::Completions => {
                let text = choice.take_stream_text(stop);
                if !text.is_empty() || finish.is_some() {
                    out = stream_text_event(id, index, &text, finish);
                }
            }
            Api::Chat => {
                if let Some(started) = self.started.get_mut(index as usize) {
                    if !*started {
                        *started = true;
                        out.extend(chat_chunk_event(id, index, Delta::Role));
                    }
                }
                let kind = match self.calls.as_mut().and_then(|c| c.get_mut(index as usize)) {
                    None => Kind::Content,
                    Some((kind, calls)) => {
                        // Only text no stop sequence can still cut decides.
                        let text = choice.stable_text(stop);
                        let done = finish.is_some();
                        if *kind == Kind::Undecided && (done || !undecided(text)) {
                            *kind = match text.starts_with(CALL_TAG) {
                                true => Kind::Calls,
                                false => Kind::Content,
                            };
                        }
                        if *kind == Kind::Calls {
                            for d in calls.deltas(text, done, &self.receipt_id, index) {
                                out.extend(chat_chunk_event(id, index, Delta::ToolCall(&d)));
                            }
                            // Ended without one named call: the answer is
                            // its text after all, as the whole answer reads.
                            if done && !calls.started() {
                                *kind = Kind::Content;
                            }
                        }
                        *kind
                    }
                };
                if kind == Kind::Content {
                    let text = choice.take_stream_text(stop);
                    if !text.is_empty() {
                        out.extend(chat_chunk_event(id, index, Delta::Content(&text)));
                    }
                }
                if let Some(f) = finish {
                    let f = finish_reason(f, kind == Kind::Calls);
                    out.extend(chat_chunk_event(id, index, Delta::Finish(f)));
                }
            }
        }
        out
    }
}

/// Why an answer ended, as the API says it: an answer that is tool calls
/// and ended on its own ends with `tool_calls`.
fn finish_reason(f: FinishReason, calls: bool) -> FinishReason {
    match f {
        FinishReason::Stop if calls => FinishReason::ToolCalls,
        f => f,
    }
}

/// A finished choice as the API returns it: with tools, an answer that is
/// calls carries them instead of text.
fn answer(c: ChoiceOut, tools: bool, receipt_id: &[u8; 16]) -> Choice {
    let mut choice = c.into_choice();
    if tools {
        if let Some(calls) = parse_calls(&choice.text, receipt_id, choice.index) {
            choice.text.clear();
            choice.tool_calls = calls;
            choice.finish_reason = finish_reason(choice.finish_reason, true);
        }
    }
    choice
}

/// Why the exit stage cannot take a request on.
#[derive(Debug)]
pub(super) enum ExitSetupError {
    /// The response key is unusable.
    Key(proto::sealing::SealError),
    /// The answer's grammar does not compile here.
    Grammar,
}

pub(super) struct ExitState {
    pub(super) rules: ChoiceRules,
    pub(super) choices: Vec<ChoiceOut>,
    pub(super) stream: Option<Streaming>,
    prompt_tokens: u64,
    pub(super) finished: usize,
    /// Unix ns when this request's first token was sampled.
    pub(super) first_token_unix_ns: Option<u64>,
}

impl Generator {
    pub(super) fn exit_state(&self, ctx: &GenerationContext) -> Result<ExitState, ExitSetupError> {
        let r = &ctx.request;
        let cfg = &self.model.config;
        let tok = self.model.tokenizer.as_ref();
        let params = SamplingParams {
            temperature: r.temperature,
            top_p: r.top_p,
            seed: ctx.seed,
        };
        let n = r.n.max(1) as usize;
        // One compile per request; each choice gets its own copy.
        let grammar = match (grammar_text(r), self.model.grammars.as_ref()) {
            (None, _) => None,
            (Some(g), Some(grammars)) => {
                Some(grammars.matcher(&g).map_err(|_| ExitSetupError::Grammar)?)
            }
            (Some(_), None) => return Err(ExitSetupError::Grammar),
        };
        let mut choices = Vec::new();
        let mut prompt_tokens = 0u64;
        for (pi, p) in ctx.prompts.iter().enumerate() {
            let prefix = match (&p.ids, tok) {
                (Some(ids), Some(t)) if r.echo => {
                    crate::serving::generation::output::Detokenize::text(t, ids)
                }
                _ => String::new(),
            };
            prompt_tokens += p.tokens as u64;
            for j in 0..n {
                let index = (pi * n + j) as u32;
                let mut c = ChoiceOut::new(
                    index,
                    params,
                    index as u64,
                    p.tokens as usize,
                    prefix.clone(),
                    r.logprobs.is_some(),
                );
                if let Some(g) = &grammar {
                    // Clones share the compiled lexer's cache (one thread).
                    c.constrain(g.clone());
                }
                choices.push(c);
            }
        }
        let stream = match r.stream {
            true => Some(Streaming {
                identity: StreamIdentity {
                    id: response_id(r.api, &ctx.env.receipt_id),
                    created: ctx.created,
                    model: self.model.claims.model_id.clone(),
                    include_usage: r.include_usage,
                    api: r.api,
                },
                sealer: ResponseSealer::new(&ctx.env.response_key).map_err(ExitSetupError::Key)?,
                bytes: Vec::new(),
                started: vec![false; choices.len()],
                receipt_id: ctx.env.receipt_id,
                calls: r
                    .tool_calls
                    .as_ref()
                    .map(|_| vec![(Kind::Undecided, CallStream::default()); choices.len()]),
                pending: Vec::new(),
                slice: std::time::Duration::from_millis(r.coalesce_ms.into()),
                sealed_at: None,
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
}

impl Generator {
    pub(super) fn upstream_links(
        &mut self,
        request_id: u64,
        links: Vec<Vec<u8>>,
        timings: Vec<StageTiming>,
        signer: [u8; 32],
    ) {
        let exit = self.is_exit();
        let Some(r) = self.requests.get_mut(&request_id) else {
            return;
        };
        r.upstream_links = Some(links);
        r.upstream_signer = Some(signer);
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
    pub(super) fn try_finish(&mut self, request_id: u64) {
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

    pub(super) fn finish(&self, r: GenRequest) -> Result<Output> {
        let c = &self.model.claims;
        let upstream = r.upstream_links.clone().unwrap_or_default();
        let mut timings = r.upstream_timings.clone();
        timings.push(r.timer.finish(c.stage_index));
        let link = crate::receipt_link::link(
            c,
            &self.keys,
            &r.ctx.env,
            &upstream,
            r.upstream_signer.as_ref(),
            || Ok::<_, anyhow::Error>(combine(&r.received)),
            combine(&r.sent),
            |why| anyhow!("receipt chain refused, nothing signed: {why}"),
        )?;
        if !self.is_exit() {
            return Ok(Output::Activation(crate::receipt_link::pass_on(
                &self.keys, &r.ctx.env, &link, upstream, timings,
            )));
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
        }
        .for_host(r.ctx.env.sealing);
        let (body, stream) = match ex.stream {
            Some(mut st) => {
                // Events held for their time slice go out with the last ones.
                let mut tail = st.take_pending();
                if st.identity.include_usage {
                    tail.extend(stream_usage_event(&st.identity, usage));
                }
                tail.extend_from_slice(STREAM_DONE);
                st.bytes.extend_from_slice(&tail);
                (std::mem::take(&mut st.bytes), Some((st, tail)))
            }
            None => {
                let tools = r.ctx.request.tool_calls.is_some();
                let id = r.ctx.env.receipt_id;
                let choices: Vec<_> = ex
                    .choices
                    .into_iter()
                    .map(|c| answer(c, tools, &id))
                    .collect();
                let api = r.ctx.request.api;
                let v = proto::chat::response_body(
                    api,
                    &response_id(api, &r.ctx.env.receipt_id),
                    r.ctx.created,
                    &c.model_id,
                    &choices,
                    usage,
                );
                (serde_json::to_vec(&v)?, None)
            }
        };
        let receipt = crate::receipt_link::sign_exit_receipt(
            c,
            &self.keys,
            &r.ctx.env,
            link,
            upstream,
            &body,
            Self::now_ms(),
        );
        Ok(match stream {
            // The sealed stream or body ends with the receipt as its trailer
            // (the client's copy); the host gets it beside the bytes.
            Some((mut st, tail)) => {
                let mut data = st.sealer.seal(&tail, false).map_err(|e| anyhow!("{e}"))?;
                data.extend(
                    st.sealer
                        .finish_with_trailer(&crate::receipt_link::client_trailer(
                            &r.ctx.env, &receipt,
                        ))
                        .map_err(|e| anyhow!("{e}"))?,
                );
                Output::Result(ResultMessage::StreamEnd {
                    request_id: r.ctx.env.request_id,
                    data,
                    receipt: Some(receipt),
                    telemetry: Some(telemetry),
                })
            }
            None => Output::Result(ResultMessage::Response {
                request_id: r.ctx.env.request_id,
                status: 200,
                body: seal_response_with_trailer(
                    &r.ctx.env.response_key,
                    &body,
                    &crate::receipt_link::client_trailer(&r.ctx.env, &receipt),
                )
                .map_err(|e| anyhow!("{e}"))?,
                receipt,
                receipt_id: r.ctx.env.receipt_id,
                telemetry: Some(telemetry),
            }),
        })
    }
}
