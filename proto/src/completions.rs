//! `POST /v1/completions` as the stages speak it: request validation (entry
//! stage), and the response's choices and Server-Sent-Event chunks (exit
//! stage; the chat module, which builds on this one, makes the whole bodies
//! of both APIs).
//! Like [`crate::openai`], free of I/O so that every rule is unit-tested.

use crate::openai::{invalid, json_object, model_field, user_field, ApiError};
use crate::structured::{parse_response_format, ResponseFormat};
use crate::tools::{ToolCall, ToolCalls};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// Most stop sequences (OpenAI's limit).
pub const MAX_STOP: usize = 4;
/// Most choices one request may ask for (prompts × `n`).
pub const MAX_CHOICES: usize = 128;
/// Most alternatives per position with `logprobs` (OpenAI's limit).
pub const MAX_LOGPROBS: u32 = 5;
/// Longest time slice a stream's events may be held for
/// (`stream_options.coalesce_ms`).
pub const MAX_COALESCE_MS: u32 = 1000;

/// One prompt: text (tokenized by the entry stage) or token ids.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Prompt {
    /// Text.
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<u32>),
}

/// A validated completions request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompletionsRequest {
    /// The model asked for.
    pub model: String,
    /// Which API asked: it decides the response's shape.
    #[serde(default)]
    pub api: Api,
    /// The prompts, in order (choice `i * n + j` is prompt `i`'s `j`-th sample).
    pub prompts: Vec<Prompt>,
    /// Most tokens to generate per choice.
    pub max_tokens: u32,
    /// Softmax temperature in `[0, 2]`; 0 is greedy.
    pub temperature: f32,
    /// Nucleus mass in `(0, 1]`.
    pub top_p: f32,
    /// Seed for reproducible sampling.
    pub seed: Option<u64>,
    /// Stop sequences (not included in the output).
    pub stop: Vec<String>,
    /// Samples per prompt.
    pub n: u32,
    /// Prepend the prompt to each choice's text.
    pub echo: bool,
    /// Log-probabilities of the sampled tokens and this many alternatives.
    pub logprobs: Option<u32>,
    /// Stream Server-Sent Events.
    pub stream: bool,
    /// Add a usage chunk before `[DONE]` (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Seal a stream's events per time slice of this many milliseconds
    /// instead of one chunk per step (`stream_options.coalesce_ms`, this
    /// server's extension; 0: per step): the number and times of the
    /// chunks then tell the host about slices, not tokens.
    #[serde(default)]
    pub coalesce_ms: u32,
    /// OpenAI's presence penalty in `[-2, 2]`.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty in `[-2, 2]`.
    pub frequency_penalty: f32,
    /// Additive biases on token logits, each in `[-100, 100]`.
    pub logit_bias: Vec<(u32, f32)>,
    /// What the answer's text must be (`response_format`); `None`: free text.
    #[serde(default)]
    pub response_format: Option<ResponseFormat>,
    /// The tools the answer may (or must) call (chat only); `None`: no calls.
    #[serde(default)]
    pub tool_calls: Option<ToolCalls>,
}

impl CompletionsRequest {
    /// Number of choices (prompts × `n`).
    pub fn choices(&self) -> usize {
        self.prompts.len() * self.n as usize
    }

    /// Whether the answer is decoded under a grammar.
    pub fn constrained(&self) -> bool {
        self.response_format.is_some() || self.tool_calls.is_some()
    }
}

/// The API a generation request came through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Api {
    /// `POST /v1/completions` (`text_completion` bodies).
    #[default]
    Completions,
    /// `POST /v1/chat/completions` (`chat.completion` bodies).
    Chat,
}

impl Api {
    /// The endpoint requests of this API come to.
    pub fn endpoint(self) -> crate::openai::ApiEndpoint {
        match self {
            Api::Completions => crate::openai::ApiEndpoint::Completions,
            Api::Chat => crate::openai::ApiEndpoint::ChatCompletions,
        }
    }
}

/// Why a choice ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum FinishReason {
    /// End of sequence or a stop sequence.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// The answer is tool calls (chat with `tools`).
    ToolCalls,
}

impl FinishReason {
    /// The API's string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

fn num(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(_) => invalid(key, format!("`{key}` must be a number.")),
    }
}

