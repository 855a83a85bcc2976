//! `POST /v1/chat/completions` as the stages speak it: request validation
//! (entry stage, which then renders the model's chat template and runs the
//! result as one completions prompt) and the `chat.completion` body and
//! `chat.completion.chunk` events (exit stage). The sampling fields are
//! those of [`crate::completions`]; like it, free of I/O.

use crate::completions::{
    completion_choice, flag_field, int_field, shared_fields, Api, Choice, CompletionsRequest,
    FinishReason, Logprobs, StreamIdentity, Usage,
};
use crate::openai::{invalid, json_object, model_field, ApiError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// Most alternatives per position with `top_logprobs` (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// One message of the conversation, as the chat template sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (`developer` is read as `system`).
    pub role: String,
    /// The text (text parts joined with newlines).
    pub content: String,
}

/// A validated chat request: the shared generation fields (with
/// [`Api::Chat`] and no prompts yet) and the messages to render.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    /// Sampling, limits and streaming, as for completions.
    pub request: CompletionsRequest,
    /// The conversation, in order.
    pub messages: Vec<ChatMessage>,
    /// Whether the client set `max_completion_tokens` or `max_tokens`
    /// (otherwise `request.max_tokens` is the server's default, which the
    /// entry stage shortens to what the context leaves).
    pub max_tokens_given: bool,
}

/// Top-level fields that ask for something this model cannot do, and
/// whether a value is the harmless default.
fn unsupported(key: &str, v: &Value) -> Option<&'static str> {
    let empty = |v: &Value| v.is_null() || v.as_array().is_some_and(|a| a.is_empty());
    match key {
        "tools" | "functions" if !empty(v) => {
            Some("Tool and function calling is not supported by this model.")
        }
        "tool_choice" | "function_call" if !v.is_null() && v.as_str() != Some("none") => {
            Some("Tool and function calling is not supported by this model.")
        }
        "response_format"
            if !v.is_null() && v.get("type").and_then(Value::as_str) != Some("text") =>
        {
            Some("Only `response_format` of type `text` is supported by this model.")
        }
        "modalities" if !v.is_null() && *v != json!(["text"]) => {
            Some("Only the `text` modality is supported by this model.")
        }
        "audio" if !v.is_null() => Some("Audio output is not supported by this model."),
        "prediction" if !v.is_null() => Some("Predicted outputs are not supported by this server."),
        "reasoning_effort" if !v.is_null() => {
            Some("`reasoning_effort` is only supported by reasoning models.")
        }
        "web_search_options" if !v.is_null() => Some("Web search is not supported by this server."),
        _ => None,
    }
}

fn content(i: usize, v: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match v {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str);
                match (kind, p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
                    (Some("text"), _) => {
                        return invalid(
                            &format!("{param}[{j}].text"),
                            "A text content part needs a string `text`.",
                        )
                    }
                    (Some(other), _) => {
                        return invalid(
                            &format!("{param}[{j}].type"),
                            format!(
                                "Content parts of type `{}` are not supported by this model; \
                                 only `text` parts are.",
                                short(other)
                            ),
                        )
                    }
                    (None, _) => {
                        return invalid(
                            &format!("{param}[{j}].type"),
                            "Each content part needs a `type`.",
                        )
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        None | Some(Value::Null) => invalid(
            &param,
            "Each message needs `content` (a string or an array of text parts).",
        ),
        Some(_) => invalid(
            &param,
            "`content` must be a string or an array of text parts.",
        ),
    }
}

/// A client-supplied name, cut for an error message.
fn short(s: &str) -> String {
    s.chars().take(32).collect()
}

fn messages(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let items = match v {
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(Value::Array(_)) => return invalid("messages", "`messages` must not be empty."),
        None | Some(Value::Null) => {
            return invalid("messages", "You must provide a `messages` parameter.")
        }
        Some(_) => {
            return invalid(
                "messages",
                "`messages` must be an array of message objects.",
            )
        }
    };
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let Some(m) = m.as_object() else {
            return invalid(
                &format!("messages[{i}]"),
                "Each message must be an object with `role` and `content`.",
            );
        };
        let role = match m.get("role").and_then(Value::as_str) {
            Some("system") | Some("developer") => "system",
            Some("user") => "user",
            Some("assistant") => "assistant",
            Some("tool") | Some("function") => {
                return invalid(
                    &format!("messages[{i}].role"),
                    "Tool and function messages are not supported by this model.",
                )
            }
            Some(other) => {
                return invalid(
                    &format!("messages[{i}].role"),
                    format!(
                        "Unknown role `{}`; use `system`, `developer`, `user` or `assistant`.",
                        short(other)
                    ),
                )
            }
            None => {
                return invalid(
                    &format!("messages[{i}].role"),
                    "Each message needs a string `role`.",
                )
            }
        };
        for key in ["tool_calls", "function_call", "audio"] {
            if m.get(key).is_some_and(|v| !v.is_null()) {
                return invalid(
                    &format!("messages[{i}].{key}"),
                    format!("`{key}` in messages is not supported by this model."),
                );
            }
        }
        if m.get("name")
            .is_some_and(|n| !n.is_string() && !n.is_null())
        {
            return invalid(&format!("messages[{i}].name"), "`name` must be a string.");
        }
        out.push(ChatMessage {
            role: role.into(),
            content: content(i, m.get("content"))?,
        });
    }
    Ok(out)
}

