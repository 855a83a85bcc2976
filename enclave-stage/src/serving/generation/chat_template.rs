//! The model's chat template, rendered inside the entry stage.
//!
//! The template is the GGUF's `tokenizer.chat_template` (part of the measured
//! model file), written in Hugging Face's Jinja dialect. It is rendered with
//! minijinja set up as `transformers`' `apply_chat_template` sets up Jinja:
//! `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`,
//! Python string methods (minijinja-contrib's pycompat), `bos_token` and
//! `eos_token`, and `add_generation_prompt` true. In the rendered text the
//! template's own special-token text (`<|im_start|>`) becomes the special
//! token, as in `transformers`; the request's strings are content, marked
//! before the template runs so that special-token text in them is tokenized
//! as text ([`super::content_text`]).
//!
//! A template that writes tool calls in the Hermes style (its source has
//! `<tool_call>`: Qwen2.5 and Qwen3, Hermes, SmolLM3) is given the tools and
//! the conversation's calls and results its own way, as `transformers`
//! passes them (`tools`, `message.tool_calls` with `function.arguments` as
//! an object, `tool` messages): its call syntax is the one the exit stage's
//! grammar decodes. Other templates get the generic convention of
//! `proto::tools` (rendered by the entry stage before the template runs).

use super::content_text::{ContentMarks, MARK};
use minijinja::value::Serde;
use minijinja::{Environment, Error, ErrorKind, Value};
use proto::chat::ChatMessage;
use proto::tools::{ToolDef, CALL_TAG};
use std::borrow::Cow;
use std::collections::BTreeMap;

/// Name of the one template in the environment.
const NAME: &str = "chat";
/// The most template instructions one rendering may run (minijinja's
/// fuel): the template is the model file's, and it loops over messages the
/// client chose, so its work is bounded. Ordinary templates use a few
/// dozen per message.
pub const TEMPLATE_FUEL: u64 = 2_000_000;
/// The most messages one chat request may have.
pub const MAX_CHAT_MESSAGES: usize = 4096;

/// A parsed chat template with its special-token strings.
pub struct ChatTemplate {
    /// Boxed: an environment is a few kilobytes, and models are moved around.
    env: Box<Environment<'static>>,
    bos: String,
    eos: String,
    takes_tools: bool,
    /// Whether the source holds [`MARK`] (then it cannot take marks).
    source_has_mark: bool,
    /// Marks for the request's strings (none: rendered as given).
    marks: Option<ContentMarks>,
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

impl ChatTemplate {
    /// Parses `source`; `bos` and `eos` are the token strings templates may use.
    pub fn new(source: &str, bos: &str, eos: &str) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| e.to_string())?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| format!("the model's chat template does not parse: {e}"))?;
        Ok(Self {
            env: Box::new(env),
            bos: bos.into(),
            eos: eos.into(),
            takes_tools: source.contains(CALL_TAG),
            source_has_mark: source.contains(MARK),
            marks: None,
        })
    }

    /// This template with every string of a request (contents, tool
    /// results, past calls' names, ids and arguments, tools' definitions)
    /// marked by `marks` before it runs, so that the rendered prompt,
    /// tokenized by [`super::content_text::encode`], holds content's
    /// special-token text as text. Refused for a template whose own
    /// source holds the mark (U+FDD0).
    pub fn with_marks(mut self, marks: ContentMarks) -> Result<Self, String> {
        if self.source_has_mark {
            return Err(
                "the model's chat template holds U+FDD0, which the stage reserves to mark \
                 message content"
                    .into(),
            );
        }
        self.marks = Some(marks);
        Ok(self)
    }

    /// Whether the template writes tool calls in the syntax the exit
    /// stage decodes, and so is given tools and calls its own way.
    pub fn takes_tools(&self) -> bool {
        self.takes_tools
    }

    /// The prompt for `messages` and `tools` (given only to a template that
    /// [takes them](ChatTemplate::takes_tools)), ending where the
    /// assistant's answer begins. An error is the template's own complaint
    /// (e.g. roles that must alternate) and is safe to return to the client.
    pub fn render(&self, messages: &[ChatMessage], tools: &[ToolDef]) -> Result<String, String> {
        if messages.len() > MAX_CHAT_MESSAGES {
            return Err(format!(
                "at most {MAX_CHAT_MESSAGES} messages are accepted; this request has {}",
                messages.len()
            ));
        }
        let (messages, tools) = match &self.marks {
            Some(m) => (
                Cow::Owned(messages.iter().map(|x| marked_message(m, x)).collect()),
                Cow::Owned(tools.iter().map(|t| marked_tool(m, t)).collect()),
            ),
            None => (Cow::Borrowed(messages), Cow::Borrowed(tools)),
        };
        let messages: Vec<Value> = messages.iter().map(message_value).collect();
        let tools: Option<Vec<serde_json::Value>> =
            (!tools.is_empty()).then(|| tools.iter().map(tool_value).collect());
        let tmpl = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools.map(|t| Value::from(Serde(t))),
            add_generation_prompt => true,
            bos_token => self.bos.as_str(),
            eos_token => self.eos.as_str(),
        })
        .map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation => format!(
                "the chat template refused the messages: {}",
                e.detail().unwrap_or("no reason given")
            ),
            ErrorKind::OutOfFuel => {
                "the chat template ran too long on these messages (its instruction budget \
                 is spent)"
                    .to_string()
            }
            _ => format!("the chat template failed on these messages: {e}"),
        })
    }
}

