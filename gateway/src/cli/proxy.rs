//! `gateway proxy`: a local OpenAI-compatible endpoint in the client's own
//! trust domain.
//!
//! At start it fetches `/v1/attestation` from the upstream gateway with a
//! fresh random nonce and verifies the bundle against the policy; it refuses
//! to start when that fails. The entry stage's HPKE key is taken from the
//! verified evidence (never from the unauthenticated `/.well-known`
//! endpoint). Then, for each API request:
//!
//! 1. the plaintext body is sealed to that key and forwarded with the
//!    sealing headers and a fresh `receipt-nonce` (or the client's own);
//! 2. the sealed response is opened;
//! 3. the receipt (`receipt` header, or `GET /v1/receipts/{id}` when it was
//!    too large for a header) is verified against the verified stage keys,
//!    the exact request and response bytes and the nonce;
//! 4. the plaintext is returned with the receipt headers, `receipt-verified:
//!    true` and `receipt-nonce`; a receipt that does not verify turns the
//!    answer into a 502 (OpenAI error shape, code `receipt_verification_failed`).
//!
//! When the upstream answers `hpke_key_unknown` (its stages restarted with
//! new keys), the proxy re-attests once and seals again. A plain 400 to a
//! sealed request (a restarted stage may reuse the key id with a new key,
//! so the body does not open) also triggers a re-attestation, at most every
//! 10 s, and a retry if the attested entry key changed. A receipt signed by
//! a key the proxy does not know triggers one re-attestation before it is
//! rejected. New evidence must verify against the same policy; if it does
//! not, the request fails with 502 `evidence_not_verified`.
//!
//! Responses are handled whole ([`Proxy::finish_buffered`]); a streamed
//! (SSE) path plugs in next to it: the upstream body is fed to
//! `proto::sealing::ResponseOpener` chunk by chunk, forwarded as it opens,
//! and the receipt (over the whole event stream) is checked at the end.

use super::seal::{aead_name, pick_key, AeadArg};
use super::verify::verify_evidence;
use super::{base_url, fetch_bundle, http_client, parse_hex, random_nonce, EXIT_FAILED, EXIT_OK};
use crate::openai_error::ApiError;
use anyhow::{anyhow, Context, Result};
use axum::body::{to_bytes, Body, Bytes};
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine as _;
use clap::Args;
use proto::bundle::VerifiedBundle;
use proto::policy::Policy;
use proto::receipt::{verify_receipt, ReceiptError, Sealing, VerifyInputs, VerifyReport};
use proto::sealing::{open_response, seal_request, Aead, ClientResponseKey};
use serde_json::json;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// Response header the proxy adds when the receipt verified.
pub const HEADER_RECEIPT_VERIFIED: &str = "receipt-verified";
/// Response header with the sealing the receipt records.
pub const HEADER_RECEIPT_SEALING: &str = "receipt-sealing";
const HEADER_RECEIPT: &str = "receipt";
const HEADER_RECEIPT_ID: &str = "receipt-id";
const HEADER_RECEIPT_NONCE: &str = "receipt-nonce";
const MAX_RECEIPT_HEADER: usize = 8 * 1024;

/// `gateway proxy`
#[derive(Args, Debug)]
pub struct ProxyArgs {
    /// The upstream gateway, e.g. http://127.0.0.1:8080 (plain HTTP).
    #[arg(long)]
    pub upstream: String,
    /// Measurement policy the upstream's evidence must satisfy.
    #[arg(long)]
    pub policy: PathBuf,
    /// Where to listen (keep it on loopback: this side sees plaintext).
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub listen: String,
    /// AEAD for the sealed requests.
    #[arg(long, value_enum, default_value = "aes128gcm")]
    pub aead: AeadArg,
    /// Upstream request timeout in seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout_secs: u64,
    /// Largest request body accepted.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
}

/// What the proxy trusts: the last verified evidence.
struct Trusted {
    verified: VerifiedBundle,
    /// Bumped by every re-attestation.
    epoch: u64,
    /// When it was verified.
    at: Instant,
}

