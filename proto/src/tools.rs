//! Tool calling as the stages speak it: `tools`, `tool_choice` and
//! `parallel_tool_calls` validated (entry stage), the prompt convention that
//! tells a model about its tools and renders earlier calls and results, and
//! the syntax of a call in the model's output, read back into OpenAI's
//! `tool_calls`, whole or as stream deltas (exit stage). Free of I/O.
//!
//! **The generic convention** (for chat templates that do not take tools,
//! which today is every template served; see `docs/structured-outputs.md`):
//! the tools are listed, one JSON object per line, in a system message
//! (appended to the conversation's own system message, or first); an
//! assistant turn that called tools is rendered as its calls in the output
//! syntax; a `tool` message becomes a `user` turn wrapped in
//! `<tool_response>` tags. A call in the output is exactly
//!
//! ```text
//! <tool_call>
//! {"name": "NAME", "arguments": ARGUMENTS}
//! </tool_call>
//! ```
//!
//! with calls separated by one newline (the tags of Hermes-style models,
//! which many open models were trained on). The exit stage decodes a call
//! under a grammar, so `ARGUMENTS` is JSON valid against the tool's
//! `parameters`.

use crate::openai::{invalid, ApiError};
use crate::structured::{checked_schema, valid_name};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Most tools in one request (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;
/// What a call starts with, up to its name.
pub const CALL_OPEN: &str = "<tool_call>\n{\"name\": \"";
/// Between a call's name and its arguments.
pub const CALL_MID: &str = "\", \"arguments\": ";
/// What ends a call, after its arguments.
pub const CALL_CLOSE: &str = "}\n</tool_call>";
/// Between two calls.
pub const CALL_SEP: &str = "\n";
/// The tag that decides, at the start of an answer, that it is a call.
pub const CALL_TAG: &str = "<tool_call>";

/// One function the model may call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolDef {
    /// Its name (1 to 64 of `a-z A-Z 0-9 _ -`).
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// The JSON schema of its arguments, as compact JSON text.
    pub parameters: String,
}

/// What the exit stage decodes calls against: the tools a call may name
/// and whether the answer must be calls.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCalls {
    /// The functions a call may name (one, for a named `tool_choice`).
    pub tools: Vec<ToolDef>,
    /// `required` or a named function: the answer is calls. Otherwise
    /// (`auto`) the model chooses between an answer and calls.
    pub required: bool,
    /// More than one call per answer (`parallel_tool_calls`).
    pub parallel: bool,
}

/// The validated tool fields of a chat request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolUse {
    /// Every tool, for the prompt.
    pub defs: Vec<ToolDef>,
    /// The constraint for the exit stage; `None` with `tool_choice: none`.
    pub calls: Option<ToolCalls>,
}

fn tool_def(i: usize, t: &Value) -> Result<ToolDef, ApiError> {
    let p = format!("tools[{i}]");
    let Some(t) = t.as_object() else {
        return invalid(
            &p,
            "Each tool must be an object with `type` and `function`.",
        );
    };
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return invalid(
            &format!("{p}.type"),
            "Only tools of type `function` are supported.",
        );
    }
    let Some(Value::Object(f)) = t.get("function") else {
        return invalid(
            &format!("{p}.function"),
            "A tool needs a `function` object.",
        );
    };
    let name = match f.get("name") {
        Some(Value::String(n)) if valid_name(n) => n.clone(),
        _ => {
            return invalid(
                &format!("{p}.function.name"),
                "A function's `name` must be 1 to 64 letters, digits, underscores or dashes.",
            )
        }
    };
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(_) => return invalid(&format!("{p}.function.description"), "must be a string."),
    };
    match f.get("strict") {
        None | Some(Value::Null) | Some(Value::Bool(_)) => {}
        Some(_) => {
            return invalid(
                &format!("{p}.function.strict"),
                "`strict` must be a boolean.",
            )
        }
    }
    // No parameters: a function without arguments (`{}`).
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => r#"{"type":"object","properties":{}}"#.to_string(),
        Some(s @ Value::Object(_)) => checked_schema(&format!("{p}.function.parameters"), s)?,
        Some(_) => {
            return invalid(
                &format!("{p}.function.parameters"),
                "`parameters` must be a JSON schema object.",
            )
        }
    };
    Ok(ToolDef {
        name,
        description,
        parameters,
    })
}

