//! The HTTP API: routes, body limits, sealing for plain clients, relaying
//! for sealed clients, receipts, evidence and published keys.

use crate::auth::{ApiKeys, Caller};
use crate::metrics::Metrics;
use crate::openai_error::ApiError;
use crate::pipeline::Replicas;
use crate::receipts::ReceiptStore;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, Uri};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use proto::openai::ApiEndpoint;
use proto::sealing::{
    open_request, KeyConfig, ReplayGuard, SealedHeaders, ServerKey, HEADER_KEY_ID,
};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod info;
mod relay;
mod stream;

use info::{attestation, get_model, get_receipt, hpke_keys, list_models, metrics_handler, readyz};
use relay::{embeddings_handler, generation_handler, owner_of};

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

/// Whose a request's receipt is: the name of the API key that made it
/// (`[auth]` on), or nobody's (`None`, `[auth]` off).
type Owner = Option<Arc<str>>;

/// Settings the handlers need.
#[derive(Clone, Debug)]
pub struct ApiLimits {
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Deadline of an embeddings request in the pipeline.
    pub timeout: Duration,
    /// Every route's deadline (enforced by [`crate::timeouts::enforce`]).
    pub routes: Arc<crate::timeouts::RouteTimeouts>,
}

/// Shared handler state.
#[derive(Clone)]
pub struct AppState {
    /// The embeddings pipeline's replicas.
    pub pipeline: Arc<Replicas>,
    /// The completions pipeline's replicas, when configured.
    pub completions: Option<Arc<Replicas>>,
    /// Limits.
    pub limits: ApiLimits,
    /// Recent receipts.
    pub receipts: Arc<ReceiptStore>,
    /// The gateway's own HPKE key (published as gateway-held).
    pub gateway_key: Arc<GatewayKey>,
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
}

impl AppState {
    /// Every model's replicas, embeddings first.
    pub fn pipelines(&self) -> Vec<&Arc<Replicas>> {
        std::iter::once(&self.pipeline)
            .chain(self.completions.as_ref())
            .collect()
    }

    /// The replicas serving a model id.
    fn by_model(&self, model: &str) -> Option<&Arc<Replicas>> {
        self.pipelines().into_iter().find(|p| p.model_id() == model)
    }
}

/// Key ids of the gateway-held HPKE keys (enclave-held keys use the lower half).
pub const GATEWAY_HPKE_KEY_IDS: std::ops::RangeInclusive<u8> = 0x80..=0xff;

/// The gateway's own HPKE keys: clients that seal to one trust the host with
/// their plaintext (the receipt records `sealing = gateway`). With `[keys]
/// rotate_secs` a new key replaces the current one on schedule, and the
/// replaced one is accepted `overlap_secs` longer.
pub struct GatewayKey {
    /// The keys accepted, current first, each with when it retires.
    keys: std::sync::RwLock<Vec<(ServerKey, Option<Instant>)>>,
    rotation: Option<(Duration, Duration)>,
    replay: std::sync::Mutex<ReplayGuard>,
}

impl GatewayKey {
    /// A fresh key that never rotates.
    pub fn generate() -> Self {
        Self::rotating(None)
    }

    /// A fresh key, replaced every `rotation.0` and overlapping its
    /// successor by `rotation.1` (see [`GatewayKey::run`]).
    pub fn rotating(rotation: Option<(Duration, Duration)>) -> Self {
        Self {
            keys: std::sync::RwLock::new(vec![(
                ServerKey::generate(*GATEWAY_HPKE_KEY_IDS.start()),
                None,
            )]),
            rotation,
            replay: std::sync::Mutex::new(ReplayGuard::new(proto::sealing::REPLAY_WINDOW, 1 << 20)),
        }
    }

    /// The current key's id.
    pub fn key_id(&self) -> u8 {
        self.keys.read().unwrap()[0].0.key_id()
    }

    /// Whether `key_id` is one of the gateway's key ids (current, retiring
    /// or retired: all are answered by the gateway, never relayed).
    pub fn owns(key_id: u8) -> bool {
        GATEWAY_HPKE_KEY_IDS.contains(&key_id)
    }

