//! The one logging setup both binaries use (it lives in `proto` because that
//! is the crate they share): human-readable lines on a terminal, one JSON
//! object per line otherwise (`LOG_FORMAT=json|text` overrides), filtered by
//! `RUST_LOG` (default `info`), always to standard error. Nothing logged
//! anywhere carries request content, keys or tokens: a panic is logged as
//! where it happened, not its message ([`install_panic_hook`]).

use std::io::IsTerminal;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::Layer as _;

/// A further layer beside the log output (the gateway's trace exporter),
/// with its own filter.
pub type ExtraLayer =
    Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync + 'static>;

/// Installs the global subscriber.
pub fn init() {
    init_with(None)
}

/// Installs the global subscriber with `extra` beside the log output; the
/// `RUST_LOG` filter applies to the log output only.
pub fn init_with(extra: Option<ExtraLayer>) {
    let filter =
        || tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let json = match std::env::var("LOG_FORMAT").as_deref() {
        Ok("json") => true,
        Ok("text") => false,
        _ => !std::io::stderr().is_terminal(),
    };
    let text_layer = (!json).then(|| {
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_filter(filter())
    });
    let json_layer = json.then(|| {
        tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .with_filter(filter())
    });
    tracing_subscriber::registry()
        .with(extra)
        .with(text_layer)
        .with(json_layer)
        .init();
    install_panic_hook();
}

/// Logs every panic as where it happened and on which thread, never its
/// message: a message can quote the data it failed on (a string slice's
/// error quotes up to 256 bytes of the string, which in a tokenizer is part
/// of a prompt), and nothing logged may carry request content.
pub fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let at = info.location().map_or_else(
            || "unknown".to_string(),
            |l| format!("{}:{}", l.file(), l.line()),
        );
        let thread = std::thread::current();
        tracing::error!(
            at = %at,
            thread = thread.name().unwrap_or("unnamed"),
            "panic (its message is not logged: it may quote request data)"
        );
    }));
}