/// Parses `tools`, `tool_choice` and `parallel_tool_calls`. `None` when the
/// request has no tools.
pub fn parse_tools(obj: &Map<String, Value>) -> Result<Option<ToolUse>, ApiError> {
    let defs = match obj.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) if a.len() > MAX_TOOLS => {
            return invalid(
                "tools",
                format!("{} tools given; at most {MAX_TOOLS} are accepted.", a.len()),
            )
        }
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, t)| tool_def(i, t))
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return invalid("tools", "`tools` must be an array of tools."),
    };
    for (i, d) in defs.iter().enumerate() {
        if defs[..i].iter().any(|e| e.name == d.name) {
            return invalid(
                &format!("tools[{i}].function.name"),
                "Two tools have the same name.",
            );
        }
    }
    // Unless asked for, one call per answer, as llama.cpp's server does:
    // small models that may chain calls tend to repeat them until their
    // token limit.
    let parallel = match obj.get("parallel_tool_calls") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return invalid(
                "parallel_tool_calls",
                "`parallel_tool_calls` must be a boolean.",
            )
        }
    };
    let choice = obj.get("tool_choice").filter(|v| !v.is_null());
    let named = match choice {
        None => None,
        Some(Value::String(s)) if ["none", "auto", "required"].contains(&s.as_str()) => None,
        Some(Value::Object(c)) if c.get("type").and_then(Value::as_str) == Some("function") => {
            match c
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
            {
                Some(n) => Some(n.to_string()),
                None => {
                    return invalid(
                        "tool_choice",
                        "A named `tool_choice` needs `function.name`.",
                    )
                }
            }
        }
        Some(_) => {
            return invalid(
                "tool_choice",
                "`tool_choice` must be `none`, `auto`, `required` or \
                 {\"type\": \"function\", \"function\": {\"name\": ...}}.",
            )
        }
    };
    let mode = choice.and_then(Value::as_str);
    if defs.is_empty() {
        return match (mode, &named) {
            (None | Some("none"), None) => Ok(None),
            _ => invalid("tool_choice", "`tool_choice` needs `tools`."),
        };
    }
    let calls = match (mode, named) {
        (Some("none"), _) => None,
        (_, Some(n)) => {
            let Some(d) = defs.iter().find(|d| d.name == n) else {
                return invalid(
                    "tool_choice",
                    "`tool_choice` names a function that is not in `tools`.",
                );
            };
            Some(ToolCalls {
                tools: vec![d.clone()],
                required: true,
                parallel,
            })
        }
        (m, None) => Some(ToolCalls {
            tools: defs.clone(),
            required: m == Some("required"),
            parallel,
        }),
    };
    Ok(Some(ToolUse { defs, calls }))
}

/// The system text that tells the model about `defs` (generic convention).
pub fn tools_prompt(defs: &[ToolDef]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou can call the functions listed below, one JSON object per line, \
         inside <tools></tools> tags:\n<tools>\n",
    );
    for d in defs {
        let params: Value = serde_json::from_str(&d.parameters).unwrap_or(Value::Null);
        let mut f = Map::new();
        f.insert("name".into(), Value::String(d.name.clone()));
        if let Some(desc) = &d.description {
            f.insert("description".into(), Value::String(desc.clone()));
        }
        f.insert("parameters".into(), params);
        let line = serde_json::json!({"type": "function", "function": f});
        s.push_str(&line.to_string());
        s.push('\n');
    }
    s.push_str(
        "</tools>\n\nTo call a function, answer with nothing but one block per call:\n\
         <tool_call>\n{\"name\": \"the function's name\", \"arguments\": {the arguments as a \
         JSON object}}\n</tool_call>\nA function's result comes back inside \
         <tool_response></tool_response> tags.",
    );
    s
}

