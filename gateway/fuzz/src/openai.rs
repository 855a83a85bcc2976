//! Target `openai`: OpenAI request validation as the entry stage runs it on
//! an opened body (embeddings, completions, chat).
//!
//! Property: a request either validates or is refused with an OpenAI error
//! (`invalid_request_error`, a message); it never panics.

use proto::openai::ApiError;

/// SmolLM2's vocabulary and the stage's default `max_tokens`, as served.
const VOCAB: u32 = 49_152;
const DEFAULT_MAX_TOKENS: u32 = 16;

/// Runs one input: the first byte picks the endpoint, the rest is the body.
pub fn run(data: &[u8]) {
    let Some((which, body)) = crate::selector(data) else {
        return;
    };
    let refused = match which % 3 {
        0 => proto::openai::parse_embeddings(body, 2048, 384).err(),
        1 => proto::completions::parse_completions(body, VOCAB).err(),
        _ => proto::chat::parse_chat(body, VOCAB, DEFAULT_MAX_TOKENS).err(),
    };
    if let Some(e) = refused {
        well_formed(&e);
    }
}

fn well_formed(e: &ApiError) {
    let body: serde_json::Value =
        serde_json::from_slice(&e.body_bytes()).expect("an error body is JSON");
    let message = body["error"]["message"].as_str().expect("a message");
    assert!(!message.is_empty());
}
