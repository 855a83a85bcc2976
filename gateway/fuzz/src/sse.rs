//! Target `sse`: the proxy's reading of the event stream it opened
//! ([`client::sealed::sse`]), fed in pieces as the pump feeds it.
//!
//! Properties: what goes out is whole events, never any byte of a `[DONE]`
//! event, and never more than arrived; a stream that ends with an error
//! event is recognised as such.

use client::sealed::sse::{ends_with_error_event, forwardable};
use proto::completions::STREAM_DONE;

/// Runs one input: the first byte sets the piece size, the rest is the
/// opened stream.
pub fn run(data: &[u8]) {
    let Some((piece, all)) = crate::selector(data) else {
        return;
    };
    let piece = usize::from(piece).max(1);
    let mut forwarded = 0;
    let mut end = 0;
    while end < all.len() {
        end = (end + piece).min(all.len());
        let (upto, done) = forwardable(&all[..end], forwarded);
        assert!(
            upto >= forwarded && upto <= end,
            "forwards only what arrived"
        );
        let out = &all[forwarded..upto];
        assert!(
            out.is_empty() || out.ends_with(b"\n\n"),
            "whole events only"
        );
        if done {
            assert!(all[upto..end].starts_with(STREAM_DONE), "stops at [DONE]");
            break;
        }
        forwarded = upto;
    }
    let _ = ends_with_error_event(all);
    let mut with_error = all.to_vec();
    if !with_error.is_empty() && !with_error.ends_with(b"\n\n") {
        with_error.extend_from_slice(b"\n\n");
    }
    with_error.extend_from_slice(br#"data: {"error":{"message":"stage failed"}}"#);
    with_error.extend_from_slice(b"\n\n");
    assert!(
        ends_with_error_event(&with_error),
        "an appended error event is last"
    );
}