    /// The configurations of the keys accepted now, current first.
    pub fn configs(&self) -> Vec<KeyConfig> {
        let now = Instant::now();
        let keys = self.keys.read().unwrap();
        keys.iter()
            .filter(|(_, retires)| retires.is_none_or(|at| at > now))
            .map(|(k, _)| k.config())
            .collect()
    }

    /// Makes a new current key (the next id in the gateway's range) and
    /// retires the one it replaces after `overlap`.
    pub fn rotate(&self, overlap: Duration) {
        let now = Instant::now();
        let mut keys = self.keys.write().unwrap();
        keys.retain(|(_, retires)| retires.is_none_or(|at| at > now));
        let mut id = keys[0].0.key_id();
        loop {
            id = if id == *GATEWAY_HPKE_KEY_IDS.end() {
                *GATEWAY_HPKE_KEY_IDS.start()
            } else {
                id + 1
            };
            if keys.iter().all(|(k, _)| k.key_id() != id) {
                break;
            }
        }
        for (_, retires) in keys.iter_mut().filter(|(_, r)| r.is_none()) {
            *retires = Some(now + overlap);
        }
        keys.insert(0, (ServerKey::generate(id), None));
        tracing::info!(key_id = id, "gateway HPKE key rotated");
    }

    /// Rotates on the schedule, forever (returns at once without one).
    pub async fn run(self: Arc<Self>) {
        let Some((every, overlap)) = self.rotation else {
            return;
        };
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tick.tick().await;
            self.rotate(overlap);
        }
    }

    fn open(
        &self,
        sealed: &SealedHeaders,
        body: &[u8],
    ) -> Result<(Vec<u8>, proto::sealing::ResponseKeyMaterial), ApiError> {
        let now = Instant::now();
        let key = self
            .keys
            .read()
            .unwrap()
            .iter()
            .find(|(k, retires)| k.key_id() == sealed.key_id && retires.is_none_or(|at| at > now))
            .map(|(k, _)| k.clone())
            .ok_or_else(|| ApiError::unknown_key(sealed.key_id))?;
        let (plaintext, material) = open_request(&key, sealed, body).map_err(|e| {
            ApiError::invalid(
                Some(HEADER_KEY_ID),
                format!("the sealed request cannot be opened: {e}"),
            )
        })?;
        let mut guard = self.replay.lock().unwrap();
        // An old request is refused outright; checked under the guard's lock,
        // at the moment it is recorded, so no replay outlives the guard.
        proto::sealing::check_fresh(sealed, proto::sealing::unix_now()).map_err(ApiError::stale)?;
        let now = Instant::now();
        guard
            .check_and_insert(&sealed.enc, now)
            .map_err(|e| match e {
                // Full of keys still inside their window: ask to retry when
                // the oldest leaves it, rather than refusing for good.
                proto::sealing::SealError::ReplayCacheFull => {
                    ApiError::replay_guard_full(guard.retry_after(now).as_secs().max(1))
                }
                e => ApiError::invalid(Some(HEADER_KEY_ID), format!("refused: {e}")),
            })?;
        Ok((plaintext, material))
    }
}

/// Builds the router.
///
/// With `[auth] enabled`, the API routes (embeddings, models, receipts) need
/// a key. What a client needs before it can trust the gateway (evidence,
/// published HPKE keys) and what operators probe (health, readiness,
/// metrics) stay open.
pub fn router(state: AppState) -> Router {
    let mut keyed = Router::new().route(ApiEndpoint::Embeddings.path(), post(embeddings_handler));
    for e in [ApiEndpoint::ChatCompletions, ApiEndpoint::Completions] {
        keyed = keyed.route(
            e.path(),
            post(
                move |State(s): State<AppState>,
                      caller: Option<Extension<Caller>>,
                      h: HeaderMap,
                      b: Body| { generation_handler(s, e, owner_of(caller), h, b) },
            ),
        );
    }
    let keyed = keyed
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/receipts/{id}", get(get_receipt))
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
    let generation = s.completions.as_ref().map(|p| p.model_id().to_string());
    crate::telemetry::TracedRoutes(vec![
        TracedRoute {
            route: crate::timeouts::EMBEDDINGS,
            operation: "embeddings",
            model: Some(s.pipeline.model_id().to_string()),
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
