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
use crate::tools::CallDelta;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

/// Most alternatives per position with `top_logprobs` (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// One message of the conversation, as the chat template sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool` (`developer` is read as
    /// `system`).
    pub role: String,
    /// The text (text parts joined with newlines; empty for an assistant
    /// turn that only called tools).
    pub content: String,
    /// An assistant turn's calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<PastCall>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of `role` with `content` only.
    pub fn text(role: &str, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// A call an earlier assistant turn made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PastCall {
    /// Its id.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// The arguments, as the JSON text the client sent.
    pub arguments: String,
}

/// A validated chat request: the shared generation fields (with
/// [`Api::Chat`] and no prompts yet) and the messages to render.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    /// Sampling, limits and streaming, as for completions.
    pub request: CompletionsRequest,
    /// The conversation, in order.
    pub messages: Vec<ChatMessage>,
    /// The tools the model is told about (none with `tool_choice: none`).
    pub tools: Vec<crate::tools::ToolDef>,
    /// Whether the client set `max_completion_tokens` or `max_tokens`
    /// (otherwise `request.max_tokens` is the server's default, which the
    /// entry stage shortens to what the context leaves).
    pub max_tokens_given: bool,
}

/// Top-level fields that ask for something this server cannot do, and
/// whether a value is the harmless default.
fn unsupported(key: &str, v: &Value) -> Option<&'static str> {
    let empty = |v: &Value| v.is_null() || v.as_array().is_some_and(|a| a.is_empty());
    match key {
        "functions" if !empty(v) => {
            Some("The deprecated `functions` are not supported; use `tools`.")
        }
        "function_call" if !v.is_null() && v.as_str() != Some("none") => {
            Some("The deprecated `function_call` is not supported; use `tool_choice`.")
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
            Some("tool") => "tool",
            Some("function") => {
                return invalid(
                    &format!("messages[{i}].role"),
                    "The deprecated `function` role is not supported; use `tool`.",
                )
            }
            Some(other) => {
                return invalid(
                    &format!("messages[{i}].role"),
                    format!(
                        "Unknown role `{}`; use `system`, `developer`, `user`, `assistant` \
                         or `tool`.",
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
        for key in ["function_call", "audio"] {
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
        let calls = match m.get("tool_calls") {
            None | Some(Value::Null) => Vec::new(),
            Some(v) if role == "assistant" => assistant_calls(i, v)?,
            Some(_) => {
                return invalid(
                    &format!("messages[{i}].tool_calls"),
                    "Only `assistant` messages carry `tool_calls`.",
                )
            }
        };
        let content = match (role, m.get("content")) {
            // An assistant turn that only called tools has no content.
            ("assistant", None | Some(Value::Null)) if !calls.is_empty() => String::new(),
            (_, c) => content(i, c)?,
        };
        let tool_call_id = match (role, m.get("tool_call_id")) {
            ("tool", Some(Value::String(id))) => Some(id.clone()),
            ("tool", _) => {
                return invalid(
                    &format!("messages[{i}].tool_call_id"),
                    "A `tool` message needs the string `tool_call_id` of the call it answers.",
                )
            }
            _ => None,
        };
        out.push(ChatMessage {
            role: role.into(),
            content,
            tool_calls: calls,
            tool_call_id,
        });
    }
    Ok(out)
}

/// The conversation as a template that does not take tools sees it (the
/// generic convention of [`crate::tools`]): the tools listed in the system
/// message, earlier calls written in the output syntax, tool results as
/// user turns. Without tools or calls, the messages as they are.
pub fn generic_messages(
    messages: &[ChatMessage],
    tools: &[crate::tools::ToolDef],
) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = messages
        .iter()
        .map(|m| match m.role.as_str() {
            "assistant" if !m.tool_calls.is_empty() => {
                let calls: Vec<String> = m
                    .tool_calls
                    .iter()
                    .map(|c| crate::tools::render_call(&c.name, &c.arguments))
                    .collect();
                let mut text = m.content.clone();
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&calls.join(crate::tools::CALL_SEP));
                ChatMessage::text("assistant", text)
            }
            "tool" => ChatMessage::text("user", crate::tools::tool_response(&m.content)),
            _ => m.clone(),
        })
        .collect();
    if !tools.is_empty() {
        with_tools_prompt(&mut out, tools);
    }
    out
}

/// An assistant message's earlier `tool_calls`.
fn assistant_calls(i: usize, v: &Value) -> Result<Vec<PastCall>, ApiError> {
    let p = format!("messages[{i}].tool_calls");
    let Some(items) = v.as_array() else {
        return invalid(&p, "`tool_calls` must be an array of calls.");
    };
    let mut out = Vec::with_capacity(items.len());
    for (j, c) in items.iter().enumerate() {
        let f = c.get("function");
        let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
        let args = f.and_then(|f| f.get("arguments")).and_then(Value::as_str);
        let kind = c.get("type").and_then(Value::as_str);
        match (kind, name, args) {
            (Some("function"), Some(n), Some(a)) if crate::structured::valid_name(n) => {
                out.push(PastCall {
                    id: c
                        .get("id")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .into(),
                    name: n.into(),
                    arguments: a.into(),
                })
            }
            _ => {
                return invalid(
                    &format!("{p}[{j}]"),
                    "Each call needs `type: function` and `function` with a `name` \
                     and `arguments` (a JSON string).",
                )
            }
        }
    }
    Ok(out)
}

/// The tools told to a template without tool support (the generic
/// convention of [`crate::tools`]): appended to the conversation's system
/// message, or as a first system message.
fn with_tools_prompt(messages: &mut Vec<ChatMessage>, defs: &[crate::tools::ToolDef]) {
    let block = crate::tools::tools_prompt(defs);
    match messages.first_mut() {
        Some(m) if m.role == "system" => m.content = format!("{}\n\n{block}", m.content),
        _ => messages.insert(0, ChatMessage::text("system", block)),
    }
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
    // With `tool_choice: none` the model is not told about the tools.
    let (tools, tool_calls) = match crate::tools::parse_tools(obj)? {
        Some(t) if t.calls.is_some() => (t.defs, t.calls),
        _ => (Vec::new(), None),
    };
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
    let mut request = shared_fields(
        obj,
        vocab,
        Api::Chat,
        1,
        max_tokens,
        logprobs.then_some(top),
    )?;
    request.tool_calls = tool_calls;
    Ok(ChatRequest {
        request,
        messages,
        tools,
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
    let message = if c.tool_calls.is_empty() {
        json!({"role": "assistant", "content": c.text, "refusal": null})
    } else {
        let calls: Vec<Value> = c
            .tool_calls
            .iter()
            .map(|t| {
                json!({"id": t.id, "type": "function",
                       "function": {"name": t.name, "arguments": t.arguments}})
            })
            .collect();
        json!({"role": "assistant", "content": null, "refusal": null, "tool_calls": calls})
    };
    json!({
        "index": c.index,
        "message": message,
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
    /// A piece of a tool call.
    ToolCall(&'a CallDelta),
    /// The last chunk: an empty delta with the finish reason.
    Finish(FinishReason),
}

/// One `chat.completion.chunk` event (`data: {...}\n\n`) for choice `index`.
pub fn chat_chunk_event(s: &StreamIdentity, index: u32, delta: Delta) -> Vec<u8> {
    let (delta, finish) = match delta {
        Delta::Role => (json!({"role": "assistant", "content": ""}), None),
        Delta::Content(t) => (json!({"content": t}), None),
        Delta::ToolCall(d) => {
            let mut call = json!({"index": d.index, "function": {"arguments": d.arguments}});
            if let Some((id, name)) = &d.header {
                call["id"] = json!(id);
                call["type"] = json!("function");
                call["function"]["name"] = json!(name);
            }
            (json!({"tool_calls": [call]}), None)
        }
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
            (
                r#"[{"role":"tool","content":"x"}]"#,
                "messages[0].tool_call_id",
            ),
            (r#"[{"role":"function","content":"x"}]"#, "messages[0].role"),
            (
                r#"[{"role":"user","content":"x","tool_calls":[]}]"#,
                "messages[0].tool_calls",
            ),
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
                "messages[0].tool_calls[0]",
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
            ("tools", r#"{"type":"function"}"#),
            ("tool_choice", r#""auto""#),
            ("functions", r#"[{"name":"f"}]"#),
            ("response_format", r#"{"type":"json"}"#),
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
    fn tools_history_and_formats() {
        let r = p(r#"{"model":"m","messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":"weather in Paris?"},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
             "function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},
            {"role":"tool","tool_call_id":"c1","content":"sunny"}],
            "tools":[{"type":"function","function":{"name":"get_weather",
              "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],
            "tool_choice":"required","response_format":{"type":"json_object"}}"#)
        .unwrap();
        // As the client sent them (a template that takes tools sees these).
        let roles: Vec<_> = r.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool"]);
        assert_eq!(r.messages[2].tool_calls[0].name, "get_weather");
        assert_eq!(r.messages[2].tool_calls[0].id, "c1");
        assert_eq!(r.messages[3].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(r.tools.len(), 1);
        // The generic convention, for templates that do not.
        let g = generic_messages(&r.messages, &r.tools);
        let roles: Vec<_> = g.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert!(g[0].content.starts_with("be brief\n\n# Tools"));
        assert_eq!(
            g[2].content,
            crate::tools::render_call("get_weather", r#"{"city":"Paris"}"#)
        );
        assert_eq!(g[3].content, "<tool_response>\nsunny\n</tool_response>");
        assert!(g
            .iter()
            .all(|m| m.tool_calls.is_empty() && m.tool_call_id.is_none()));
        // Without tools or calls, nothing changes.
        assert_eq!(generic_messages(&r.messages[..2], &[])[1], r.messages[1]);
        let calls = r.request.tool_calls.unwrap();
        assert!(calls.required && calls.tools[0].name == "get_weather");
        assert_eq!(
            r.request.response_format,
            Some(crate::structured::ResponseFormat::JsonObject)
        );
        // `tool_choice: none`: no tools in the prompt, no calls decoded.
        let r = p(&format!(
            r#"{{"model":"m",{HI},"tool_choice":"none",
            "tools":[{{"type":"function","function":{{"name":"f"}}}}]}}"#
        ))
        .unwrap();
        assert!(r.request.tool_calls.is_none() && r.tools.is_empty());
    }

    #[test]
    fn tool_call_bodies_and_deltas() {
        let choice = Choice {
            index: 0,
            text: String::new(),
            finish_reason: FinishReason::ToolCalls,
            logprobs: None,
            tool_calls: vec![crate::tools::ToolCall {
                id: "call_1".into(),
                name: "f".into(),
                arguments: "{}".into(),
            }],
        };
        let body = response_body(Api::Chat, "x", 7, "m", &[choice], Usage::default());
        let m = &body["choices"][0]["message"];
        assert!(m["content"].is_null());
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], "{}");
        assert_eq!(m["tool_calls"][0]["type"], "function");
        assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
        let s = identity("x".into(), Api::Chat, false);
        let first = CallDelta {
            index: 1,
            header: Some(("call_1".into(), "f".into())),
            arguments: String::new(),
        };
        let ev = chat_chunk_event(&s, 0, Delta::ToolCall(&first));
        let v: Value = serde_json::from_slice(&ev[6..ev.len() - 2]).unwrap();
        let c = &v["choices"][0]["delta"]["tool_calls"][0];
        assert_eq!(
            (c["index"].as_u64(), c["id"].as_str()),
            (Some(1), Some("call_1"))
        );
        assert_eq!(c["function"], json!({"name": "f", "arguments": ""}));
        let more = CallDelta {
            index: 1,
            header: None,
            arguments: "{\"a\"".into(),
        };
        let ev = chat_chunk_event(&s, 0, Delta::ToolCall(&more));
        let v: Value = serde_json::from_slice(&ev[6..ev.len() - 2]).unwrap();
        let c = &v["choices"][0]["delta"]["tool_calls"][0];
        assert!(c.get("id").is_none());
        assert_eq!(c["function"], json!({"arguments": "{\"a\""}));
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
            tool_calls: Vec::new(),
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