/// One call in the output syntax.
pub fn render_call(name: &str, arguments: &str) -> String {
    format!("{CALL_OPEN}{name}{CALL_MID}{arguments}{CALL_CLOSE}")
}

/// A tool's result as the user turn that carries it (generic convention).
pub fn tool_response(content: &str) -> String {
    format!("<tool_response>\n{content}\n</tool_response>")
}

/// One call read from the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// Its `id` (see [`call_id`]).
    pub id: String,
    /// The function's name.
    pub name: String,
    /// The arguments as the model wrote them (JSON text; cut short if the
    /// answer was).
    pub arguments: String,
}

/// The `id` of call `k` of choice `choice` of the response with `receipt_id`:
/// unique per response, the same in a stream and in a whole answer.
pub fn call_id(receipt_id: &[u8; 16], choice: u32, k: usize) -> String {
    format!("call_{}_{choice}_{k}", hex::encode(&receipt_id[..8]))
}

/// Length of the longest suffix of `text` that is a proper prefix of `end`.
fn partial_suffix(text: &str, end: &str) -> usize {
    (1..end.len().min(text.len() + 1))
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k) && end.starts_with(&text[text.len() - k..])
        })
        .unwrap_or(0)
}

/// A call as far as the text goes.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Partial<'a> {
    name: Option<&'a str>,
    /// Arguments known to be final so far (a tail that could be the start of
    /// [`CALL_CLOSE`] is held back until the text is complete).
    arguments: &'a str,
}

/// Every call in `text` as far as it goes; `None` when the text is not (or
/// cannot yet be seen to be) calls. `done`: the text is complete, so
/// nothing is held back.
fn scan(text: &str, done: bool) -> Option<Vec<Partial<'_>>> {
    // The grammar lets a call begin only at the very start of the answer.
    if !text.starts_with(CALL_TAG) {
        return None;
    }
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(after_open) = rest.strip_prefix(CALL_OPEN) {
        let Some(q) = after_open.find('"') else {
            out.push(Partial {
                name: None,
                arguments: "",
            });
            break;
        };
        let name = &after_open[..q];
        let Some(args) = after_open[q..].strip_prefix(CALL_MID) else {
            out.push(Partial {
                name: Some(name),
                arguments: "",
            });
            break;
        };
        match args.find(CALL_CLOSE) {
            Some(e) => {
                out.push(Partial {
                    name: Some(name),
                    arguments: &args[..e],
                });
                rest = &args[e + CALL_CLOSE.len()..];
                match rest.strip_prefix(CALL_SEP) {
                    Some(r) => rest = r,
                    None => break,
                }
            }
            None => {
                let held = partial_suffix(args, CALL_CLOSE);
                // Complete, the text may still end in part of the closing
                // tag (a stop sequence or a length limit cut it there):
                // that part is not arguments when the rest is whole JSON.
                let keep =
                    if !done || serde_json::from_str::<Value>(&args[..args.len() - held]).is_ok() {
                        args.len() - held
                    } else {
                        args.len()
                    };
                out.push(Partial {
                    name: Some(name),
                    arguments: &args[..keep],
                });
                break;
            }
        }
    }
    Some(out)
}

/// The calls of a finished answer; `None` when it is not calls.
pub fn parse_calls(text: &str, receipt_id: &[u8; 16], choice: u32) -> Option<Vec<ToolCall>> {
    let calls: Vec<ToolCall> = scan(text, true)?
        .into_iter()
        .enumerate()
        .filter_map(|(k, p)| {
            // A call cut short before its name ends is no call (as in a
            // stream, which sends a call only once its name is known).
            Some(ToolCall {
                id: call_id(receipt_id, choice, k),
                name: p.name?.to_string(),
                arguments: p.arguments.to_string(),
            })
        })
        .collect();
    // Not one call: the answer is its text.
    (!calls.is_empty()).then_some(calls)
}