fn ranged(
    obj: &Map<String, Value>,
    key: &str,
    lo: f64,
    hi: f64,
    default: f64,
) -> Result<f32, ApiError> {
    let v = num(obj, key)?.unwrap_or(default);
    if !(lo..=hi).contains(&v) {
        return invalid(
            key,
            format!("`{key}` must be between {lo} and {hi}; got {v}."),
        );
    }
    Ok(v as f32)
}

fn token_array(v: &[Value], vocab: u32) -> Option<Vec<u32>> {
    v.iter()
        .map(|x| x.as_u64().filter(|&t| t < vocab as u64).map(|t| t as u32))
        .collect()
}

fn prompts(v: Option<&Value>, vocab: u32) -> Result<Vec<Prompt>, ApiError> {
    let bad = || {
        ApiError::invalid(
            Some("prompt"),
            format!(
                "`prompt` must be a string, an array of strings, an array of token ids \
                 (integers below {vocab}) or an array of such arrays."
            ),
        )
    };
    let out = match v {
        None | Some(Value::Null) => {
            return invalid("prompt", "You must provide a `prompt` parameter.")
        }
        Some(Value::String(s)) => vec![Prompt::Text(s.clone())],
        Some(Value::Array(items)) if items.is_empty() => {
            return invalid("prompt", "`prompt` must not be an empty array.")
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            vec![Prompt::Tokens(token_array(items, vocab).ok_or_else(bad)?)]
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|it| match it {
                Value::String(s) => Ok(Prompt::Text(s.clone())),
                Value::Array(t) if !t.is_empty() => {
                    Ok(Prompt::Tokens(token_array(t, vocab).ok_or_else(bad)?))
                }
                _ => Err(bad()),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad()),
    };
    Ok(out)
}

fn stop(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                ApiError::invalid(
                    Some("stop"),
                    "`stop` must be a string or an array of strings.",
                )
            })?,
        Some(_) => return invalid("stop", "`stop` must be a string or an array of strings."),
    };
    if list.len() > MAX_STOP {
        return invalid(
            "stop",
            format!(
                "`stop` has {} sequences; at most {MAX_STOP} are allowed.",
                list.len()
            ),
        );
    }
    if list.iter().any(String::is_empty) {
        return invalid("stop", "`stop` sequences must not be empty.");
    }
    Ok(list)
}

/// An integer field in `lo..=hi` (`default` when absent or null).
pub(crate) fn int_field(
    obj: &Map<String, Value>,
    key: &str,
    lo: u64,
    hi: u64,
    default: u64,
) -> Result<u64, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(x),
            _ => invalid(
                key,
                format!("`{key}` must be an integer from {lo} to {hi}."),
            ),
        },
        Some(_) => invalid(key, format!("`{key}` must be an integer.")),
    }
}

/// A boolean field (false when absent or null).
pub(crate) fn flag_field(obj: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => invalid(key, format!("`{key}` must be a boolean.")),
    }
}