/// `m` with every string the request gave marked.
fn marked_message(marks: &ContentMarks, m: &ChatMessage) -> ChatMessage {
    let mark = |s: &str| marks.mark(s).into_owned();
    ChatMessage {
        role: m.role.clone(),
        content: mark(&m.content),
        tool_calls: m
            .tool_calls
            .iter()
            .map(|c| proto::chat::PastCall {
                id: mark(&c.id),
                name: mark(&c.name),
                arguments: mark(&c.arguments),
            })
            .collect(),
        tool_call_id: m.tool_call_id.as_deref().map(mark),
    }
}

/// `t` with every string the request gave marked.
fn marked_tool(marks: &ContentMarks, t: &ToolDef) -> ToolDef {
    let mark = |s: &str| marks.mark(s).into_owned();
    ToolDef {
        name: mark(&t.name),
        description: t.description.as_deref().map(mark),
        parameters: mark(&t.parameters),
    }
}

/// A message as templates read it: `role`, `content`, and for tools
/// `tool_calls` (each `{"id", "type", "function": {"name", "arguments"}}`,
/// the arguments an object when they are JSON, as `transformers` passes
/// them) or `tool_call_id`.
fn message_value(m: &ChatMessage) -> Value {
    let mut o = BTreeMap::new();
    o.insert("role".to_string(), Value::from(m.role.as_str()));
    o.insert("content".to_string(), Value::from(m.content.as_str()));
    if !m.tool_calls.is_empty() {
        let calls: Vec<serde_json::Value> = m
            .tool_calls
            .iter()
            .map(|c| {
                let args = serde_json::from_str::<serde_json::Value>(&c.arguments)
                    .unwrap_or_else(|_| serde_json::Value::String(c.arguments.clone()));
                serde_json::json!({"id": c.id, "type": "function",
                                   "function": {"name": c.name, "arguments": args}})
            })
            .collect();
        o.insert("tool_calls".to_string(), Value::from(Serde(calls)));
    }
    if let Some(id) = &m.tool_call_id {
        o.insert("tool_call_id".to_string(), Value::from(id.as_str()));
    }
    Value::from_object(o)
}

