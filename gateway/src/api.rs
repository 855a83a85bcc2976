//! The HTTP API: routes, body limits, sealing for plain clients, relaying
//! for sealed clients, receipts, evidence and published keys.

use crate::auth::ApiKeys;
use crate::metrics::Metrics;
use crate::openai_error::ApiError;
use crate::pipeline::{Failure, Pipeline, Reply, Submission};
use crate::receipts::ReceiptStore;
use axum::body::{to_bytes, Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use proto::bundle::{EvidenceBundle, StageEvidence};
use proto::receipt::Sealing;
use proto::sealing::{
    open_request, open_response, seal_request, seal_response, seal_response_with_trailer, Aead,
    ClientResponseKey, KeyConfig, ReplayGuard, ResponseKeyMaterial, ResponseOpener, ResponseSealer,
    SealLimits, SealedHeaders, ServerKey, HEADER_KEY_ID, KEYS_MEDIA_TYPE,
};
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Response header carrying the receipt id (hex).
pub const HEADER_RECEIPT_ID: &str = "receipt-id";
/// Response header carrying the receipt itself (base64url), when it fits.
pub const HEADER_RECEIPT: &str = "receipt";
/// Request header with the client's receipt nonce (hex, at most 64 bytes).
pub const HEADER_RECEIPT_NONCE: &str = "receipt-nonce";
/// Largest receipt sent in a header.
const MAX_RECEIPT_HEADER: usize = 8 * 1024;

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
    /// The embeddings pipeline.
    pub pipeline: Arc<Pipeline>,
    /// The completions pipeline, when configured.
    pub completions: Option<Arc<Pipeline>>,
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
}

impl AppState {
    /// Every pipeline, embeddings first.
    pub fn pipelines(&self) -> Vec<&Arc<Pipeline>> {
        std::iter::once(&self.pipeline)
            .chain(self.completions.as_ref())
            .collect()
    }

    /// The pipeline serving a model id.
    fn by_model(&self, model: &str) -> Option<&Arc<Pipeline>> {
        self.pipelines().into_iter().find(|p| p.model_id == model)
    }
}

/// Key id of the gateway-held HPKE key.
pub const GATEWAY_HPKE_KEY_ID: u8 = 0x80;

/// The gateway's own HPKE key: clients that seal to it trust the host with
/// their plaintext (the receipt records `sealing = gateway`).
pub struct GatewayKey {
    key: ServerKey,
    replay: std::sync::Mutex<ReplayGuard>,
}

impl GatewayKey {
    /// A fresh key.
    pub fn generate() -> Self {
        Self {
            key: ServerKey::generate(GATEWAY_HPKE_KEY_ID),
            replay: std::sync::Mutex::new(ReplayGuard::new(Duration::from_secs(600), 1 << 20)),
        }
    }

    /// Its key id.
    pub fn key_id(&self) -> u8 {
        self.key.key_id()
    }

    /// Its configuration.
    pub fn config(&self) -> KeyConfig {
        self.key.config()
    }

