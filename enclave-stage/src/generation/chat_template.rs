//! The model's chat template, rendered inside the entry stage.
//!
//! The template is the GGUF's `tokenizer.chat_template` (part of the measured
//! model file), written in Hugging Face's Jinja dialect. It is rendered with
//! minijinja set up as `transformers`' `apply_chat_template` sets up Jinja:
//! `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`,
//! Python string methods (minijinja-contrib's pycompat), `bos_token` and
//! `eos_token`, and `add_generation_prompt` true. The rendered text is
//! tokenized like a completions prompt (special-token text such as
//! `<|im_start|>` becomes the special token, as in `transformers`).

use minijinja::{Environment, Error, ErrorKind, Value};
use proto::chat::ChatMessage;
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
        })
    }

    /// The prompt for `messages`, ending where the assistant's answer begins.
    /// An error is the template's own complaint (e.g. roles that must
    /// alternate) and is safe to return to the client.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, String> {
        if messages.len() > MAX_CHAT_MESSAGES {
            return Err(format!(
                "at most {MAX_CHAT_MESSAGES} messages are accepted; this request has {}",
                messages.len()
            ));
        }
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| {
                let mut o = BTreeMap::new();
                o.insert("role".to_string(), Value::from(m.role.as_str()));
                o.insert("content".to_string(), Value::from(m.content.as_str()));
                Value::from_object(o)
            })
            .collect();
        let tmpl = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        tmpl.render(minijinja::context! {
            messages => messages,
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
        let e = t.render(&[msg("user", "hi")]).unwrap_err();
        assert!(e.contains("ran too long"), "{e}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
        let t = ChatTemplate::new("{{ messages | length }}", "<s>", "</s>").unwrap();
        let many = vec![msg("user", "x"); MAX_CHAT_MESSAGES + 1];
        assert!(t.render(&many).unwrap_err().contains("at most"));
        assert_eq!(t.render(&many[..3]).unwrap(), "3");
    }

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
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
            .render(&[msg("user", "  hi  "), msg("assistant", "yo")])
            .unwrap();
        assert_eq!(
            out,
            "<B><s>default</s>\n<user>hi</user>\n<assistant>yo</assistant>\n<assistant>"
        );
        // Message text is data, never template source.
        let out = t.render(&[msg("system", "{{ 7 * 6 }}")]).unwrap();
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
        assert_eq!(t.render(&[msg("user", "a")]).unwrap(), "a");
        let e = t.render(&[msg("system", "a")]).unwrap_err();
        assert!(e.contains("System role not supported"), "{e}");
        assert!(ChatTemplate::new("{% for %}", "", "")
            .err()
            .unwrap()
            .contains("does not parse"));
    }
}