/// A plain 400 to a sealed request may mean the stages restarted with a new
/// key under the same key id (the body then does not open). The proxy
/// re-attests to find out, at most this often.
const SUSPECT_REATTEST_INTERVAL: Duration = Duration::from_secs(10);

/// Shared proxy state.
pub struct Proxy {
    upstream: String,
    policy: Policy,
    aead: Aead,
    client: reqwest::Client,
    max_body: usize,
    trusted: RwLock<Arc<Trusted>>,
    /// Serializes re-attestations.
    reattest: tokio::sync::Mutex<()>,
}

/// Why attestation failed.
enum AttestError {
    /// The evidence was fetched but does not verify.
    Rejected(Vec<String>),
    /// It could not be fetched.
    Unreachable(String),
}

impl AttestError {
    fn message(&self) -> String {
        match self {
            AttestError::Rejected(lines) => format!(
                "the upstream's evidence does not verify against the policy: {}",
                lines.join("; ")
            ),
            AttestError::Unreachable(e) => format!("fetching the upstream's evidence failed: {e}"),
        }
    }
}

/// A request sealed and sent; its response not read yet.
struct Sent {
    response: reqwest::Response,
    client_key: ClientResponseKey,
    trusted: Arc<Trusted>,
}

fn error(status: StatusCode, kind: &'static str, code: &'static str, msg: String) -> ApiError {
    ApiError {
        status,
        message: msg,
        kind,
        param: None,
        code: Some(code),
        retry_after: None,
    }
}

fn bad_gateway(code: &'static str, msg: impl Into<String>) -> ApiError {
    error(StatusCode::BAD_GATEWAY, "server_error", code, msg.into())
}

impl Proxy {
    async fn attest(&self) -> Result<VerifiedBundle, AttestError> {
        let nonce = random_nonce(32);
        let bundle = fetch_bundle(&self.client, &self.upstream, &nonce)
            .await
            .map_err(|e| AttestError::Unreachable(format!("{e:#}")))?;
        let out = verify_evidence(&bundle, &self.policy, Some(&nonce), None);
        let ok = out.ok();
        match out.verified.filter(|_| ok) {
            Some(v) => Ok(v),
            None => Err(AttestError::Rejected(
                out.lines
                    .iter()
                    .filter(|l| l.status == super::verify::Status::Fail)
                    .map(|l| l.text())
                    .collect(),
            )),
        }
    }

    fn current(&self) -> Arc<Trusted> {
        self.trusted.read().expect("lock").clone()
    }

    /// Re-attests unless someone already did since `seen_epoch`.
    async fn refresh(&self, seen_epoch: u64) -> Result<Arc<Trusted>, ApiError> {
        let _guard = self.reattest.lock().await;
        let cur = self.current();
        if cur.epoch != seen_epoch {
            return Ok(cur);
        }
        match self.attest().await {
            Ok(verified) => {
                log_verified(&verified, "re-attested upstream");
                let t = Arc::new(Trusted {
                    verified,
                    epoch: cur.epoch + 1,
                    at: Instant::now(),
                });
                *self.trusted.write().expect("lock") = t.clone();
                Ok(t)
            }
            Err(e) => {
                tracing::error!("{}", e.message());
                Err(bad_gateway("evidence_not_verified", e.message()))
            }
        }
    }

