//! The HTTP API: routes, body limits, and the translation between HTTP and
//! the inference service (`crate::service`), which does the sealing,
//! relaying and receipts; evidence, published keys, receipts and models
//! are read here ([`info`]).

use crate::auth::{ApiKeys, Caller};
use crate::metrics::Metrics;
use crate::openai_error::ApiError;
use crate::service::Service;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, Uri};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use proto::openai::ApiEndpoint;
use serde_json::json;
use std::sync::Arc;

mod info;
mod models;

use info::{
    attestation, get_model, get_receipt, hpke_keys, list_models, metrics_handler, readyz,
    receipt_inclusion,
};
use models::{embeddings_handler, model_route, owner_of};

/// Response header carrying the receipt id (hex).
pub const HEADER_RECEIPT_ID: &str = "receipt-id";
/// Response header carrying the receipt itself (base64url), when it fits.
pub const HEADER_RECEIPT: &str = "receipt";
/// Response header carrying the salt of the receipt's digests (hex), where
/// the gateway knows it: requests it saw in plaintext (sent plain, or sealed
/// to the gateway's key). For requests sealed to the enclave only the
/// client learns it, inside the sealed response.
pub const HEADER_RECEIPT_DIGEST_SALT: &str = "receipt-digest-salt";
/// Request header with the client's receipt nonce (hex, at most 64 bytes).
pub const HEADER_RECEIPT_NONCE: &str = "receipt-nonce";
/// Response header of `/v1/attestation`: which replica of the model's
/// pipeline the evidence is from (its entry keys route to it).
pub const HEADER_REPLICA: &str = "pipeline-replica";
/// Largest receipt sent in a header.
const MAX_RECEIPT_HEADER: usize = 8 * 1024;

/// Settings the handlers need.
#[derive(Clone, Debug)]
pub struct ApiLimits {
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Every route's deadline (enforced by [`crate::timeouts::enforce`]).
    pub routes: Arc<crate::timeouts::RouteTimeouts>,
}

/// Shared handler state.
#[derive(Clone)]
pub struct AppState {
    /// The inference service: the models' replicas, the gateway's key,
    /// the receipt store.
    pub service: Arc<Service>,
    /// Limits.
    pub limits: ApiLimits,
    /// API keys and their limits.
    pub auth: Arc<ApiKeys>,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// Graceful shutdown state.
    pub shutdown: Arc<crate::shutdown::Shutdown>,
    /// `/v1/attestation`'s per-client rate and evidence cache.
    pub attestation: Arc<crate::attestation_limits::AttestationLimits>,
    /// The gateway-wide cap on requests in flight.
    pub in_flight: Arc<crate::in_flight::InFlightCap>,
    /// The transparency log served under `/v1/transparency/`, if any.
    pub transparency: Option<Arc<std::sync::Mutex<crate::transparency::Log>>>,
    /// The log's witnesses, asked to cosign at once when an attestation
    /// logs a new key set.
    pub witnessing: Option<Arc<crate::transparency::witnessing::Witnessing>>,
}

/// Builds the router.
///
/// With `[auth] enabled`, the API routes (embeddings, chat completions,
/// completions, models, receipts) need a key. What a client needs before it
/// can trust the gateway (evidence, published HPKE keys, the transparency
/// log) and what operators probe (health, readiness, metrics) stay open.
pub fn router(state: AppState) -> Router {
    let mut keyed = Router::new().route(ApiEndpoint::Embeddings.path(), post(embeddings_handler));
    for e in [ApiEndpoint::ChatCompletions, ApiEndpoint::Completions] {
        keyed = keyed.route(
            e.path(),
            post(
                move |State(s): State<AppState>,
                      caller: Option<Extension<Caller>>,
                      h: HeaderMap,
                      b: Body| { model_route(s, e, owner_of(caller), h, b) },
            ),
        );
    }
    let keyed = keyed
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/receipts/{id}", get(get_receipt))
        .route("/v1/receipts/{id}/inclusion", get(receipt_inclusion))
        // Inside the key check (the later route_layer runs first): a
        // request without a valid key never takes an in-flight permit.
        .route_layer(axum::middleware::from_fn_with_state(
            state.in_flight.clone(),
            crate::in_flight::limit,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            state.auth.clone(),
            crate::auth::require_key,
        ));
    let open = Router::new()
        .route("/v1/attestation", get(attestation))
        .route("/.well-known/hpke-keys", get(hpke_keys))
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_handler));
    // The log is public: anyone may read and mirror it.
    let open = match &state.transparency {
        Some(log) => open.merge(crate::transparency::http::routes(log.clone())),
        None => open,
    };
    keyed
        .merge(open)
        .fallback(|method: Method, uri: Uri| async move {
            ApiError::unknown_route(method.as_str(), uri.path())
        })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            ApiError::method_not_allowed(method.as_str(), uri.path())
        })
        .layer(axum::middleware::from_fn_with_state(
            Arc::new(traced_routes(&state)),
            crate::telemetry::trace_request,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.limits.routes.clone(),
            crate::timeouts::enforce,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.shutdown.clone(),
            crate::shutdown::guard,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.metrics.clone(),
            crate::metrics::track,
        ))
        .layer(axum::middleware::from_fn(request_id))
        .with_state(state)
}

/// The API routes that get a trace span, with the model each serves.
fn traced_routes(s: &AppState) -> crate::telemetry::TracedRoutes {
    use crate::telemetry::TracedRoute;
    let generation = s
        .service
        .completions
        .as_ref()
        .map(|p| p.model_id().to_string());
    crate::telemetry::TracedRoutes(vec![
        TracedRoute {
            route: crate::timeouts::EMBEDDINGS,
            operation: "embeddings",
            model: Some(s.service.embeddings.model_id().to_string()),
        },
        TracedRoute {
            route: crate::timeouts::COMPLETIONS,
            operation: "text_completion",
            model: generation.clone(),
        },
        TracedRoute {
            route: crate::timeouts::CHAT_COMPLETIONS,
            operation: "chat",
            model: generation,
        },
    ])
}

/// Response header (and log field) carrying the request id.
pub const HEADER_REQUEST_ID: &str = "x-request-id";

/// Gives every request an id: the client's `x-request-id` when it is short
/// and plain (letters, digits, `-`, `_`, `.`), else a fresh random one. The
/// id is echoed in the response and set on the request's log span.
async fn request_id(mut req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    use tracing::Instrument;
    let given = req
        .headers()
        .get(HEADER_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| {
            !v.is_empty()
                && v.len() <= 64
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        })
        .map(str::to_string);
    let id = given.unwrap_or_else(|| {
        use rand::RngCore;
        let mut b = [0u8; 12];
        rand::rngs::OsRng.fill_bytes(&mut b);
        hex::encode(b)
    });
    let value = HeaderValue::from_str(&id).expect("checked or hex");
    req.headers_mut().insert(HEADER_REQUEST_ID, value.clone());
    let span = tracing::info_span!("http", request_id = %id);
    let mut resp = next.run(req).instrument(span).await;
    resp.headers_mut().insert(HEADER_REQUEST_ID, value);
    resp
}
