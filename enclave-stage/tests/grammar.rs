//! The grammars of structured outputs and tool calls on SmolLM2's real
//! vocabulary: a request as a client sends it is parsed by
//! `proto::chat::parse_chat`, its grammar compiled by the stage's
//! [`Grammars`], and texts are fed to the matcher token by token as the
//! tokenizer cuts them, each token checked against the step's mask, the end
//! of sequence against the last one. What a broken grammar would let
//! through (or block) fails here.

mod support;

use enclave_stage::serving::generation::grammar::{grammar_text, Grammars};
use proto::chat::parse_chat;
use proto::completions::CompletionsRequest;
use proto::tools::{render_call, CALL_SEP};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

struct Vocab {
    grammars: Grammars,
    tokenizer: Tokenizer,
    eos: u32,
}

fn vocab() -> Vocab {
    let path = support::smollm_dir().join("tokenizer.json");
    let bytes = std::fs::read(&path).unwrap();
    let tokenizer = Tokenizer::from_bytes(&bytes).unwrap();
    let eos = tokenizer.token_to_id("<|im_end|>").unwrap();
    let grammars = Grammars::new(&bytes, tokenizer.clone(), 49152, eos).unwrap();
    Vocab {
        grammars,
        tokenizer,
        eos,
    }
}

/// A chat request with `extra` fields, as the entry stage parses it.
fn request(extra: Value) -> CompletionsRequest {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    parse_chat(body.to_string().as_bytes(), 49152, 64)
        .unwrap()
        .request
}

impl Vocab {
    /// Whether the grammar of `r` lets the model write `text` (as the
    /// tokenizer cuts it) and then end.
    fn accepts(&self, r: &CompletionsRequest, text: &str) -> bool {
        let g = grammar_text(r).expect("constrained");
        let mut m = self.grammars.matcher(&g).unwrap();
        let ids = self
            .tokenizer
            .encode(text, false)
            .unwrap()
            .get_ids()
            .to_vec();
        for t in ids {
            let mask = m.compute_mask_or_eos().unwrap();
            if !mask.is_allowed(t) {
                return false;
            }
            m.consume_token(t).unwrap();
        }
        m.compute_mask_or_eos().unwrap().is_allowed(self.eos)
    }
}

fn schema_request(schema: Value) -> CompletionsRequest {
    request(json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "s", "strict": true, "schema": schema}}}))
}