/// Parses and validates a chat request for a model with `vocab` tokens;
/// `default_max_tokens` applies when the client sets no limit.
pub fn parse_chat(
    body: &[u8],
    vocab: u32,
    default_max_tokens: u32,
) -> Result<ChatRequest, ApiError> {
    let v = json_object(body)?;
    let obj: &Map<String, Value> = v.as_object().expect("checked");
    model_field(obj)?;
    for (k, v) in obj {
        if let Some(why) = unsupported(k, v) {
            return invalid(k, why);
        }
    }
    let messages = messages(obj.get("messages"))?;
    let given = |k: &str| obj.get(k).is_some_and(|v| !v.is_null());
    let max_tokens_given = given("max_completion_tokens") || given("max_tokens");
    let max_tokens = if given("max_completion_tokens") {
        int_field(obj, "max_completion_tokens", 1, u32::MAX as u64, 0)?
    } else {
        int_field(
            obj,
            "max_tokens",
            1,
            u32::MAX as u64,
            default_max_tokens as u64,
        )?
    } as u32;
    let logprobs = flag_field(obj, "logprobs")?;
    let top = int_field(obj, "top_logprobs", 0, MAX_TOP_LOGPROBS as u64, 0)? as u32;
    if given("top_logprobs") && !logprobs {
        return invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`.");
    }
    let request = shared_fields(
        obj,
        vocab,
        Api::Chat,
        1,
        max_tokens,
        logprobs.then_some(top),
    )?;
    Ok(ChatRequest {
        request,
        messages,
        max_tokens_given,
    })
}

/// The `id` of a chat completion (`chatcmpl-` + the receipt id in hex).
pub fn chat_completion_id(receipt_id: &[u8; 16]) -> String {
    format!("chatcmpl-{}", hex::encode(receipt_id))
}

fn token_json(token: &str, logprob: f64) -> Value {
    json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()})
}

/// Chat's `logprobs` object: one entry per generated token.
fn logprobs_json(lp: &Logprobs) -> Value {
    let content: Vec<Value> = lp
        .tokens
        .iter()
        .zip(&lp.token_logprobs)
        .zip(&lp.top_logprobs)
        .map(|((t, &l), top)| {
            let mut v = token_json(t, l);
            v["top_logprobs"] = top.iter().map(|(t, l)| token_json(t, *l)).collect();
            v
        })
        .collect();
    json!({"content": content, "refusal": null})
}

/// The non-streamed response body of `api`: `text_completion` or
/// `chat.completion`. It lives here, beside the chat choice: chat builds on
/// completions, never the other way round.
pub fn response_body(
    api: Api,
    id: &str,
    created: u64,
    model: &str,
    choices: &[Choice],
    usage: Usage,
) -> Value {
    let (object, choice): (&str, fn(&Choice) -> Value) = match api {
        Api::Completions => ("text_completion", completion_choice),
        Api::Chat => ("chat.completion", chat_choice),
    };
    json!({
        "id": id,
        "object": object,
        "created": created,
        "model": model,
        "choices": choices.iter().map(choice).collect::<Vec<_>>(),
        "usage": usage.to_json(),
    })
}

/// A choice of a `chat.completion` body.
pub(crate) fn chat_choice(c: &Choice) -> Value {
    json!({
        "index": c.index,
        "message": {"role": "assistant", "content": c.text, "refusal": null},
        "logprobs": c.logprobs.as_ref().map(logprobs_json),
        "finish_reason": c.finish_reason.as_str(),
    })
}

/// What one `chat.completion.chunk` carries for a choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delta<'a> {
    /// The first chunk of a choice: the role (and empty content).
    Role,
    /// New text.
    Content(&'a str),
    /// The last chunk: an empty delta with the finish reason.
    Finish(FinishReason),
}

/// One `chat.completion.chunk` event (`data: {...}\n\n`) for choice `index`.
pub fn chat_chunk_event(s: &StreamIdentity, index: u32, delta: Delta) -> Vec<u8> {
    let (delta, finish) = match delta {
        Delta::Role => (json!({"role": "assistant", "content": ""}), None),
        Delta::Content(t) => (json!({"content": t}), None),
        Delta::Finish(f) => (json!({}), Some(f.as_str())),
    };
    let mut v = json!({
        "id": s.id,
        "object": "chat.completion.chunk",
        "created": s.created,
        "model": s.model,
        "choices": [{
            "index": index,
            "delta": delta,
            "logprobs": null,
            "finish_reason": finish,
        }],
    });
    if s.include_usage {
        v["usage"] = Value::Null;
    }
    crate::completions::sse(&v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::completions::{completion_id, stream_text_event, stream_usage_event};

    fn p(body: &str) -> Result<ChatRequest, ApiError> {
        parse_chat(body.as_bytes(), 1000, 512)
    }

    fn param_of(body: &str) -> Option<String> {
        let e = p(body).unwrap_err();
        assert_eq!(e.status, 400, "{body}");
        e.param
    }

    const HI: &str = r#""messages":[{"role":"user","content":"hi"}]"#;

    #[test]
    fn messages_in_both_content_forms() {
        let r = p(r#"{"model":"m","messages":[
            {"role":"developer","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}],"name":"u1"},
            {"role":"assistant","content":"ok"}]}"#)
        .unwrap();
        let roles: Vec<_> = r.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant"]);
        assert_eq!(r.messages[1].content, "a\nb");
        assert_eq!(r.request.api, Api::Chat);
        assert!(r.request.prompts.is_empty());
        assert_eq!((r.request.max_tokens, r.max_tokens_given), (512, false));
        assert!(r.request.logprobs.is_none());
    }

    #[test]
    fn limits_and_logprobs() {
        let r = p(&format!(r#"{{"model":"m",{HI},"max_tokens":7}}"#)).unwrap();
        assert_eq!((r.request.max_tokens, r.max_tokens_given), (7, true));
        let r = p(&format!(
            r#"{{"model":"m",{HI},"max_tokens":7,"max_completion_tokens":9}}"#
        ))
        .unwrap();
        assert_eq!(r.request.max_tokens, 9);
        let r = p(&format!(
            r#"{{"model":"m",{HI},"logprobs":true,"top_logprobs":3,"seed":5,"n":2,"stop":["x"]}}"#
        ))
        .unwrap();
        assert_eq!(r.request.logprobs, Some(3));
        assert_eq!((r.request.n, r.request.seed), (2, Some(5)));
        let r = p(&format!(
            r#"{{"model":"m",{HI},"stream":true,"stream_options":{{"include_usage":true}},
            "tools":[],"tool_choice":"none","response_format":{{"type":"text"}},"store":false,
            "modalities":["text"],"user":"u","parallel_tool_calls":false}}"#
        ))
        .unwrap();
        assert!(r.request.stream && r.request.include_usage);
    }

    #[test]
    fn rejects_naming_the_field() {
        assert_eq!(param_of(r#"{"model":"m"}"#).as_deref(), Some("messages"));
        assert_eq!(
            param_of(r#"{"model":"m","messages":[]}"#).as_deref(),
            Some("messages")
        );
        assert_eq!(param_of(&format!("{{{HI}}}")).as_deref(), Some("model"));
        for (msgs, param) in [
            (r#"[{"role":"tool","content":"x"}]"#, "messages[0].role"),
            (r#"[{"role":"robot","content":"x"}]"#, "messages[0].role"),
            (r#"[{"content":"x"}]"#, "messages[0].role"),
            (r#"["hi"]"#, "messages[0]"),
            (r#"[{"role":"user"}]"#, "messages[0].content"),
            (r#"[{"role":"user","content":5}]"#, "messages[0].content"),
            (
                r#"[{"role":"user","content":"a"},{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]"#,
                "messages[1].content[0].type",
            ),
            (
                r#"[{"role":"user","content":[{"type":"text"}]}]"#,
                "messages[0].content[0].text",
            ),
            (
                r#"[{"role":"assistant","content":null,"tool_calls":[{"id":"c"}]}]"#,
                "messages[0].tool_calls",
            ),
            (
                r#"[{"role":"user","content":"x","name":5}]"#,
                "messages[0].name",
            ),
        ] {
            let body = format!(r#"{{"model":"m","messages":{msgs}}}"#);
            assert_eq!(param_of(&body).as_deref(), Some(param), "{body}");
        }
        for (k, v) in [
            ("tools", r#"[{"type":"function","function":{"name":"f"}}]"#),
            ("tool_choice", r#""auto""#),
            ("functions", r#"[{"name":"f"}]"#),
            ("response_format", r#"{"type":"json_object"}"#),
            ("modalities", r#"["text","audio"]"#),
            ("audio", r#"{"voice":"x"}"#),
            ("reasoning_effort", r#""low""#),
            ("max_completion_tokens", "0"),
            ("max_tokens", "-1"),
            ("logprobs", "1"),
            ("top_logprobs", "21"),
            ("top_logprobs", "2"),
            ("temperature", "3"),
            ("n", "129"),
            ("stop", "[\"\"]"),
            ("stream_options", "{\"include_usage\":true}"),
            ("logit_bias", "{\"5000\":1}"),
            ("user", "1"),
        ] {
            let body = format!(r#"{{"model":"m",{HI},"{k}":{v}}}"#);
            assert_eq!(param_of(&body).as_deref(), Some(k), "{body}");
        }
        assert_eq!(
            param_of(&format!(
                r#"{{"model":"m",{HI},"logprobs":true,"stream":true}}"#
            ))
            .as_deref(),
            Some("logprobs")
        );
    }

    #[test]
    fn bodies_and_chunks_have_the_openai_shape() {
        let id = chat_completion_id(&[0xcd; 16]);
        assert!(id.starts_with("chatcmpl-cdcd"));
        let lp = Logprobs {
            tokens: vec!["é".into()],
            token_logprobs: vec![-0.5],
            top_logprobs: vec![vec![("é".into(), -0.5), ("a".into(), -1.5)]],
            text_offset: vec![0],
        };
        let body = one_choice_body(Api::Chat, &id, FinishReason::Stop, Some(lp));
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(body["choices"][0]["message"]["role"], "assistant");
        assert_eq!(body["choices"][0]["message"]["content"], "hi");
        assert_eq!(body["choices"][0]["finish_reason"], "stop");
        let c = &body["choices"][0]["logprobs"]["content"][0];
        assert_eq!(c["bytes"], json!([0xc3, 0xa9]));
        assert_eq!(c["top_logprobs"][1]["token"], "a");
        assert_eq!(body["usage"]["total_tokens"], 5);
        let s = identity(id, Api::Chat, false);
        let parse = |ev: Vec<u8>| -> Value {
            assert!(ev.starts_with(b"data: {") && ev.ends_with(b"\n\n"));
            serde_json::from_slice(&ev[6..ev.len() - 2]).unwrap()
        };
        let v = parse(chat_chunk_event(&s, 1, Delta::Role));
        assert_eq!(v["object"], "chat.completion.chunk");
        assert_eq!(v["choices"][0]["delta"]["role"], "assistant");
        assert!(v.get("usage").is_none());
        let v = parse(chat_chunk_event(&s, 1, Delta::Content("x")));
        assert_eq!(v["choices"][0]["delta"], json!({"content": "x"}));
        assert!(v["choices"][0]["finish_reason"].is_null());
        let v = parse(chat_chunk_event(&s, 1, Delta::Finish(FinishReason::Length)));
        assert_eq!(v["choices"][0]["delta"], json!({}));
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }

    /// A body of `api` with one choice, "hi", after a 3-token prompt.
    fn one_choice_body(
        api: Api,
        id: &str,
        finish_reason: FinishReason,
        logprobs: Option<Logprobs>,
    ) -> Value {
        let choice = Choice {
            index: 0,
            text: "hi".into(),
            finish_reason,
            logprobs,
        };
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
        };
        response_body(api, id, 7, "m", &[choice], usage)
    }

    /// A stream of model "m", created at 7.
    fn identity(id: String, api: Api, include_usage: bool) -> StreamIdentity {
        StreamIdentity {
            id,
            created: 7,
            model: "m".into(),
            include_usage,
            api,
        }
    }

    #[test]
    fn text_completion_bodies_have_the_openai_shape() {
        let id = completion_id(&[0xab; 16]);
        assert!(id.starts_with("cmpl-abab"));
        let body = one_choice_body(Api::Completions, &id, FinishReason::Length, None);
        assert_eq!(body["object"], "text_completion");
        assert_eq!(body["choices"][0]["finish_reason"], "length");
        assert_eq!(body["usage"]["total_tokens"], 5);
        let s = identity(id, Api::Completions, true);
        let ev = stream_text_event(&s, 1, "a", None);
        assert!(ev.starts_with(b"data: {") && ev.ends_with(b"\n\n"));
        let v: Value = serde_json::from_slice(&ev[6..ev.len() - 2]).unwrap();
        assert_eq!(v["choices"][0]["index"], 1);
        assert!(v["choices"][0]["finish_reason"].is_null());
        assert!(v.get("usage").is_some_and(Value::is_null));
        let u = stream_usage_event(&s, Usage::default());
        let v: Value = serde_json::from_slice(&u[6..u.len() - 2]).unwrap();
        assert_eq!(v["choices"], json!([]));
    }
}