    fn open(
        &self,
        sealed: &SealedHeaders,
        body: &[u8],
    ) -> Result<(Vec<u8>, proto::sealing::ResponseKeyMaterial), ApiError> {
        let (plaintext, material) = open_request(&self.key, sealed, body).map_err(|e| {
            ApiError::invalid(
                Some(HEADER_KEY_ID),
                format!("the sealed request cannot be opened: {e}"),
            )
        })?;
        self.replay
            .lock()
            .unwrap()
            .check_and_insert(&sealed.enc, Instant::now())
            .map_err(|e| ApiError::invalid(Some(HEADER_KEY_ID), format!("refused: {e}")))?;
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
    let keyed = Router::new()
        .route("/v1/embeddings", post(embeddings_handler))
        .route("/v1/chat/completions", post(chat_handler))
        .route("/v1/completions", post(completions_handler))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/receipts/{id}", get(get_receipt))
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
    let generation = s.completions.as_ref().map(|p| p.model_id.clone());
    crate::telemetry::TracedRoutes(vec![
        TracedRoute {
            route: crate::timeouts::EMBEDDINGS,
            operation: "embeddings",
            model: Some(s.pipeline.model_id.clone()),
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

async fn metrics_handler(State(s): State<AppState>) -> Response {
    let mut text = s.metrics.render(Some(&s.pipeline.health()));
    let views = futures_util::future::join_all(s.pipelines().into_iter().map(|p| p.view())).await;
    text += &crate::stage_metrics::render(&views);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

fn model_json(id: &str) -> serde_json::Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "confidential-gateway"})
}

async fn list_models(State(s): State<AppState>) -> Response {
    let data: Vec<_> = s
        .pipelines()
        .iter()
        .map(|p| model_json(&p.model_id))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn get_model(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    if s.by_model(&id).is_some() {
        Json(model_json(&id)).into_response()
    } else {
        ApiError::model_not_found(&id).into_response()
    }
}

async fn readyz(State(s): State<AppState>) -> Response {
    let mut pipelines = Vec::new();
    let mut mock = false;
    for p in s.pipelines() {
        match p.status() {
            Ok(stages) => {
                mock |= stages.iter().any(|st| st.evidence == "mock");
                pipelines
                    .push(json!({"endpoint": p.endpoint, "model": p.model_id, "stages": stages}));
            }
            Err(reason) => {
                return ApiError::not_ready(&format!("{}: {reason}", p.model_id)).into_response()
            }
        }
    }
    let mut body = json!({
        "status": "ready",
        "model": s.pipeline.model_id,
        "stages": pipelines[0]["stages"],
        "pipelines": pipelines,
    });
    if mock {
        body["warning"] = json!(proto::attestation::MOCK_WARNING);
    }
    Json(body).into_response()
}

async fn get_receipt(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    let found = hex::decode(&id)
        .ok()
        .and_then(|b| <[u8; 16]>::try_from(b).ok())
        .and_then(|id| s.receipts.get(&id));
    match found {
        Some(r) => ([(header::CONTENT_TYPE, "application/cose")], r).into_response(),
        None => ApiError {
            code: Some("receipt_not_found"),
            ..ApiError::from_stage(404, format!("No receipt {id} is retained here."))
        }
        .into_response(),
    }
}

async fn hpke_keys(
    State(s): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let chosen: Vec<&Arc<Pipeline>> = match q.get("model") {
        Some(m) => match s.by_model(m) {
            Some(p) => vec![p],
            None => return ApiError::model_not_found(m).into_response(),
        },
        None => s.pipelines(),
    };
    let mut keys = Vec::new();
    let mut serves = HashMap::new();
    for p in chosen {
        match p.entry_keys() {
            Ok(k) => {
                for c in &k {
                    serves.insert(c.key_id, (p.model_id.clone(), p.endpoint));
                }
                keys.extend(k);
            }
            Err(reason) => return ApiError::not_ready(&reason).into_response(),
        }
    }
    keys.push(s.gateway_key.config());
    if q.get("format").map(String::as_str) == Some("json") {
        let list: Vec<_> = keys
            .iter()
            .map(|k| {
                let gateway = k.key_id == s.gateway_key.key_id();
                json!({
                    "key_id": k.key_id,
                    "public_key": hex::encode(k.public_key),
                    "kem": "DHKEM(X25519, HKDF-SHA256)",
                    "aeads": k.aeads.iter().map(|a| format!("{a:?}")).collect::<Vec<_>>(),
                    "held_by": if gateway { "gateway" } else { "enclave" },
                    "model": serves.get(&k.key_id).map(|m| m.0.clone()),
                    "endpoint": serves.get(&k.key_id).map(|m| m.1),
                    "note": if gateway {
                        "held by the untrusted host: it opens your request and re-seals it to the entry stage"
                    } else {
                        "held by the attested entry stage (stage 0); bound in its evidence at /v1/attestation"
                    },
                })
            })
            .collect();
        return Json(json!({"keys": list})).into_response();
    }
    (
        [(header::CONTENT_TYPE, KEYS_MEDIA_TYPE)],
        KeyConfig::encode_list(&keys),
    )
        .into_response()
}

async fn attestation(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let nonce = match q.get("nonce").map(hex::decode) {
        None => Vec::new(),
        Some(Ok(n)) if n.len() <= 64 => n,
        Some(_) => {
            return ApiError::invalid(Some("nonce"), "`nonce` must be hex, at most 64 bytes.")
                .into_response()
        }
    };
    let pipeline = match q.get("model") {
        Some(m) => match s.by_model(m) {
            Some(p) => p.clone(),
            None => return ApiError::model_not_found(m).into_response(),
        },
        None => s.pipeline.clone(),
    };
    let wait = s.limits.routes.for_route(crate::timeouts::ATTESTATION);
    let stages = match pipeline.attest(&nonce, wait).await {
        Ok(v) => v,
        Err(f) => return failure_response(&s, f),
    };
    let bundle = EvidenceBundle {
        nonce,
        manifest: pipeline.manifest_bytes.clone(),
        stages: stages
            .into_iter()
            .map(|(st, evidence)| StageEvidence {
                index: st.index,
                claims: st.claims,
                boot_evidence: st.boot_evidence,
                evidence,
            })
            .collect(),
    };
    let wants_cbor = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/cbor"));
    if wants_cbor {
        return (
            [(header::CONTENT_TYPE, "application/cbor")],
            proto::cbor::to_vec(&bundle),
        )
            .into_response();
    }
    Json(bundle_json(&bundle)).into_response()
}

/// The bundle for people: the same content, bytes as hex/base64, plus the
/// CBOR form (base64) that `gateway verify evidence` reads.
fn bundle_json(b: &EvidenceBundle) -> serde_json::Value {
    let b64 = |v: &[u8]| base64::engine::general_purpose::STANDARD.encode(v);
    let stages: Vec<_> = b
        .stages
        .iter()
        .map(|s| {
            let doc = proto::attestation::verify_any(&s.evidence).ok();
            json!({
                "index": s.index,
                "layers": [s.claims.layer_start, s.claims.layer_end],
                "evidence_format": format!("{:?}", s.evidence.format).to_lowercase(),
                "measurement": doc.as_ref().map(|d| d.measurement.pinned_form()),
                "receipt_key": hex::encode(s.claims.receipt_key),
                "hpke_keys": b64(&s.claims.hpke_keys),
                "boot_evidence_sha256": s.boot_evidence.digest().hex(),
                "evidence": b64(&s.evidence.document),
                "boot_evidence": b64(&s.boot_evidence.document),
            })
        })
        .collect();
    let mock = b
        .stages
        .iter()
        .any(|s| s.evidence.format == proto::attestation::EvidenceFormat::Mock);
    let mut out = json!({
        "nonce": hex::encode(&b.nonce),
        "manifest_sha256": proto::digest::Sha256Digest::of(&b.manifest).hex(),
        "manifest": serde_json::from_slice::<serde_json::Value>(&b.manifest).unwrap_or_default(),
        "stages": stages,
        "bundle_cbor": b64(&proto::cbor::to_vec(b)),
    });
    if mock {
        out["warning"] = json!(proto::attestation::MOCK_WARNING);
    }
    out
}

fn failure_response(s: &AppState, f: Failure) -> Response {
    match f {
        Failure::NotReady(r) => ApiError::not_ready(&r).into_response(),
        Failure::Timeout => ApiError::timeout(s.limits.timeout.as_secs()).into_response(),
    }
}

async fn embeddings_handler(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let pipeline = s.pipeline.clone();
    let resp = relay(&s, &pipeline, pipeline.endpoint, &headers, body).await;
    tracing::info!(
        endpoint = "/v1/embeddings",
        status = resp.status().as_u16(),
        latency_ms = started.elapsed().as_secs_f64() * 1e3,
        "request"
    );
    resp
}

async fn read_body(s: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let limit = s.limits.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::too_large(limit));
    }
    to_bytes(body, limit)
        .await
        .map_err(|_| ApiError::too_large(limit))
}

async fn chat_handler(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    generation_handler(s, crate::timeouts::CHAT_COMPLETIONS, headers, body).await
}

async fn completions_handler(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    generation_handler(s, crate::timeouts::COMPLETIONS, headers, body).await
}

/// `/v1/completions` and `/v1/chat/completions`: both go to the completions
/// pipeline, whose entry stage reads (and, for chat, templates) the request.
async fn generation_handler(
    s: AppState,
    endpoint: &'static str,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = Instant::now();
    let Some(pipeline) = s.completions.clone() else {
        return ApiError {
            code: Some("unknown_url"),
            ..ApiError::from_stage(
                404,
                format!(
                    "This gateway serves no completions model ([completions] is not \
                     configured), so {endpoint} is not available."
                ),
            )
        }
        .into_response();
    };
    let resp = relay(&s, &pipeline, endpoint, &headers, body).await;
    tracing::info!(
        endpoint,
        status = resp.status().as_u16(),
        latency_ms = started.elapsed().as_secs_f64() * 1e3,
        "request"
    );
    resp
}

/// Seals (plain clients) or relays (sealed clients) one API request.
async fn relay(
    s: &AppState,
    pipeline: &Arc<Pipeline>,
    endpoint: &'static str,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    match relay_inner(s, pipeline, endpoint, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn relay_inner(
    s: &AppState,
    pipeline: &Arc<Pipeline>,
    endpoint: &'static str,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let bytes = read_body(s, headers, body).await?;
    let nonce = match headers
        .get(HEADER_RECEIPT_NONCE)
        .map(|v| v.to_str().map(hex::decode))
    {
        None => None,
        Some(Ok(Ok(n))) if n.len() <= 64 => Some(n),
        Some(_) => {
            return Err(ApiError::invalid(
                Some(HEADER_RECEIPT_NONCE),
                "The receipt-nonce header must be hex, at most 64 bytes.",
            ))
        }
    };
    let keys = pipeline.entry_keys().map_err(|r| ApiError::not_ready(&r))?;
    if headers.contains_key(HEADER_KEY_ID) {
        // Sealed by the client to the enclave key: relay ciphertext only.
        let sealed = SealedHeaders::from_header_values(|name| {
            headers.get(name).and_then(|v| v.to_str().ok())
        })
        .map_err(|e| ApiError::invalid(Some(HEADER_KEY_ID), format!("Bad sealing headers: {e}")))?;
        if sealed.key_id == s.gateway_key.key_id() {
            s.metrics.sealing(Sealing::Gateway);
            return via_gateway_key(s, pipeline, endpoint, &keys, &sealed, &bytes, nonce).await;
        }
        if !keys
            .iter()
            .any(|k| k.key_id == sealed.key_id && k.supports(sealed.aead))
        {
            return Err(ApiError::unknown_key(sealed.key_id));
        }
        s.metrics.sealing(Sealing::Enclave);
        let (reply, sub) = pipeline
            .submit(
                endpoint,
                sealed,
                bytes.to_vec(),
                nonce,
                Sealing::Enclave,
                s.limits.routes.for_route(endpoint),
            )
            .await
            .map_err(|f| failure_error(s, f))?;
        return Ok(match reply {
            Reply::StreamStart { receipt_id } => {
                stream_response(s, sub, receipt_id, StreamMode::Relay)
            }
            Reply::Response {
                status,
                body,
                receipt,
                receipt_id,
            } => {
                let mut r = sealed_response(status, body);
                attach_receipt(s, &mut r, receipt_id, receipt);
                r
            }
            Reply::Failed(e) => {
                let retry = e.retry_after_secs;
                let mut r = match e.sealed_body {
                    Some(body) => sealed_response(e.status, body),
                    None => ApiError::from_stage(e.status, e.message).into_response(),
                };
                set_retry_after(&mut r, retry);
                r
            }
            _ => unexpected_reply(),
        });
    }
    // A plain OpenAI client: the gateway seals to the entry stage itself.
    s.metrics.sealing(Sealing::Plain);
    Ok(
        match seal_to_entry(s, pipeline, endpoint, &keys, &bytes, nonce, Sealing::Plain).await? {
            Answer::Whole {
                status,
                body,
                receipt,
                retry_after,
            } => {
                let mut r = json_response(status, body);
                if let Some((id, receipt)) = receipt {
                    attach_receipt(s, &mut r, id, receipt);
                }
                set_retry_after(&mut r, retry_after);
                r
            }
            Answer::Stream {
                receipt_id,
                sub,
                client_key,
            } => stream_response(s, sub, receipt_id, StreamMode::Open(client_key)),
        },
    )
}

/// What came back for a request the gateway sealed itself.
enum Answer {
    /// A whole (opened) response or error.
    Whole {
        status: u16,
        body: Vec<u8>,
        receipt: Option<([u8; 16], Vec<u8>)>,
        retry_after: Option<u32>,
    },
    /// A stream: its rest comes through `sub`, sealed to `client_key`.
    Stream {
        receipt_id: [u8; 16],
        sub: Submission,
        client_key: ClientResponseKey,
    },
}

fn unexpected_reply() -> Response {
    ApiError::internal("the exit stage answered out of order").into_response()
}

fn set_retry_after(r: &mut Response, secs: Option<u32>) {
    if let Some(secs) = secs {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
}

/// How the gateway passes a stream's sealed bytes to its client.
enum StreamMode {
    /// The client sealed to the enclave key: ciphertext as it comes.
    Relay,
    /// A plain client: the gateway opens the stream it sealed the request for.
    Open(ClientResponseKey),
    /// The client sealed to the gateway's key: open, and seal again to it.
    Reseal(ClientResponseKey, ResponseSealer),
}

impl StreamMode {
    fn is_plain(&self) -> bool {
        matches!(self, StreamMode::Open(_))
    }
}

/// A streamed HTTP response fed by the exit stage's messages. If the client
/// goes away, the submission is dropped and the request is cancelled in the
/// stages.
fn stream_response(
    s: &AppState,
    sub: Submission,
    receipt_id: [u8; 16],
    mode: StreamMode,
) -> Response {
    let plain = mode.is_plain();
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    let receipts = s.receipts.clone();
    let metrics = s.metrics.clone();
    // A stream may run long; only a silence this long ends it.
    let idle = s.limits.routes.for_route(crate::timeouts::COMPLETIONS);
    tokio::spawn(pump_stream(
        sub, mode, tx, receipts, metrics, receipt_id, idle,
    ));
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    }));
    let mut r = if plain {
        (
            StatusCode::OK,
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            body,
        )
            .into_response()
    } else {
        (
            StatusCode::OK,
            [
                (header::CONTENT_TYPE, "application/octet-stream"),
                (header::HeaderName::from_static("hpke-sealed"), "response"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            body,
        )
            .into_response()
    };
    if let Ok(v) = HeaderValue::from_str(&hex::encode(receipt_id)) {
        r.headers_mut().insert(HEADER_RECEIPT_ID, v);
    }
    r
}

async fn pump_stream(
    mut sub: Submission,
    mut mode: StreamMode,
    tx: tokio::sync::mpsc::Sender<Bytes>,
    receipts: Arc<ReceiptStore>,
    metrics: Arc<Metrics>,
    receipt_id: [u8; 16],
    idle: Duration,
) {
    let mut opener = match &mode {
        StreamMode::Open(k) | StreamMode::Reseal(k, _) => {
            Some(ResponseOpener::new(k, SealLimits::default()))
        }
        StreamMode::Relay => None,
    };
    loop {
        let (data, last, receipt) = match sub.next(idle).await {
            Ok(Reply::StreamData(d)) => (d, false, None),
            Ok(Reply::StreamEnd { data, receipt }) => (data, true, receipt),
            other => {
                // The pipeline broke or went silent: say so to a plain client
                // (a sealed stream just ends, and its opener sees it truncated).
                let why = match other {
                    Err(Failure::Timeout) => "The stream stalled and was closed.".to_string(),
                    Err(Failure::NotReady(r)) => format!("The pipeline failed mid-stream: {r}"),
                    _ => "The exit stage answered out of order.".to_string(),
                };
                tracing::warn!(error = %why, "stream ended early");
                if mode.is_plain() {
                    let e = ApiError::from_stage(503, why);
                    let mut ev = b"data: ".to_vec();
                    ev.extend(e.body_bytes());
                    ev.extend(b"\n\n");
                    let _ = tx.send(Bytes::from(ev)).await;
                }
                return;
            }
        };
        if let Some(r) = receipt {
            receipts.insert(receipt_id, r);
            metrics.receipt_issued();
        }
        let out = match (&mut mode, opener.as_mut()) {
            (StreamMode::Relay, _) => Ok(data),
            (StreamMode::Open(_), Some(o)) => o.feed(&data).map(|parts| parts.concat()),
            (StreamMode::Reseal(_, sealer), Some(o)) => o.feed(&data).and_then(|parts| {
                // The stage's trailer (its receipt) goes on to the client.
                match (last, o.trailer()) {
                    (true, Some(trailer)) => {
                        let mut out = sealer.seal(&parts.concat(), false)?;
                        out.extend(sealer.finish_with_trailer(trailer)?);
                        Ok(out)
                    }
                    _ => sealer.seal(&parts.concat(), last),
                }
            }),
            _ => Ok(Vec::new()),
        };
        let out = match out {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(error = %e, "a stream chunk from the exit stage does not open");
                return;
            }
        };
        if !out.is_empty() && tx.send(Bytes::from(out)).await.is_err() {
            // The client went away: dropping `sub` cancels the request.
            return;
        }
        if last {
            return;
        }
    }
}

/// Seals `plaintext` to the entry stage, waits, and opens the answer (or
/// hands back the stream to open as it comes).
async fn seal_to_entry(
    s: &AppState,
    pipeline: &Arc<Pipeline>,
    endpoint: &'static str,
    keys: &[KeyConfig],
    plaintext: &[u8],
    nonce: Option<Vec<u8>>,
    sealing: Sealing,
) -> Result<Answer, ApiError> {
    let key = &keys[0];
    let aead = if key.supports(Aead::Aes128Gcm) {
        Aead::Aes128Gcm
    } else {
        key.aeads[0]
    };
    let (sealed, body, client_key) = seal_request(key, aead, plaintext)
        .map_err(|e| ApiError::internal(format!("sealing failed: {e}")))?;
    let (reply, sub) = pipeline
        .submit(
            endpoint,
            sealed,
            body,
            nonce,
            sealing,
            s.limits.routes.for_route(endpoint),
        )
        .await
        .map_err(|f| failure_error(s, f))?;
    let open = |body: &[u8]| {
        open_response(&client_key, body)
            .map_err(|e| ApiError::internal(format!("the stage's response does not open: {e}")))
    };
    Ok(match reply {
        Reply::Response {
            status,
            body,
            receipt,
            receipt_id,
        } => Answer::Whole {
            status,
            body: open(&body)?,
            receipt: Some((receipt_id, receipt)),
            retry_after: None,
        },
        Reply::Failed(e) => {
            let retry_after = e.retry_after_secs;
            let (status, body) = match e.sealed_body {
                Some(body) => (e.status, open(&body)?),
                None => {
                    let api = ApiError::from_stage(e.status, e.message);
                    (api.status.as_u16(), api.body_bytes())
                }
            };
            Answer::Whole {
                status,
                body,
                receipt: None,
                retry_after,
            }
        }
        Reply::StreamStart { receipt_id } => Answer::Stream {
            receipt_id,
            sub,
            client_key,
        },
        _ => return Err(ApiError::internal("the exit stage answered out of order")),
    })
}

/// Opens a request sealed to the gateway's own key, runs it as a plain
/// request (sealed on to the entry stage), and seals the answer back to the
/// client. The gateway sees this request's plaintext; the receipt says so.
async fn via_gateway_key(
    s: &AppState,
    pipeline: &Arc<Pipeline>,
    endpoint: &'static str,
    keys: &[KeyConfig],
    sealed: &SealedHeaders,
    bytes: &[u8],
    nonce: Option<Vec<u8>>,
) -> Result<Response, ApiError> {
    let (plaintext, material) = s.gateway_key.open(sealed, bytes)?;
    match seal_to_entry(
        s,
        pipeline,
        endpoint,
        keys,
        &plaintext,
        nonce,
        Sealing::Gateway,
    )
    .await?
    {
        Answer::Whole {
            status,
            body,
            receipt,
            retry_after,
        } => {
            // A receipt rides along as the sealed body's trailer.
            let sealed_body = match &receipt {
                Some((_, r)) => seal_response_with_trailer(&material, &body, r),
                None => seal_response(&material, &body),
            }
            .map_err(|e| ApiError::internal(format!("sealing the response failed: {e}")))?;
            let mut r = sealed_response(status, sealed_body);
            if let Some((id, receipt)) = receipt {
                attach_receipt(s, &mut r, id, receipt);
            }
            set_retry_after(&mut r, retry_after);
            Ok(r)
        }
        Answer::Stream {
            receipt_id,
            sub,
            client_key,
        } => {
            let sealer = reseal(&material)?;
            Ok(stream_response(
                s,
                sub,
                receipt_id,
                StreamMode::Reseal(client_key, sealer),
            ))
        }
    }
}

fn reseal(material: &ResponseKeyMaterial) -> Result<ResponseSealer, ApiError> {
    ResponseSealer::new(material)
        .map_err(|e| ApiError::internal(format!("sealing the response failed: {e}")))
}

fn failure_error(s: &AppState, f: Failure) -> ApiError {
    match f {
        Failure::NotReady(r) => ApiError::not_ready(&r),
        Failure::Timeout => ApiError::timeout(s.limits.timeout.as_secs()),
    }
}

fn status_of(code: u16) -> StatusCode {
    StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

fn json_response(status: u16, body: Vec<u8>) -> Response {
    (
        status_of(status),
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

fn sealed_response(status: u16, body: Vec<u8>) -> Response {
    (
        status_of(status),
        [
            (header::CONTENT_TYPE, "application/octet-stream"),
            (header::HeaderName::from_static("hpke-sealed"), "response"),
        ],
        body,
    )
        .into_response()
}

fn attach_receipt(s: &AppState, r: &mut Response, id: [u8; 16], receipt: Vec<u8>) {
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&hex::encode(id)) {
        h.insert(HEADER_RECEIPT_ID, v);
    }
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&receipt);
    if b64.len() <= MAX_RECEIPT_HEADER {
        if let Ok(v) = HeaderValue::from_str(&b64) {
            h.insert(HEADER_RECEIPT, v);
        }
    }
    s.receipts.insert(id, receipt);
    s.metrics.receipt_issued();
}