#[test]
fn json_schema_outputs() {
    let v = vocab();
    let r = schema_request(json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"], "additionalProperties": false}));
    assert!(v.accepts(&r, r#"{"name": "Ada", "age": 36}"#));
    assert!(v.accepts(&r, "{\n    \"name\": \"Ada\",\n    \"age\": 36\n}"));
    assert!(!v.accepts(&r, r#"{"name": "Ada", "age": -1}"#), "minimum");
    assert!(!v.accepts(&r, r#"{"name": "Ada"}"#), "required");
    assert!(
        !v.accepts(&r, r#"{"name": "Ada", "age": 3, "x": 1}"#),
        "additional"
    );
    assert!(
        !v.accepts(&r, r#"Sure! {"name": "Ada", "age": 3}"#),
        "prose"
    );
    let ws = " ".repeat(40);
    assert!(
        !v.accepts(&r, &format!(r#"{{{ws}"name": "Ada", "age": 36}}"#)),
        "whitespace is bounded"
    );
    let r = request(json!({"response_format": {"type": "json_object"}}));
    assert!(v.accepts(&r, r#"{"anything": [1, 2, {"b": null}]}"#));
    assert!(!v.accepts(&r, "[1, 2]"));
    let r = schema_request(json!({"type": "string", "enum": ["red", "green"]}));
    assert!(v.accepts(&r, r#""green""#) && !v.accepts(&r, r#""blue""#));
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "now"}}
    ])
}

#[test]
fn tool_call_outputs() {
    let v = vocab();
    let call = render_call("get_weather", r#"{"city": "Paris"}"#);
    let two = format!("{call}{CALL_SEP}{}", render_call("now", "{}"));
    let r = request(json!({"tools": tools(), "tool_choice": "required",
                           "parallel_tool_calls": true}));
    assert!(v.accepts(&r, &call));
    assert!(v.accepts(&r, &two));
    assert!(!v.accepts(&r, "It is sunny in Paris."), "required: a call");
    assert!(
        !v.accepts(&r, &render_call("get_weather", r#"{"town": "Paris"}"#)),
        "parameters"
    );
    assert!(
        !v.accepts(&r, &render_call("delete_all", "{}")),
        "unknown function"
    );
    // One call per answer unless parallel calls are asked for.
    let r = request(json!({"tools": tools(), "tool_choice": "required"}));
    assert!(v.accepts(&r, &call) && !v.accepts(&r, &two));
    let r = request(json!({"tools": tools(),
                           "tool_choice": {"type": "function", "function": {"name": "now"}}}));
    assert!(!v.accepts(&r, &call) && v.accepts(&r, &render_call("now", "{}")));
    // auto: an answer or calls, and a call once begun is a call.
    let r = request(json!({"tools": tools()}));
    assert!(v.accepts(&r, "It is sunny in Paris."));
    assert!(v.accepts(&r, "I'd say <tool_call> is a tag."));
    assert!(v.accepts(&r, &call));
    assert!(!v.accepts(&r, "<tool_call>\nsunny"));
    assert!(!v.accepts(&r, "  <tool_call>\n{\"name\": \"x\"}"));
    // auto with a response format: that format, or calls.
    let r = request(json!({"tools": tools(), "response_format": {"type": "json_object"}}));
    assert!(v.accepts(&r, r#"{"a": 1}"#) && v.accepts(&r, &call));
    assert!(!v.accepts(&r, "plain text"));
}

#[test]
fn schemas_the_engine_refuses_name_the_field() {
    let v = vocab();
    let bad = schema_request(json!({"type": "object", "minProperties": "x"}));
    let e = v.grammars.check(&bad).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("response_format"), "{}", e.message);
    let unsat = schema_request(json!({"type": "integer", "minimum": 5, "maximum": 1}));
    assert_eq!(
        v.grammars.check(&unsat).unwrap_err().param.as_deref(),
        Some("response_format")
    );
    let r = request(
        json!({"tools": [{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": "wat"}}}}}],
        "tool_choice": "required"}),
    );
    let e = v.grammars.check(&r).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("tools"));
    assert!(e.message.contains("`f`"), "{}", e.message);
    // A pattern with nested quantifiers compiles (derivatives, no
    // backtracking) and its masks stay within the engine's fuel.
    let r = schema_request(json!({"type": "string", "pattern": "^(a+)+(b|c+)*$"}));
    v.grammars.check(&r).unwrap();
    assert!(v.accepts(&r, r#""aaab""#) && !v.accepts(&r, r#""ba""#));
    assert!(v.grammars.check(&request(json!({}))).is_ok());
}

/// A grammar compiled once is served again from the stage's cache, each
/// time as a matcher of its own (one request's tokens never move another's
/// parser); only the last `CACHED_GRAMMARS` are kept.
#[test]
fn compiled_grammars_are_reused_as_independent_copies() {
    use enclave_stage::serving::generation::grammar::CACHED_GRAMMARS;
    let v = vocab();
    let r = schema_request(json!({"type": "string", "enum": ["red", "green"]}));
    let g = grammar_text(&r).unwrap();
    let before = v.grammars.cache_hits();
    let mut first = v.grammars.matcher(&g).unwrap();
    assert_eq!(v.grammars.cache_hits(), before, "a new grammar compiles");
    // The first matcher moves on; a copy served later starts at the start.
    let quote = v.tokenizer.encode("\"", false).unwrap().get_ids()[0];
    first.consume_token(quote).unwrap();
    let mut second = v.grammars.matcher(&g).unwrap();
    assert_eq!(
        v.grammars.cache_hits(),
        before + 1,
        "the same text is reused"
    );
    assert!(!second.compute_mask_or_eos().unwrap().is_allowed(v.eos));
    second.consume_token(quote).unwrap();
    assert!(v.accepts(&r, r#""red""#) && !v.accepts(&r, r#""blue""#));
    // Past the cache's size, the oldest grammar compiles again.
    for i in 0..CACHED_GRAMMARS {
        let other = schema_request(json!({"type": "string", "enum": [format!("v{i}")]}));
        v.grammars.matcher(&grammar_text(&other).unwrap()).unwrap();
    }
    let hits = v.grammars.cache_hits();
    v.grammars.matcher(&g).unwrap();
    assert_eq!(v.grammars.cache_hits(), hits, "the oldest was kept");
}