/// The fields `/v1/completions` and `/v1/chat/completions` share: sampling,
/// penalties, stop sequences, `n`, streaming. `prompts` is left empty,
/// `max_tokens` at `max_tokens` and `logprobs` at `logprobs`; `prompts`
/// counts the prompts for the `n` limit.
pub(crate) fn shared_fields(
    obj: &Map<String, Value>,
    vocab: u32,
    api: Api,
    prompts: usize,
    max_tokens: u32,
    logprobs: Option<u32>,
) -> Result<CompletionsRequest, ApiError> {
    let model = model_field(obj)?;
    let n = int_field(obj, "n", 1, MAX_CHOICES as u64, 1)? as u32;
    if prompts * n as usize > MAX_CHOICES {
        return invalid("n", format!(
                "{prompts} prompts × n = {n} asks for {} choices; at most {MAX_CHOICES} per request.",
                prompts * n as usize
            ));
    }
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => None,
        Some(Value::Number(s)) => Some(
            s.as_u64()
                .or_else(|| s.as_i64().map(|i| i as u64))
                .ok_or_else(|| ApiError::invalid(Some("seed"), "`seed` must be an integer."))?,
        ),
        Some(_) => return invalid("seed", "`seed` must be an integer."),
    };
    let stream = flag_field(obj, "stream")?;
    if logprobs.is_some() && stream {
        return invalid(
            "logprobs",
            "`logprobs` with `stream: true` is not supported by this server; \
             ask without streaming.",
        );
    }
    let (include_usage, coalesce_ms) = match obj.get("stream_options") {
        None | Some(Value::Null) => (false, 0),
        Some(Value::Object(o)) if stream => (
            match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return invalid(
                        "stream_options",
                        "`stream_options.include_usage` must be a boolean.",
                    )
                }
            },
            match o.get("coalesce_ms") {
                None | Some(Value::Null) => 0,
                Some(v) => match v.as_u64().filter(|&ms| ms <= MAX_COALESCE_MS as u64) {
                    Some(ms) => ms as u32,
                    None => {
                        return invalid(
                            "stream_options",
                            format!(
                                "`stream_options.coalesce_ms` must be an integer from 0 to \
                                 {MAX_COALESCE_MS}."
                            ),
                        )
                    }
                },
            },
        ),
        Some(Value::Object(_)) => {
            return invalid(
                "stream_options",
                "`stream_options` is only allowed with `stream: true`.",
            )
        }
        Some(_) => return invalid("stream_options", "`stream_options` must be an object."),
    };
    let logit_bias = match obj.get("logit_bias") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Object(m)) => {
            let mut out = Vec::with_capacity(m.len());
            for (k, v) in m {
                let tok = k.parse::<u32>().ok().filter(|&t| t < vocab);
                let bias = v.as_f64().filter(|b| (-100.0..=100.0).contains(b));
                match (tok, bias) {
                    (Some(t), Some(b)) => out.push((t, b as f32)),
                    _ => {
                        return invalid(
                            "logit_bias",
                            format!(
                                "`logit_bias` maps token ids (below {vocab}) to numbers \
                                 from -100 to 100."
                            ),
                        )
                    }
                }
            }
            out.sort_by_key(|(t, _)| *t);
            out
        }
        Some(_) => return invalid("logit_bias", "`logit_bias` must be an object."),
    };
    user_field(obj)?;
    Ok(CompletionsRequest {
        model,
        api,
        prompts: Vec::new(),
        max_tokens,
        temperature: ranged(obj, "temperature", 0.0, 2.0, 1.0)?,
        top_p: {
            let p = ranged(obj, "top_p", 0.0, 1.0, 1.0)?;
            if p <= 0.0 {
                return invalid("top_p", "`top_p` must be greater than 0.");
            }
            p
        },
        seed,
        stop: stop(obj.get("stop"))?,
        n,
        echo: false,
        logprobs,
        stream,
        include_usage,
        coalesce_ms,
        presence_penalty: ranged(obj, "presence_penalty", -2.0, 2.0, 0.0)?,
        frequency_penalty: ranged(obj, "frequency_penalty", -2.0, 2.0, 0.0)?,
        logit_bias,
        response_format: parse_response_format(obj)?,
        tool_calls: None,
    })
}

/// Parses and validates a request body for a model with `vocab` tokens.
pub fn parse_completions(body: &[u8], vocab: u32) -> Result<CompletionsRequest, ApiError> {
    let v = json_object(body)?;
    let obj = v.as_object().expect("checked");
    model_field(obj)?;
    let prompts = prompts(obj.get("prompt"), vocab)?;
    let max_tokens = int_field(obj, "max_tokens", 1, u32::MAX as u64, 16)? as u32;
    let n = int_field(obj, "n", 1, MAX_CHOICES as u64, 1)?;
    let best_of = int_field(obj, "best_of", 1, MAX_CHOICES as u64, n)?;
    if best_of != n {
        return invalid(
            "best_of",
            "`best_of` other than `n` is not supported by this server.",
        );
    }
    let echo = flag_field(obj, "echo")?;
    let logprobs = match obj.get("logprobs") {
        None | Some(Value::Null) => None,
        Some(_) => Some(int_field(obj, "logprobs", 0, MAX_LOGPROBS as u64, 0)? as u32),
    };
    if logprobs.is_some() && echo {
        return invalid(
            "logprobs",
            "`logprobs` together with `echo` (log-probabilities of the prompt) is not \
             supported by this server; use one or the other.",
        );
    }
    if obj.get("suffix").is_some_and(|s| !s.is_null()) {
        return invalid(
            "suffix",
            "`suffix` (insertion) is not supported by this model.",
        );
    }
    let mut r = shared_fields(
        obj,
        vocab,
        Api::Completions,
        prompts.len(),
        max_tokens,
        logprobs,
    )?;
    r.prompts = prompts;
    r.echo = echo;
    Ok(r)
}