    /// Seals `request` to the trusted entry key and sends it; re-attests
    /// once if the upstream no longer knows the key.
    async fn send_sealed(
        &self,
        endpoint: &str,
        request: &[u8],
        nonce: &[u8],
        auth: Option<&HeaderValue>,
    ) -> Result<Sent, ProxyError> {
        let mut trusted = self.current();
        let mut refreshed = false;
        loop {
            let key = pick_key(&trusted.verified.entry_keys, None, self.aead).map_err(|e| {
                bad_gateway("hpke_key_unavailable", format!("attested entry key: {e}"))
            })?;
            let (headers, body, client_key) = seal_request(&key, self.aead, request)
                .map_err(|e| ApiError::internal(format!("sealing failed: {e}")))?;
            let mut rb = self
                .client
                .post(format!("{}{endpoint}", self.upstream))
                .header(header::CONTENT_TYPE, "application/octet-stream")
                .header(HEADER_RECEIPT_NONCE, hex::encode(nonce))
                .body(body);
            for (k, v) in headers.to_header_values() {
                rb = rb.header(k, v);
            }
            if let Some(a) = auth {
                rb = rb.header(header::AUTHORIZATION, a.clone());
            }
            let response = rb.send().await.map_err(|e| {
                bad_gateway(
                    "upstream_unreachable",
                    format!("upstream request failed: {e}"),
                )
            })?;
            if response.status() == StatusCode::BAD_REQUEST && !refreshed && !is_sealed(&response) {
                let status = response.status();
                let resp_headers = response.headers().clone();
                let bytes = response.bytes().await.unwrap_or_default();
                let code = serde_json::from_slice::<serde_json::Value>(&bytes)
                    .ok()
                    .and_then(|v| v["error"]["code"].as_str().map(str::to_string));
                let key_unknown = code.as_deref() == Some("hpke_key_unknown");
                if key_unknown || trusted.at.elapsed() >= SUSPECT_REATTEST_INTERVAL {
                    tracing::info!(
                        key_id = key.key_id,
                        code = code.as_deref().unwrap_or("none"),
                        "upstream refused a sealed request: re-attesting to check its keys"
                    );
                    let fresh = self.refresh(trusted.epoch).await?;
                    if key_unknown || fresh.verified.entry_keys != trusted.verified.entry_keys {
                        trusted = fresh;
                        refreshed = true;
                        continue;
                    }
                }
                return Err(ProxyError::Upstream(PassThrough {
                    status,
                    headers: resp_headers,
                    body: bytes,
                }));
            }
            return Ok(Sent {
                response,
                client_key,
                trusted,
            });
        }
    }

