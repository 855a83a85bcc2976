//! Per-route deadlines (`server.request_timeout_secs` and
//! `[server.timeouts]`): a request whose response headers are not ready in
//! time gets 504 in OpenAI's error shape, and its handler is dropped (which
//! also forgets its pending pipeline entry).
//!
//! The deadline covers reading the body, the pipeline and the answer up to
//! the response headers. A streamed body (server-sent events) is not cut by
//! this layer once its headers are out: a streaming handler bounds its own
//! stream with [`RouteTimeouts::for_route`].

use crate::config::ServerConfig;
use crate::openai_error::ApiError;
use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use proto::openai::ApiEndpoint;
use std::sync::Arc;
use std::time::Duration;

/// Route template of the embeddings API.
pub const EMBEDDINGS: &str = ApiEndpoint::Embeddings.path();
/// Route template of the completions API.
pub const COMPLETIONS: &str = ApiEndpoint::Completions.path();
/// Route template of the chat API (the completions deadline applies).
pub const CHAT_COMPLETIONS: &str = ApiEndpoint::ChatCompletions.path();
/// Route template of the evidence bundle.
pub const ATTESTATION: &str = "/v1/attestation";

/// Default for `server.timeouts.attestation_secs`.
const DEFAULT_ATTESTATION: Duration = Duration::from_secs(10);

/// The deadline of every route.
#[derive(Clone, Debug)]
pub struct RouteTimeouts {
    default: Duration,
    embeddings: Duration,
    completions: Duration,
    attestation: Duration,
}

impl RouteTimeouts {
    /// Deadlines from `[server]` and `[server.timeouts]`.
    pub fn from_config(s: &ServerConfig) -> Self {
        let default = Duration::from_secs(s.request_timeout_secs);
        let or_default = |v: Option<u64>| v.map(Duration::from_secs).unwrap_or(default);
        Self {
            default,
            embeddings: or_default(s.timeouts.embeddings_secs),
            completions: or_default(s.timeouts.completions_secs),
            attestation: s
                .timeouts
                .attestation_secs
                .map(Duration::from_secs)
                .unwrap_or(DEFAULT_ATTESTATION),
        }
    }

    /// The deadline for a route template (as axum's `MatchedPath` has it).
    pub fn for_route(&self, route: &str) -> Duration {
        match route {
            EMBEDDINGS => self.embeddings,
            COMPLETIONS | CHAT_COMPLETIONS => self.completions,
            ATTESTATION => self.attestation,
            _ => self.default,
        }
    }
}

/// Middleware over every route: 504 `timeout` when the route's deadline
/// passes before the response headers are ready.
pub async fn enforce(State(t): State<Arc<RouteTimeouts>>, req: Request, next: Next) -> Response {
    let limit = match req.extensions().get::<MatchedPath>() {
        Some(p) => t.for_route(p.as_str()),
        None => t.default,
    };
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(resp) => resp,
        Err(_) => {
            tracing::warn!(
                timeout_secs = limit.as_secs(),
                "request timed out; answered 504"
            );
            ApiError::timeout(limit.as_secs()).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_get_their_own_deadlines() {
        let mut s: ServerConfig = toml::from_str("listen = \"127.0.0.1:1\"").unwrap();
        s.request_timeout_secs = 7;
        let t = RouteTimeouts::from_config(&s);
        assert_eq!(t.for_route(EMBEDDINGS), Duration::from_secs(7));
        assert_eq!(t.for_route(COMPLETIONS), Duration::from_secs(7));
        assert_eq!(t.for_route(ATTESTATION), Duration::from_secs(10));
        assert_eq!(t.for_route("/v1/models"), Duration::from_secs(7));
        s.timeouts.completions_secs = Some(300);
        s.timeouts.attestation_secs = Some(3);
        let t = RouteTimeouts::from_config(&s);
        assert_eq!(t.for_route(COMPLETIONS), Duration::from_secs(300));
        assert_eq!(t.for_route(CHAT_COMPLETIONS), Duration::from_secs(300));
        assert_eq!(t.for_route(ATTESTATION), Duration::from_secs(3));
        assert_eq!(t.for_route(EMBEDDINGS), Duration::from_secs(7));
    }
}