/// Whether an answer that begins with `text` could still turn out to be
/// calls (its start is a prefix of [`CALL_TAG`]), so a stream holds it.
pub fn undecided(text: &str) -> bool {
    text.len() < CALL_TAG.len() && CALL_TAG.starts_with(text)
}

/// One piece of a streamed call, in OpenAI's delta shape: the first piece
/// of call `index` carries its id and name, later ones argument text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallDelta {
    /// Which call of the choice.
    pub index: usize,
    /// The call's id and function name (first piece only).
    pub header: Option<(String, String)>,
    /// More of the arguments.
    pub arguments: String,
}

/// A choice's calls streamed as they are written: what has gone out so far.
#[derive(Clone, Debug, Default)]
pub struct CallStream {
    /// Per call: whether its header went out, and argument bytes sent.
    sent: Vec<(bool, usize)>,
}

impl CallStream {
    /// Whether a call's header went out (the answer is calls).
    pub fn started(&self) -> bool {
        self.sent.first().is_some_and(|&(header, _)| header)
    }

    /// The deltas that `text` (the whole answer so far) adds to what was
    /// sent; `done` once the answer is complete.
    pub fn deltas(
        &mut self,
        text: &str,
        done: bool,
        receipt_id: &[u8; 16],
        choice: u32,
    ) -> Vec<CallDelta> {
        let Some(calls) = scan(text, done) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (k, p) in calls.iter().enumerate() {
            let Some(name) = p.name else { break };
            if self.sent.len() <= k {
                self.sent.push((false, 0));
            }
            let (header_sent, args_sent) = &mut self.sent[k];
            let header =
                (!*header_sent).then(|| (call_id(receipt_id, choice, k), name.to_string()));
            *header_sent = true;
            let more = p
                .arguments
                .get(*args_sent..)
                .unwrap_or_default()
                .to_string();
            *args_sent = p.arguments.len().max(*args_sent);
            if header.is_some() || !more.is_empty() {
                out.push(CallDelta {
                    index: k,
                    header,
                    arguments: more,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<ToolUse>, ApiError> {
        parse_tools(v.as_object().unwrap())
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}},
               {"type": "function", "function": {"name": "now"}}])
    }

    #[test]
    fn tool_choices() {
        let u = parse(json!({"tools": weather()})).unwrap().unwrap();
        let c = u.calls.unwrap();
        assert!(!c.required && !c.parallel && c.tools.len() == 2);
        assert_eq!(
            c.tools[1].parameters,
            r#"{"type":"object","properties":{}}"#
        );
        let u = parse(json!({"tools": weather(), "tool_choice": "none"}))
            .unwrap()
            .unwrap();
        assert!(u.calls.is_none() && u.defs.len() == 2);
        let c = parse(json!({"tools": weather(), "tool_choice": "required",
                             "parallel_tool_calls": true}))
        .unwrap()
        .unwrap()
        .calls
        .unwrap();
        assert!(c.required && c.parallel);
        let c = parse(json!({"tools": weather(),
                             "tool_choice": {"type": "function", "function": {"name": "now"}}}))
        .unwrap()
        .unwrap()
        .calls
        .unwrap();
        assert!(c.required);
        assert_eq!(c.tools.len(), 1);
        assert_eq!(c.tools[0].name, "now");
        assert_eq!(parse(json!({"tool_choice": "none"})).unwrap(), None);
        assert_eq!(parse(json!({"tools": []})).unwrap(), None);
    }

    #[test]
    fn bad_tools_name_the_field() {
        for (body, param) in [
            (json!({"tools": {}}), "tools"),
            (json!({"tools": [5]}), "tools[0]"),
            (json!({"tools": [{"type": "code"}]}), "tools[0].type"),
            (
                json!({"tools": [{"type": "function"}]}),
                "tools[0].function",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools[0].function.name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": 3}}]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a"}},
                              {"type": "function", "function": {"name": "a"}}]}),
                "tools[1].function.name",
            ),
            (json!({"tool_choice": "auto"}), "tool_choice"),
            (
                json!({"tools": weather(), "tool_choice": "always"}),
                "tool_choice",
            ),
            (
                json!({"tools": weather(),
                    "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": weather(), "parallel_tool_calls": 1}),
                "parallel_tool_calls",
            ),
            (
                json!({"tools": (0..=MAX_TOOLS).map(|_| json!({})).collect::<Vec<_>>()}),
                "tools",
            ),
        ] {
            let e = parse(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
    }

    #[test]
    fn prompt_lists_each_tool() {
        let u = parse(json!({"tools": weather()})).unwrap().unwrap();
        let p = tools_prompt(&u.defs);
        let lines: Vec<Value> = p
            .lines()
            .filter(|l| l.starts_with('{') && l.contains("\"type\":\"function\""))
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(
            lines[0]["function"]["parameters"]["required"],
            json!(["city"])
        );
        assert!(p.contains("<tool_call>") && p.contains("<tool_response>"));
    }

    const ID: [u8; 16] = [7; 16];

    #[test]
    fn calls_read_back_whole() {
        let text = format!(
            "{}{CALL_SEP}{}",
            render_call("get_weather", r#"{"city": "Paris"}"#),
            render_call("now", "{}")
        );
        let calls = parse_calls(&text, &ID, 1).unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"city": "Paris"}"#);
        assert_eq!(calls[1].arguments, "{}");
        assert_eq!(calls[1].id, call_id(&ID, 1, 1));
        assert_ne!(calls[0].id, calls[1].id);
        assert_eq!(parse_calls("Paris is sunny.", &ID, 0), None);
        // Cut short (a length limit): what was written.
        let cut = &text[..CALL_OPEN.len() + "get_weather".len() + CALL_MID.len() + 1];
        let calls = parse_calls(cut, &ID, 0).unwrap();
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, "{");
        assert!(undecided("") && undecided("<tool") && !undecided("<tool_call>"));
        assert!(
            !undecided("Hello") && !undecided(" <tool"),
            "calls begin the answer"
        );
        assert_eq!(parse_calls(" <tool_call>", &ID, 0), None);
        assert_eq!(parse_calls("\u{a0}<tool_call>", &ID, 0), None);
        // No call named: the text is the answer.
        assert_eq!(parse_calls("<tool_call>\n{\"na", &ID, 0), None);
        // Cut inside the closing tag (a stop sequence, a length limit): the
        // arguments without it when they are whole, else as written.
        let call = render_call("f", r#"{"a": {"b": 1}}"#);
        for cut in ["}", "}\n", "}\n</tool"] {
            let end = call.find(CALL_CLOSE).unwrap() + cut.len();
            let got = parse_calls(&call[..end], &ID, 0).unwrap();
            assert_eq!(got[0].arguments, r#"{"a": {"b": 1}}"#, "{cut:?}");
        }
        let short = &call[..call.find(CALL_CLOSE).unwrap() - 1];
        assert_eq!(
            parse_calls(short, &ID, 0).unwrap()[0].arguments,
            r#"{"a": {"b": 1}"#
        );
    }

    #[test]
    fn streamed_deltas_reassemble_to_the_whole() {
        let text = format!(
            "{}{CALL_SEP}{}",
            render_call("get_weather", r#"{"city": "Paris}"}"#),
            render_call("now", "{}")
        );
        let whole = parse_calls(&text, &ID, 0).unwrap();
        // Every cut of the text, one byte at a time.
        let mut s = CallStream::default();
        let mut got: Vec<(String, String, String)> = Vec::new();
        for end in 1..=text.len() {
            for d in s.deltas(&text[..end], end == text.len(), &ID, 0) {
                if let Some((id, name)) = d.header {
                    assert_eq!(d.index, got.len());
                    got.push((id, name, String::new()));
                }
                got[d.index].2.push_str(&d.arguments);
                // Never a byte of the closing tag.
                assert!(!got[d.index].2.contains('<'));
            }
        }
        let want: Vec<_> = whole
            .into_iter()
            .map(|c| (c.id, c.name, c.arguments))
            .collect();
        assert_eq!(got, want);
    }
}