    /// Reads a whole sealed response, opens it and verifies its receipt.
    async fn finish_buffered(
        &self,
        endpoint: &str,
        request: &[u8],
        nonce: &[u8],
        sent: Sent,
    ) -> Result<Response, ProxyError> {
        let Sent {
            response,
            client_key,
            mut trusted,
        } = sent;
        let status = response.status();
        let sealed = is_sealed(&response);
        let headers = response.headers().clone();
        let body = response.bytes().await.map_err(|e| {
            bad_gateway(
                "upstream_unreachable",
                format!("reading the upstream response: {e}"),
            )
        })?;
        if !sealed {
            if status.is_success() {
                return Err(bad_gateway(
                    "response_not_sealed",
                    "the upstream answered a sealed request with an unsealed response",
                )
                .into());
            }
            // An error the host answered itself (OpenAI-shaped): pass it on.
            return Err(ProxyError::Upstream(PassThrough {
                status,
                headers,
                body,
            }));
        }
        let plain = open_response(&client_key, &body).map_err(|e| {
            bad_gateway(
                "response_unopenable",
                format!("the upstream's sealed response does not open: {e}"),
            )
        })?;
        if !status.is_success() {
            // An error from the stages, sealed to us; no receipt.
            return Ok(json_response(status, plain));
        }
        let receipt = self.receipt_for(&headers).await?;
        let mut report = check_receipt(
            &trusted,
            &self.policy,
            endpoint,
            &receipt,
            request,
            &plain,
            nonce,
        );
        if matches!(
            report.failure(),
            Some(ReceiptError::UnknownSigner | ReceiptError::LinkUnknownSigner { .. })
        ) {
            tracing::info!("receipt signed by a key not in the evidence: re-attesting once");
            trusted = self.refresh(trusted.epoch).await?;
            report = check_receipt(
                &trusted,
                &self.policy,
                endpoint,
                &receipt,
                request,
                &plain,
                nonce,
            );
        }
        if let Some(fail) = report.checks.iter().find(|c| c.error.is_some()) {
            let code = fail.error.as_ref().map(|e| e.code()).unwrap_or("failed");
            tracing::error!(check = %fail.name, reason = code, "receipt does not verify: answer withheld");
            return Err(bad_gateway(
                "receipt_verification_failed",
                format!(
                    "The upstream's receipt does not verify ({code}: {}: {}); the response was withheld.",
                    fail.name, fail.detail
                ),
            )
            .into());
        }
        let body_receipt = report.receipt.as_ref().expect("verified receipt");
        let mut r = json_response(status, plain);
        let h = r.headers_mut();
        h.insert(
            HEADER_RECEIPT_ID,
            HeaderValue::from_str(&hex::encode(body_receipt.receipt_id)).expect("hex"),
        );
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&receipt);
        if b64.len() <= MAX_RECEIPT_HEADER {
            h.insert(
                HEADER_RECEIPT,
                HeaderValue::from_str(&b64).expect("base64url"),
            );
        }
        h.insert(HEADER_RECEIPT_VERIFIED, HeaderValue::from_static("true"));
        h.insert(
            HEADER_RECEIPT_SEALING,
            HeaderValue::from_static(body_receipt.sealing.as_str()),
        );
        h.insert(
            HEADER_RECEIPT_NONCE,
            HeaderValue::from_str(&hex::encode(nonce)).expect("hex"),
        );
        Ok(r)
    }

    /// The receipt of a response: its header, or fetched by id.
    async fn receipt_for(&self, headers: &reqwest::header::HeaderMap) -> Result<Vec<u8>, ApiError> {
        if let Some(v) = headers.get(HEADER_RECEIPT).and_then(|v| v.to_str().ok()) {
            return base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(v.trim())
                .map_err(|_| {
                    bad_gateway(
                        "receipt_verification_failed",
                        "the receipt header is not base64url",
                    )
                });
        }
        let id = headers
            .get(HEADER_RECEIPT_ID)
            .and_then(|v| v.to_str().ok())
            .filter(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| {
                bad_gateway(
                    "receipt_verification_failed",
                    "the upstream's response carries no receipt; the response was withheld",
                )
            })?;
        let url = format!("{}/v1/receipts/{id}", self.upstream);
        let r = self
            .client
            .get(&url)
            .send()
            .await
            .map_err(|e| bad_gateway("upstream_unreachable", format!("GET {url}: {e}")))?;
        if !r.status().is_success() {
            return Err(bad_gateway(
                "receipt_verification_failed",
                format!("GET {url}: {}; the response was withheld", r.status()),
            ));
        }
        Ok(r.bytes()
            .await
            .map_err(|e| bad_gateway("upstream_unreachable", format!("GET {url}: {e}")))?
            .to_vec())
    }
}

/// Verifies a receipt for a request this proxy sealed to the entry stage.
fn check_receipt(
    trusted: &Trusted,
    policy: &Policy,
    endpoint: &str,
    receipt: &[u8],
    request: &[u8],
    response: &[u8],
    nonce: &[u8],
) -> VerifyReport {
    let v = &trusted.verified;
    let mut inputs = VerifyInputs::new(receipt, &v.stage_keys);
    inputs.request = Some(request);
    inputs.response = Some(response);
    inputs.expected_nonce = Some(nonce);
    inputs.expected_manifest = Some(v.manifest_digest);
    inputs.allow_mock = policy.allow_mock;
    let mut report = verify_receipt(&inputs);
    // What verify_receipt cannot know: how this request was sent.
    if let Some(r) = report.receipt.clone() {
        let mut extra = |name: &str, ok: bool, detail: String| {
            report.checks.push(proto::receipt::Check {
                name: name.into(),
                status: if ok {
                    proto::receipt::CheckStatus::Pass
                } else {
                    proto::receipt::CheckStatus::Fail
                },
                detail: detail.clone(),
                error: (!ok).then_some(ReceiptError::Malformed(detail)),
            })
        };
        extra(
            "proxy.sealing",
            r.sealing == Sealing::Enclave,
            format!(
                "receipt records sealing {:?}, the proxy sealed to the enclave key",
                r.sealing.as_str()
            ),
        );
        extra(
            "proxy.endpoint",
            r.endpoint == endpoint,
            format!(
                "receipt names endpoint {}, the request went to {endpoint}",
                r.endpoint
            ),
        );
    }
    report
}