/// 400 for a prompt (plus `max_tokens`) longer than the context.
pub fn context_length_error(context: usize, prompt: usize, max_tokens: u32) -> ApiError {
    ApiError {
        code: Some("context_length_exceeded".into()),
        ..ApiError::invalid(
            Some("prompt"),
            format!(
                "This model's maximum context length is {context} tokens, however you \
                 requested {} tokens ({prompt} in your prompt; {max_tokens} for the \
                 completion). Please reduce your prompt or completion length.",
                prompt + max_tokens as usize
            ),
        )
    }
}

/// Log-probabilities of one choice (the legacy completions shape).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Logprobs {
    /// Each token's text.
    pub tokens: Vec<String>,
    /// Each token's log-probability under the model.
    pub token_logprobs: Vec<f64>,
    /// The most likely alternatives at each position (text → log-probability).
    pub top_logprobs: Vec<Vec<(String, f64)>>,
    /// Byte offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
}

impl Logprobs {
    fn to_json(&self) -> Value {
        let top: Vec<Value> = self
            .top_logprobs
            .iter()
            .map(|alts| {
                let mut m = Map::new();
                for (t, lp) in alts {
                    m.entry(t.clone()).or_insert(json!(lp));
                }
                Value::Object(m)
            })
            .collect();
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": top,
            "text_offset": self.text_offset,
        })
    }
}

/// One finished choice.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    /// Its index (`prompt * n + sample`).
    pub index: u32,
    /// The text (with the prompt first when echoing).
    pub text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Log-probabilities, when asked for.
    pub logprobs: Option<Logprobs>,
    /// The tool calls the text was read as (chat with `tools`; the text is
    /// then not the answer's content).
    pub tool_calls: Vec<ToolCall>,
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens (each prompt once, however many choices it has).
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub completion_tokens: u64,
}

impl Usage {
    pub(crate) fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        })
    }
}

/// The `id` of a completion (`cmpl-` + the receipt id in hex).
pub fn completion_id(receipt_id: &[u8; 16]) -> String {
    format!("cmpl-{}", hex::encode(receipt_id))
}

/// A choice of a `text_completion` body.
pub(crate) fn completion_choice(c: &Choice) -> Value {
    json!({
        "text": c.text,
        "index": c.index,
        "logprobs": c.logprobs.as_ref().map(Logprobs::to_json),
        "finish_reason": c.finish_reason.as_str(),
    })
}

/// Identity of a stream, repeated in every chunk.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamIdentity {
    /// `cmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Model id.
    pub model: String,
    /// Whether chunks carry `"usage": null` (with `include_usage`).
    pub include_usage: bool,
    /// The API: `text_completion` or `chat.completion.chunk` events.
    #[serde(default)]
    pub api: Api,
}

pub(crate) fn sse(v: &Value) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    out.extend(serde_json::to_vec(v).expect("JSON of a JSON value"));
    out.extend(b"\n\n");
    out
}

/// One text chunk event (`data: {...}\n\n`) for choice `index`.
pub fn stream_text_event(
    s: &StreamIdentity,
    index: u32,
    text: &str,
    finish: Option<FinishReason>,
) -> Vec<u8> {
    let mut v = json!({
        "id": s.id,
        "object": "text_completion",
        "created": s.created,
        "model": s.model,
        "choices": [{
            "text": text,
            "index": index,
            "logprobs": null,
            "finish_reason": finish.map(FinishReason::as_str),
        }],
    });
    if s.include_usage {
        v["usage"] = Value::Null;
    }
    sse(&v)
}

/// The usage event (`choices: []`) sent before `[DONE]` with `include_usage`.
pub fn stream_usage_event(s: &StreamIdentity, usage: Usage) -> Vec<u8> {
    let object = match s.api {
        Api::Completions => "text_completion",
        Api::Chat => "chat.completion.chunk",
    };
    sse(&json!({
        "id": s.id,
        "object": object,
        "created": s.created,
        "model": s.model,
        "choices": [],
        "usage": usage.to_json(),
    }))
}

/// An error event ending a stream early (`data: {"error": ...}`).
pub fn stream_error_event(e: &ApiError) -> Vec<u8> {
    sse(&e.body())
}