/// A tool as templates read it: OpenAI's `{"type": "function", "function":
/// {"name", "description", "parameters"}}`.
fn tool_value(t: &ToolDef) -> serde_json::Value {
    let params: serde_json::Value =
        serde_json::from_str(&t.parameters).unwrap_or(serde_json::Value::Null);
    let mut f = serde_json::json!({"name": t.name, "parameters": params});
    if let Some(d) = &t.description {
        f["description"] = serde_json::Value::String(d.clone());
    }
    serde_json::json!({"type": "function", "function": f})
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 29, finding 8: a template that would run for ever (or a very
    /// long time) stops at its fuel; too many messages are refused.
    #[test]
    fn rendering_is_bounded() {
        let t = ChatTemplate::new(
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let t0 = std::time::Instant::now();
        let e = t.render(&[msg("user", "hi")], &[]).unwrap_err();
        assert!(e.contains("ran too long"), "{e}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
        let t = ChatTemplate::new("{{ messages | length }}", "<s>", "</s>").unwrap();
        let many = vec![msg("user", "x"); MAX_CHAT_MESSAGES + 1];
        assert!(t.render(&many, &[]).unwrap_err().contains("at most"));
        assert_eq!(t.render(&many[..3], &[]).unwrap(), "3");
    }

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::text(role, content)
    }

    #[test]
    fn renders_like_jinja_for_hugging_face() {
        // A ChatML template in the style of those shipped with models,
        // using block trimming, loop state, a string method and bos_token.
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}\n\
             {% if loop.first and m['role'] != 'system' %}<s>default</s>\n{% endif %}\n\
             <{{ m['role'] }}>{{ m['content'].strip() }}</{{ m.role }}>\n\
             {% endfor %}\n\
             {% if add_generation_prompt %}<assistant>{% endif %}",
            "<B>",
            "<E>",
        )
        .unwrap();
        let out = t
            .render(&[msg("user", "  hi  "), msg("assistant", "yo")], &[])
            .unwrap();
        assert_eq!(
            out,
            "<B><s>default</s>\n<user>hi</user>\n<assistant>yo</assistant>\n<assistant>"
        );
        // Message text is data, never template source.
        let out = t.render(&[msg("system", "{{ 7 * 6 }}")], &[]).unwrap();
        assert!(out.contains("{{ 7 * 6 }}"), "{out}");
    }

    #[test]
    fn template_errors_are_clear() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{% if m.role == 'system' %}\
             {{ raise_exception('System role not supported') }}{% endif %}{{ m.content }}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(t.render(&[msg("user", "a")], &[]).unwrap(), "a");
        let e = t.render(&[msg("system", "a")], &[]).unwrap_err();
        assert!(e.contains("System role not supported"), "{e}");
        assert!(ChatTemplate::new("{% for %}", "", "")
            .err()
            .unwrap()
            .contains("does not parse"));
    }

    #[test]
    fn a_template_that_takes_tools_gets_them_its_own_way() {
        // A Hermes-style template of the kind Qwen models ship (written
        // here): the tools as JSON lines, calls in <tool_call> tags with the
        // arguments as an object, results in <tool_response> tags.
        let source = "{% if tools %}<|system|>Tools:\n{% for t in tools %}{{ t | tojson }}\n\
            {% endfor %}{% endif %}{% for m in messages %}\
            {% if m.role == 'assistant' and m.tool_calls %}<|assistant|>\
            {% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \
            \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}\n\
            {% elif m.role == 'tool' %}<|user|><tool_response>{{ m.content }}</tool_response>\n\
            {% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}{% endfor %}<|assistant|>";
        let t = ChatTemplate::new(source, "", "").unwrap();
        assert!(t.takes_tools());
        assert!(!ChatTemplate::new("{{ messages }}", "", "")
            .unwrap()
            .takes_tools());
        let body = serde_json::json!({"model": "m", "tool_choice": "auto",
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
                    "type": "function", "function": {"name": "get_weather",
                    "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
            "tools": [{"type": "function", "function": {"name": "get_weather",
                "description": "Weather", "parameters": {"type": "object"}}}]});
        let chat = proto::chat::parse_chat(body.to_string().as_bytes(), 1000, 16).unwrap();
        let out = t.render(&chat.messages, &chat.tools).unwrap();
        assert!(out.starts_with("<|system|>Tools:\n{"), "{out}");
        // `tojson` writes as Python's json.dumps does (keys sorted here).
        assert!(out.contains("\"name\": \"get_weather\""), "{out}");
        assert!(out.contains("\"description\": \"Weather\""), "{out}");
        assert!(
            out.contains(
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"
            ),
            "the arguments as an object: {out}"
        );
        assert!(
            out.contains("<|user|><tool_response>sunny</tool_response>"),
            "{out}"
        );
        // Without tools the variable is undefined, as in transformers.
        let out = t.render(&chat.messages[..1], &[]).unwrap();
        assert_eq!(out, "<|user|>Weather in Paris?\n<|assistant|>");
    }
}