/// An upstream answer passed on unchanged (an error the host made itself).
struct PassThrough {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Bytes,
}

/// Either an OpenAI error made here or an upstream error passed through.
enum ProxyError {
    Api(ApiError),
    Upstream(PassThrough),
}

impl From<ApiError> for ProxyError {
    fn from(e: ApiError) -> Self {
        ProxyError::Api(e)
    }
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        match self {
            ProxyError::Api(e) => e.into_response(),
            ProxyError::Upstream(p) => {
                // Errors the host answered itself are OpenAI-shaped already:
                // pass status, body and Retry-After on unchanged.
                let mut r = (
                    p.status,
                    [(header::CONTENT_TYPE, "application/json")],
                    p.body,
                )
                    .into_response();
                if let Some(v) = p.headers.get(header::RETRY_AFTER) {
                    r.headers_mut().insert(header::RETRY_AFTER, v.clone());
                }
                r
            }
        }
    }
}

fn is_sealed(r: &reqwest::Response) -> bool {
    r.headers().contains_key("hpke-sealed")
        || r.headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/octet-stream"))
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn log_verified(v: &VerifiedBundle, what: &str) {
    for (k, m) in v.stage_keys.iter().zip(&v.measurements) {
        tracing::info!(
            stage = k.stage_index,
            layers = ?k.layers,
            measurement = %m,
            "{what}: stage verified"
        );
    }
    if v.mock {
        tracing::warn!("{}", proto::attestation::MOCK_WARNING);
    }
}

type AppState = Arc<Proxy>;

async fn sealed_handler(
    s: AppState,
    endpoint: &'static str,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match sealed_inner(&s, endpoint, &headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn sealed_inner(
    s: &Proxy,
    endpoint: &'static str,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ProxyError> {
    let request = to_bytes(body, s.max_body).await.map_err(|_| {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("Request body exceeds the limit of {} bytes.", s.max_body),
        )
    })?;
    if endpoint == "/v1/completions"
        && serde_json::from_slice::<serde_json::Value>(&request)
            .is_ok_and(|v| v["stream"] == serde_json::Value::Bool(true))
    {
        return Err(ApiError::invalid(
            Some("stream"),
            "Streaming is not supported by gateway proxy yet; send the request without `stream`.",
        )
        .into());
    }
    let nonce = match headers.get(HEADER_RECEIPT_NONCE) {
        None => random_nonce(16),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|v| parse_hex("receipt-nonce", v).ok())
            .filter(|n| !n.is_empty() && n.len() <= 64)
            .ok_or_else(|| {
                ApiError::invalid(
                    Some("receipt-nonce"),
                    "The receipt-nonce header must be hex, 1 to 64 bytes.",
                )
            })?,
    };
    let auth = headers.get(header::AUTHORIZATION);
    let sent = s.send_sealed(endpoint, &request, &nonce, auth).await?;
    s.finish_buffered(endpoint, &request, &nonce, sent).await
}

/// Forwards a GET unchanged (model listing: nothing confidential).
async fn forward_get(s: &Proxy, path: &str, headers: &HeaderMap) -> Response {
    let url = format!("{}{path}", s.upstream);
    let mut req = s.client.get(&url);
    // The client's API key, if any, is for the gateway: pass it on.
    if let Some(auth) = headers.get(header::AUTHORIZATION) {
        req = req.header(header::AUTHORIZATION, auth.clone());
    }
    let r = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            return bad_gateway("upstream_unreachable", format!("GET {path}: {e}")).into_response()
        }
    };
    let status = r.status();
    let ct = r
        .headers()
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or(HeaderValue::from_static("application/json"));
    match r.bytes().await {
        Ok(b) => (status, [(header::CONTENT_TYPE, ct)], b).into_response(),
        Err(e) => bad_gateway("upstream_unreachable", format!("GET {path}: {e}")).into_response(),
    }
}

