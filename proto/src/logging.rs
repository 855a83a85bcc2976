//! The one logging setup both binaries use (it lives in `proto` because that
//! is the crate they share): human-readable lines on a terminal, one JSON
//! object per line otherwise (`LOG_FORMAT=json|text` overrides), filtered by
//! `RUST_LOG` (default `info`), always to standard error. Nothing logged
//! anywhere carries request content, keys or tokens.

use std::io::IsTerminal;

/// Installs the global subscriber.
pub fn init() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let json = match std::env::var("LOG_FORMAT").as_deref() {
        Ok("json") => true,
        Ok("text") => false,
        _ => !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(filter);
    if json {
        builder
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .init();
    } else {
        builder.init();
    }
}