/// The terminator of every stream.
pub const STREAM_DONE: &[u8] = b"data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    fn p(body: &str) -> Result<CompletionsRequest, ApiError> {
        parse_completions(body.as_bytes(), 1000)
    }

    fn param_of(body: &str) -> Option<String> {
        let e = p(body).unwrap_err();
        assert_eq!(e.status, 400, "{body}");
        e.param
    }

    #[test]
    fn defaults_and_shapes_of_prompt() {
        let r = p(r#"{"model":"m","prompt":"hi"}"#).unwrap();
        assert_eq!(r.prompts, vec![Prompt::Text("hi".into())]);
        assert_eq!(
            (r.max_tokens, r.n, r.temperature, r.top_p),
            (16, 1, 1.0, 1.0)
        );
        assert!(!r.stream && !r.echo && r.logprobs.is_none() && r.stop.is_empty());
        let r = p(r#"{"model":"m","prompt":["a","b"],"n":3}"#).unwrap();
        assert_eq!(r.choices(), 6);
        let r = p(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.prompts, vec![Prompt::Tokens(vec![1, 2, 3])]);
        let r = p(r#"{"model":"m","prompt":[[1],[2,3]],"stop":"\n","seed":-1}"#).unwrap();
        assert_eq!(r.prompts.len(), 2);
        assert_eq!(r.stop, vec!["\n"]);
        assert_eq!(r.seed, Some(u64::MAX));
        let r = p(r#"{"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":true},"user":"u","logit_bias":{"5":-100}}"#).unwrap();
        assert!(r.stream && r.include_usage);
        assert_eq!(r.logit_bias, vec![(5, -100.0)]);
        assert_eq!(r.coalesce_ms, 0);
    }

    #[test]
    fn coalesce_ms_is_a_bounded_stream_option() {
        let r =
            p(r#"{"model":"m","prompt":"x","stream":true,"stream_options":{"coalesce_ms":50}}"#)
                .unwrap();
        assert_eq!((r.coalesce_ms, r.include_usage), (50, false));
        for bad in ["-1", "1001", "2.5", "\"50\""] {
            let body = format!(
                r#"{{"model":"m","prompt":"x","stream":true,"stream_options":{{"coalesce_ms":{bad}}}}}"#
            );
            assert_eq!(param_of(&body).as_deref(), Some("stream_options"), "{bad}");
        }
    }

    #[test]
    fn rejects_with_the_right_param() {
        assert_eq!(param_of("nope"), None);
        // Whole bodies and the field they must name.
        for (body, param) in [
            (r#"{"prompt":"x"}"#, "model"),
            (r#"{"model":"m"}"#, "prompt"),
            (r#"{"model":"m","prompt":[]}"#, "prompt"),
            (r#"{"model":"m","prompt":[1000]}"#, "prompt"),
            (r#"{"model":"m","prompt":[[]]}"#, "prompt"),
            (r#"{"model":"m","prompt":{}}"#, "prompt"),
            (r#"{"model":"m","prompt":["a","b"],"n":100}"#, "n"),
            (
                r#"{"model":"m","prompt":"x","logprobs":1,"echo":true}"#,
                "logprobs",
            ),
            (
                r#"{"model":"m","prompt":"x","logprobs":1,"stream":true}"#,
                "logprobs",
            ),
        ] {
            assert_eq!(param_of(body).as_deref(), Some(param), "{body}");
        }
        for (k, v) in [
            ("max_tokens", "0"),
            ("max_tokens", "1.5"),
            ("temperature", "2.5"),
            ("temperature", "\"hot\""),
            ("top_p", "0"),
            ("top_p", "1.1"),
            ("n", "0"),
            ("n", "129"),
            ("best_of", "3"),
            ("stop", "[\"a\",\"b\",\"c\",\"d\",\"e\"]"),
            ("stop", "[\"\"]"),
            ("stop", "5"),
            ("stream", "\"yes\""),
            ("stream_options", "{\"include_usage\":true}"),
            ("logprobs", "6"),
            ("presence_penalty", "3"),
            ("frequency_penalty", "-2.5"),
            ("logit_bias", "{\"x\":1}"),
            ("logit_bias", "{\"1\":101}"),
            ("suffix", "\"s\""),
            ("user", "5"),
            ("seed", "\"s\""),
        ] {
            let body = format!(r#"{{"model":"m","prompt":"x","{k}":{v}}}"#);
            assert_eq!(param_of(&body).as_deref(), Some(k), "{body}");
        }
    }

    #[test]
    fn context_error_names_the_limit() {
        let e = context_length_error(8192, 9000, 16);
        assert_eq!(e.status, 400);
        assert!(e.message.contains("8192") && e.message.contains("9016"));
        assert_eq!(e.code.as_deref(), Some("context_length_exceeded"));
    }
}
