//! The reading of a Server-Sent-Event stream the client opened: where the
//! whole events end, the `[DONE]` event that waits for the receipt, and
//! error events (the only way a stream may end without a receipt).
//!
//! Public so that the fuzz target `sse` (`gateway/fuzz`) drives the same code.

use proto::completions::STREAM_DONE;

/// How far into `all` the stream may go out, starting at `from` (an event
/// boundary): up to the end of its last complete event, or up to the start
/// of the `[DONE]` event (then `true`), which waits for the receipt.
pub fn forwardable(all: &[u8], from: usize) -> (usize, bool) {
    let mut at = from;
    while let Some(len) = all[at..].windows(2).position(|w| w == b"\n\n") {
        if all[at..].starts_with(STREAM_DONE) {
            return (at, true);
        }
        at += len + 2;
    }
    (at, false)
}

/// Whether the last event of an event stream is an error event.
pub fn ends_with_error_event(all: &[u8]) -> bool {
    let text = String::from_utf8_lossy(all);
    text.trim_end()
        .rsplit("\n\n")
        .next()
        .and_then(|e| e.strip_prefix("data: "))
        .is_some_and(|e| is_error_object(e.as_bytes()))
}

/// Whether `body` is an OpenAI error object (`{"error": {...}}`).
pub fn is_error_object(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .is_ok_and(|v| v.get("error").is_some_and(serde_json::Value::is_object))
}