fn router(state: AppState) -> Router {
    Router::new()
        .route(
            "/v1/embeddings",
            post(|State(s): State<AppState>, h: HeaderMap, b: Body| {
                sealed_handler(s, "/v1/embeddings", h, b)
            }),
        )
        .route(
            "/v1/completions",
            post(|State(s): State<AppState>, h: HeaderMap, b: Body| {
                sealed_handler(s, "/v1/completions", h, b)
            }),
        )
        .route(
            "/v1/models",
            get(|State(s): State<AppState>, h: HeaderMap| async move {
                forward_get(&s, "/v1/models", &h).await
            }),
        )
        .route(
            "/v1/models/{id}",
            get(
                |State(s): State<AppState>, h: HeaderMap, UrlPath(id): UrlPath<String>| async move {
                    if id.is_empty()
                        || !id
                            .bytes()
                            .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'?' && b != b'#')
                    {
                        return ApiError::model_not_found(&id).into_response();
                    }
                    forward_get(&s, &format!("/v1/models/{id}"), &h).await
                },
            ),
        )
        .route(
            "/healthz",
            get(|State(s): State<AppState>| async move {
                let t = s.current();
                Json(json!({
                    "status": "ok",
                    "upstream": s.upstream,
                    "mock": t.verified.mock,
                    "measurements": t.verified.measurements,
                    "aead": aead_name(s.aead),
                }))
            }),
        )
        .fallback(|method: Method, uri: Uri| async move {
            ApiError::unknown_route(method.as_str(), uri.path())
        })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            ApiError::method_not_allowed(method.as_str(), uri.path())
        })
        .with_state(state)
}

/// Runs `gateway proxy`; returns the exit code.
pub fn run(a: ProxyArgs) -> Result<i32> {
    let policy = Policy::load(&a.policy).map_err(|e| anyhow!(e))?;
    let upstream = base_url(&a.upstream)?;
    let client = http_client(Duration::from_secs(a.timeout_secs))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let placeholder = Proxy {
            upstream: upstream.clone(),
            policy,
            aead: a.aead.into(),
            client,
            max_body: a.max_body_bytes,
            trusted: RwLock::new(Arc::new(Trusted {
                verified: VerifiedBundle {
                    stage_keys: Vec::new(),
                    entry_keys: Vec::new(),
                    manifest_digest: proto::digest::Sha256Digest([0; 32]),
                    mock: false,
                    measurements: Vec::new(),
                },
                epoch: 0,
                at: Instant::now(),
            })),
            reattest: tokio::sync::Mutex::new(()),
        };
        let verified = match placeholder.attest().await {
            Ok(v) => v,
            Err(e) => {
                if let AttestError::Rejected(lines) = &e {
                    for l in lines {
                        eprintln!("{l}");
                    }
                }
                eprintln!("refusing to start: {}", e.message());
                return Ok(EXIT_FAILED);
            }
        };
        log_verified(&verified, "attested upstream");
        *placeholder.trusted.write().expect("lock") = Arc::new(Trusted {
            verified,
            epoch: 1,
            at: Instant::now(),
        });
        let state = Arc::new(placeholder);
        let listener = tokio::net::TcpListener::bind(&a.listen)
            .await
            .with_context(|| format!("binding {}", a.listen))?;
        let addr = listener.local_addr()?;
        use tokio::signal::unix::{signal, SignalKind};
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        tracing::info!(address = %addr, upstream = %upstream, "proxy listening: requests are sealed to the attested entry stage, receipts verified");
        println!("PROXY LISTENING http://{addr}");
        axum::serve(listener, router(state))
            .with_graceful_shutdown(async move {
                tokio::select! {
                    _ = sigint.recv() => {}
                    _ = sigterm.recv() => {}
                }
            })
            .await?;
        Ok(EXIT_OK)
    })
}
