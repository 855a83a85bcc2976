//! `gateway proxy`: a local OpenAI-compatible endpoint in the client's own
//! trust domain.
//!
//! At start it lists the upstream's models (`GET /v1/models`) and, for each,
//! fetches `/v1/attestation?model=…` with a fresh random nonce and verifies
//! the bundle against the policies given (`--policy`, repeatable: one per
//! pipeline, e.g. embeddings and completions). Every policy must verify at
//! least one model's evidence, or the proxy refuses to start. A model whose
//! evidence no policy accepts is not served. The entry stage's HPKE key is
//! taken from the verified evidence (never from the unauthenticated
//! `/.well-known` endpoint). Then, for each API request (routed by its
//! `model`):
//!
//! 1. the plaintext body is sealed to that model's entry key and forwarded
//!    with the sealing headers and a fresh `receipt-nonce` (or the client's);
//! 2. the sealed response is opened as it arrives;
//! 3. the receipt, which the exit stage sealed into the response as its
//!    trailer (or, from an older upstream, the `receipt` header or `GET
//!    /v1/receipts/{id}`), is verified against the verified stage keys, the
//!    exact request and response bytes and the nonce;
//! 4. whole responses: the plaintext is returned with the receipt headers,
//!    `receipt-verified: true` and `receipt-nonce`; a receipt that does not
//!    verify turns the answer into a 502 (OpenAI error shape, code
//!    `receipt_verification_failed`). Streams (`stream: true`): whole events
//!    are forwarded as they open, except `data: [DONE]` (however the sealed
//!    chunks split it), which is held back until the receipt over the whole
//!    event stream verifies; if it does not, the client gets an error event
//!    instead and no `[DONE]`.
//!
//! Verified receipts are kept (last [`RECEIPTS_KEPT`]) and served at `GET
//! /v1/receipts/{id}`; with `--archive DIR` every verified exchange is also
//! written to `DIR/<receipt id>/` (request, response, receipt, nonce and the
//! evidence it was checked against) so that an auditor can re-run `gateway
//! verify receipt` on it offline.
//!
//! When the upstream answers `hpke_key_unknown` (its stages restarted with
//! new keys), the proxy re-attests once and seals again. A plain 400 to a
//! sealed request (a restarted stage may reuse the key id with a new key,
//! so the body does not open) also triggers a re-attestation, at most every
//! 10 s, and a retry if the attested entry key changed. A receipt signed by
//! a key the proxy does not know triggers one re-attestation before it is
//! rejected. New evidence must verify against the same policy; if it does
//! not, the request fails with 502 `evidence_not_verified`.

use super::client_key::aead_name;
use super::seal::{pick_key, AeadArg};
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
use proto::bundle::{EvidenceBundle, VerifiedBundle};
use proto::policy::Policy;
use proto::receipt::{verify_receipt, ReceiptError, SealedTo, Sealing, VerifyInputs, VerifyReport};
use proto::sealing::{
    open_response_with_trailer, seal_request, Aead, ClientResponseKey, ResponseOpener, SealLimits,
};
use serde_json::json;
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Response header the proxy adds when the receipt verified.
pub const HEADER_RECEIPT_VERIFIED: &str = "receipt-verified";
/// Response header with the sealing the receipt records.
pub const HEADER_RECEIPT_SEALING: &str = "receipt-sealing";
/// How many verified receipts the proxy keeps for `GET /v1/receipts/{id}`.
pub const RECEIPTS_KEPT: usize = 4096;
const HEADER_RECEIPT: &str = "receipt";
const HEADER_RECEIPT_ID: &str = "receipt-id";
const HEADER_RECEIPT_NONCE: &str = "receipt-nonce";
const MAX_RECEIPT_HEADER: usize = 8 * 1024;
/// The event that ends a successful stream.
const STREAM_DONE: &[u8] = b"data: [DONE]\n\n";

/// `gateway proxy`
#[derive(Args, Debug)]
pub struct ProxyArgs {
    /// The upstream gateway, e.g. http://127.0.0.1:8080 (plain HTTP).
    #[arg(long)]
    pub upstream: String,
    /// Measurement policy a pipeline's evidence must satisfy; repeat it for
    /// each pipeline to use (e.g. config/policy.toml for embeddings and
    /// config/policy-completions.toml for completions).
    #[arg(long, required = true)]
    pub policy: Vec<PathBuf>,
    /// Where to listen (keep it on loopback: this side sees plaintext).
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub listen: String,
    /// AEAD for the sealed requests.
    #[arg(long, value_enum, default_value = "aes128gcm")]
    pub aead: AeadArg,
    /// Upstream request timeout in seconds (for a stream: the longest
    /// silence between two pieces of it).
    #[arg(long, default_value_t = 120)]
    pub timeout_secs: u64,
    /// Largest request body accepted.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Write every verified exchange to DIR/<receipt id>/ (request, response,
    /// receipt, nonces, evidence) for offline re-verification. The folder
    /// holds plaintext: keep it in the client's trust domain.
    #[arg(long)]
    pub archive: Option<PathBuf>,
}

/// What the proxy trusts for one model: the last verified evidence.
struct Trusted {
    verified: VerifiedBundle,
    /// The bundle and the nonce it was fetched with (for the archive).
    bundle: EvidenceBundle,
    nonce: Vec<u8>,
    /// Bumped by every re-attestation.
    epoch: u64,
    /// When it was verified.
    at: Instant,
}

/// One attested pipeline: a model and the policy its evidence satisfies.
struct Route {
    model: String,
    policy: Policy,
    trusted: RwLock<Arc<Trusted>>,
    /// Serializes re-attestations.
    reattest: tokio::sync::Mutex<()>,
}

/// A plain 400 to a sealed request may mean the stages restarted with a new
/// key under the same key id (the body then does not open). The proxy
/// re-attests to find out, at most this often.
const SUSPECT_REATTEST_INTERVAL: Duration = Duration::from_secs(10);

/// Shared proxy state.
pub struct Proxy {
    upstream: String,
    aead: Aead,
    client: reqwest::Client,
    max_body: usize,
    idle: Duration,
    routes: Vec<Route>,
    receipts: Mutex<VecDeque<([u8; 16], Vec<u8>)>>,
    archive: Option<PathBuf>,
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

/// A request sealed and sent, answered with a sealed success whose body is
/// not read yet.
struct Sent {
    response: reqwest::Response,
    client_key: ClientResponseKey,
    /// The key id the request was sealed to (with `client_key`'s `enc`:
    /// what the receipt's entry link must say was opened).
    key_id: u8,
    trusted: Arc<Trusted>,
}

/// One request as the client sent it (owned: a stream's task keeps it).
struct Exchange {
    endpoint: &'static str,
    /// Index into [`Proxy::routes`].
    route: usize,
    request: Bytes,
    nonce: Vec<u8>,
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

/// Fetches one model's evidence with a fresh nonce and checks it.
async fn attest(
    client: &reqwest::Client,
    upstream: &str,
    model: &str,
    policy: &Policy,
) -> Result<(VerifiedBundle, EvidenceBundle, Vec<u8>), AttestError> {
    let nonce = random_nonce(32);
    let bundle = fetch_bundle(client, upstream, &nonce, Some(model))
        .await
        .map_err(|e| AttestError::Unreachable(format!("{e:#}")))?;
    let out = verify_evidence(&bundle, policy, Some(&nonce), None);
    let ok = out.ok();
    match out.verified.filter(|_| ok) {
        Some(v) => Ok((v, bundle, nonce)),
        None => Err(AttestError::Rejected(
            out.lines
                .iter()
                .filter(|l| l.status == super::verify::Status::Fail)
                .map(|l| l.text())
                .collect(),
        )),
    }
}

impl Route {
    fn current(&self) -> Arc<Trusted> {
        self.trusted.read().expect("lock").clone()
    }
}

impl Proxy {
    /// The route for a request's `model`.
    fn route(&self, model: &str) -> Option<&Route> {
        self.routes.iter().find(|r| r.model == model)
    }

    /// Re-attests `route` unless someone already did since `seen_epoch`.
    async fn refresh(&self, route: &Route, seen_epoch: u64) -> Result<Arc<Trusted>, ApiError> {
        let _guard = route.reattest.lock().await;
        let cur = route.current();
        if cur.epoch != seen_epoch {
            return Ok(cur);
        }
        match attest(&self.client, &self.upstream, &route.model, &route.policy).await {
            Ok((verified, bundle, nonce)) => {
                log_verified(&route.model, &verified, "re-attested upstream");
                let t = Arc::new(Trusted {
                    verified,
                    bundle,
                    nonce,
                    epoch: cur.epoch + 1,
                    at: Instant::now(),
                });
                *route.trusted.write().expect("lock") = t.clone();
                Ok(t)
            }
            Err(e) => {
                tracing::error!(model = %route.model, "{}", e.message());
                Err(bad_gateway("evidence_not_verified", e.message()))
            }
        }
    }

    /// Seals the request to the trusted entry key and sends it; re-attests
    /// once if the upstream no longer knows the key. Any answer but a sealed
    /// success is the error the client gets.
    async fn send_sealed(
        &self,
        x: &Exchange,
        auth: Option<&HeaderValue>,
    ) -> Result<Sent, ProxyError> {
        let route = &self.routes[x.route];
        let mut trusted = route.current();
        let mut refreshed = false;
        loop {
            let key = pick_key(&trusted.verified.entry_keys, None, self.aead).map_err(|e| {
                bad_gateway("hpke_key_unavailable", format!("attested entry key: {e}"))
            })?;
            let (headers, body, client_key) = seal_request(&key, self.aead, &x.request)
                .map_err(|e| ApiError::internal(format!("sealing failed: {e}")))?;
            let mut rb = self
                .client
                .post(format!("{}{}", self.upstream, x.endpoint))
                .header(header::CONTENT_TYPE, "application/octet-stream")
                .header(HEADER_RECEIPT_NONCE, hex::encode(&x.nonce))
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
                    let fresh = self.refresh(route, trusted.epoch).await?;
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
            if !response.status().is_success() || !is_sealed(&response) {
                return Err(self.not_success(response, &client_key).await);
            }
            return Ok(Sent {
                response,
                client_key,
                key_id: key.key_id,
                trusted,
            });
        }
    }

    /// An upstream answer that is not a sealed success: a host-made error
    /// passes through, a sealed stage error is opened.
    async fn not_success(
        &self,
        response: reqwest::Response,
        client_key: &ClientResponseKey,
    ) -> ProxyError {
        let status = response.status();
        let sealed = is_sealed(&response);
        let headers = response.headers().clone();
        let body = match response.bytes().await {
            Ok(b) => b,
            Err(e) => {
                return bad_gateway(
                    "upstream_unreachable",
                    format!("reading the upstream response: {e}"),
                )
                .into()
            }
        };
        if !sealed {
            if status.is_success() {
                return bad_gateway(
                    "response_not_sealed",
                    "the upstream answered a sealed request with an unsealed response",
                )
                .into();
            }
            // An error the host answered itself (OpenAI-shaped): pass it on.
            return ProxyError::Upstream(PassThrough {
                status,
                headers,
                body,
            });
        }
        match open_response_with_trailer(client_key, &body) {
            // An error from the stages, sealed to us; no receipt.
            Ok((plain, _)) => ProxyError::Sealed(status, plain),
            Err(e) => unopenable(e).into(),
        }
    }

    /// Reads a whole sealed response, opens it and verifies its receipt.
    async fn finish_buffered(&self, x: &Exchange, sent: Sent) -> Result<Response, ProxyError> {
        let Sent {
            response,
            client_key,
            key_id,
            trusted,
        } = sent;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.bytes().await.map_err(|e| {
            bad_gateway(
                "upstream_unreachable",
                format!("reading the upstream response: {e}"),
            )
        })?;
        let (plain, trailer) =
            open_response_with_trailer(&client_key, &body).map_err(unopenable)?;
        let receipt = match trailer {
            Some(r) => r,
            None => self.receipt_for(&headers).await?,
        };
        let sealed_to = SealedTo {
            key_id,
            enc: client_key.material().enc(),
        };
        let body_receipt = self
            .verified(x, trusted, sealed_to, &receipt, &plain)
            .await?;
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
            HeaderValue::from_str(&hex::encode(&x.nonce)).expect("hex"),
        );
        Ok(r)
    }

    /// Verifies `receipt` for this exchange (re-attesting once if a signer is
    /// unknown), keeps and archives it; the error withholds the answer.
    async fn verified(
        &self,
        x: &Exchange,
        mut trusted: Arc<Trusted>,
        sealed_to: SealedTo<'_>,
        receipt: &[u8],
        response: &[u8],
    ) -> Result<proto::receipt::ReceiptBody, ApiError> {
        let route = &self.routes[x.route];
        let allow_mock = route.policy.allow_mock;
        let check =
            |t: &Trusted| check_receipt(&t.verified, allow_mock, x, sealed_to, receipt, response);
        let mut report = check(&trusted);
        if matches!(
            report.failure(),
            Some(ReceiptError::UnknownSigner | ReceiptError::LinkUnknownSigner { .. })
        ) {
            tracing::info!("receipt signed by a key not in the evidence: re-attesting once");
            trusted = self.refresh(route, trusted.epoch).await?;
            report = check(&trusted);
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
            ));
        }
        let body = report.receipt.expect("a verified receipt has a body");
        self.keep(body.receipt_id, receipt);
        if let Some(dir) = &self.archive {
            if let Err(e) = archive(dir, &body.receipt_id, x, &trusted, receipt, response) {
                // The answer verified; an archive that cannot be written is
                // the operator's problem, not a reason to withhold it.
                tracing::error!(error = %format!("{e:#}"), "writing the archive failed");
            }
        }
        Ok(body)
    }

    fn keep(&self, id: [u8; 16], receipt: &[u8]) {
        let mut kept = self.receipts.lock().expect("lock");
        if kept.len() == RECEIPTS_KEPT {
            kept.pop_front();
        }
        kept.push_back((id, receipt.to_vec()));
    }

    /// The receipt of a response from an upstream that sends no trailer:
    /// its header, or fetched by id.
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

/// A streamed answer: events are forwarded as they open; the `[DONE]` event
/// waits for the receipt (the sealed stream's trailer) to verify.
async fn finish_streaming(
    proxy: Arc<Proxy>,
    x: Exchange,
    sent: Sent,
) -> Result<Response, ProxyError> {
    let Sent {
        response,
        client_key,
        key_id,
        trusted,
    } = sent;
    let receipt_id = response.headers().get(HEADER_RECEIPT_ID).cloned();
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    let nonce = x.nonce.clone();
    tokio::spawn(async move {
        let events = pump_stream(&proxy, &x, response, (key_id, client_key), trusted, &tx).await;
        if let Err(e) = events {
            tracing::warn!(error = %e.message, "stream from the upstream ended without a verified receipt");
            let _ = tx.send(Bytes::from(error_event(&e))).await;
        }
    });
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    }));
    let mut r = (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response();
    let h = r.headers_mut();
    if let Some(id) = receipt_id {
        h.insert(HEADER_RECEIPT_ID, id);
    }
    h.insert(
        HEADER_RECEIPT_NONCE,
        HeaderValue::from_str(&hex::encode(&nonce)).expect("hex"),
    );
    Ok(r)
}

/// Opens the upstream stream piece by piece and forwards it to `tx`; returns
/// once `[DONE]` went out after the receipt verified, or with the error to
/// tell the client. A client that goes away ends it (the upstream request is
/// dropped, which cancels it in the stages).
async fn pump_stream(
    proxy: &Proxy,
    x: &Exchange,
    mut response: reqwest::Response,
    (key_id, client_key): (u8, ClientResponseKey),
    trusted: Arc<Trusted>,
    tx: &tokio::sync::mpsc::Sender<Bytes>,
) -> Result<(), ApiError> {
    let mut opener = ResponseOpener::new(&client_key, SealLimits::default());
    // Every plaintext byte the client gets: the receipt binds all of it.
    let mut all = Vec::new();
    // How much of `all` went out; whether it stopped at `[DONE]`.
    let mut forwarded = 0;
    let mut at_done = false;
    loop {
        let piece = tokio::time::timeout(proxy.idle, response.chunk())
            .await
            .map_err(|_| bad_gateway("upstream_timeout", "The upstream stream stalled."))?
            .map_err(|e| {
                bad_gateway(
                    "upstream_unreachable",
                    format!("reading the upstream stream: {e}"),
                )
            })?;
        let Some(piece) = piece else { break };
        for part in opener.feed(&piece).map_err(unopenable)? {
            all.extend_from_slice(&part);
        }
        if !at_done {
            // Whole events only, so a `[DONE]` split across sealed chunks
            // is still seen before any of it goes out.
            let (upto, done) = forwardable(&all, forwarded);
            at_done = done;
            if upto > forwarded {
                let out = Bytes::copy_from_slice(&all[forwarded..upto]);
                forwarded = upto;
                if tx.send(out).await.is_err() {
                    return Ok(());
                }
            }
        }
        if opener.is_complete() {
            break;
        }
    }
    let trailer = opener.trailer().map(<[u8]>::to_vec);
    opener.finish().map_err(unopenable)?;
    match trailer {
        Some(receipt) => {
            let sealed_to = SealedTo {
                key_id,
                enc: client_key.material().enc(),
            };
            proxy
                .verified(x, trusted, sealed_to, &receipt, &all)
                .await?;
        }
        // No receipt: the stage ended the stream with an error event, which
        // never follows a [DONE].
        None if at_done => {
            return Err(bad_gateway(
                "receipt_verification_failed",
                "The upstream stream ended without its receipt; [DONE] was withheld.",
            ))
        }
        None => {}
    }
    if forwarded < all.len() {
        let _ = tx.send(Bytes::copy_from_slice(&all[forwarded..])).await;
    }
    Ok(())
}

/// How far into `all` the stream may go out, starting at `from` (an event
/// boundary): up to the end of its last complete event, or up to the start
/// of the `[DONE]` event (then `true`), which waits for the receipt.
fn forwardable(all: &[u8], from: usize) -> (usize, bool) {
    let mut at = from;
    while let Some(len) = all[at..].windows(2).position(|w| w == b"\n\n") {
        if all[at..].starts_with(STREAM_DONE) {
            return (at, true);
        }
        at += len + 2;
    }
    (at, false)
}

/// An error as a Server-Sent Event (how OpenAI ends a failed stream).
fn error_event(e: &ApiError) -> Vec<u8> {
    let mut ev = b"data: ".to_vec();
    ev.extend(e.body_bytes());
    ev.extend(b"\n\n");
    ev
}

fn unopenable(e: proto::sealing::SealError) -> ApiError {
    bad_gateway(
        "response_unopenable",
        format!("the upstream's sealed response does not open: {e}"),
    )
}

/// Writes one verified exchange to `dir/<receipt id>/` (via a temporary
/// folder renamed into place, so that a folder is never half-written).
fn archive(
    dir: &Path,
    id: &[u8; 16],
    x: &Exchange,
    trusted: &Trusted,
    receipt: &[u8],
    response: &[u8],
) -> Result<()> {
    let name = hex::encode(id);
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let (nonce, evidence) = (hex::encode(&x.nonce), proto::cbor::to_vec(&trusted.bundle));
    let evidence_nonce = hex::encode(&trusted.nonce);
    let files: [(&str, &[u8]); 6] = [
        ("request.json", &x.request),
        ("response", response),
        ("receipt.cbor", receipt),
        ("nonce.hex", nonce.as_bytes()),
        ("evidence.cbor", &evidence),
        ("evidence-nonce.hex", evidence_nonce.as_bytes()),
    ];
    for (f, bytes) in files {
        std::fs::write(tmp.join(f), bytes).with_context(|| format!("writing {f}"))?;
    }
    std::fs::rename(&tmp, dir.join(&name)).with_context(|| format!("renaming {}", tmp.display()))
}

/// Verifies a receipt for a request this proxy sealed to the entry stage.
fn check_receipt(
    v: &VerifiedBundle,
    allow_mock: bool,
    x: &Exchange,
    sealed_to: SealedTo<'_>,
    receipt: &[u8],
    response: &[u8],
) -> VerifyReport {
    let mut inputs = VerifyInputs::new(receipt, &v.stage_keys);
    inputs.sealed_to = Some(sealed_to);
    inputs.request = Some(&x.request);
    inputs.response = Some(response);
    inputs.expected_nonce = Some(&x.nonce);
    inputs.expected_manifest = Some(v.manifest_digest);
    inputs.allow_mock = allow_mock;
    let mut report = verify_receipt(&inputs);
    // What verify_receipt cannot know: how this request was sent.
    // `sealing` must be proven against this proxy's own encapsulated key (a
    // v3 receipt's entry link), not taken on the host's word.
    let proven = report.proven_sealing();
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
            proven == Some(Sealing::Enclave),
            match proven {
                Some(s) => format!(
                    "the entry stage opened {:?}-sealed bytes; the proxy sealed to the enclave key",
                    s.as_str()
                ),
                None => format!(
                    "receipt records sealing {:?}, but does not prove that the entry stage \
                     opened the proxy's own encapsulated key",
                    r.sealing.as_str()
                ),
            },
        );
        extra(
            "proxy.endpoint",
            r.endpoint == x.endpoint,
            format!(
                "receipt names endpoint {}, the request went to {}",
                r.endpoint, x.endpoint
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

/// An OpenAI error made here, an upstream error passed through, or a stage
/// error that came sealed and was opened.
enum ProxyError {
    Api(ApiError),
    Upstream(PassThrough),
    Sealed(StatusCode, Vec<u8>),
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
            ProxyError::Sealed(status, body) => json_response(status, body),
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

fn log_verified(model: &str, v: &VerifiedBundle, what: &str) {
    for (k, m) in v.stage_keys.iter().zip(&v.measurements) {
        tracing::info!(
            model,
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
    match sealed_inner(s, endpoint, &headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn sealed_inner(
    s: AppState,
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
    let json: serde_json::Value = serde_json::from_slice(&request)
        .map_err(|e| ApiError::invalid(None, format!("The request body is not valid JSON: {e}")))?;
    let model = json["model"]
        .as_str()
        .ok_or_else(|| ApiError::invalid(Some("model"), "`model` (a string) is required."))?;
    let route = s
        .routes
        .iter()
        .position(|r| r.model == model)
        .ok_or_else(|| ApiError::model_not_found(model))?;
    let stream = json["stream"] == serde_json::Value::Bool(true);
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
    let x = Exchange {
        endpoint,
        route,
        request,
        nonce,
    };
    let sent = s.send_sealed(&x, auth).await?;
    if stream {
        return finish_streaming(s.clone(), x, sent).await;
    }
    s.finish_buffered(&x, sent).await
}

/// Forwards a GET unchanged (model listing: nothing confidential), keeping
/// to the models this proxy attested.
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
    let body = match r.bytes().await {
        Ok(b) => b,
        Err(e) => {
            return bad_gateway("upstream_unreachable", format!("GET {path}: {e}")).into_response()
        }
    };
    let body = if path == "/v1/models" && status.is_success() {
        match serde_json::from_slice::<serde_json::Value>(&body) {
            Ok(mut v) => {
                if let Some(list) = v["data"].as_array_mut() {
                    list.retain(|m| m["id"].as_str().is_some_and(|id| s.route(id).is_some()));
                }
                Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
            }
            Err(_) => body,
        }
    } else {
        body
    };
    (status, [(header::CONTENT_TYPE, ct)], body).into_response()
}

/// `GET /v1/receipts/{id}`: a receipt this proxy verified.
fn kept_receipt(s: &Proxy, id: &str) -> Response {
    let found = parse_hex("receipt id", id).ok().and_then(|id| {
        s.receipts
            .lock()
            .expect("lock")
            .iter()
            .find(|(k, _)| k[..] == id[..])
            .map(|(_, r)| r.clone())
    });
    match found {
        Some(r) => (
            StatusCode::OK,
            [
                (header::CONTENT_TYPE, "application/cose"),
                (
                    header::HeaderName::from_static(HEADER_RECEIPT_VERIFIED),
                    "true",
                ),
            ],
            r,
        )
            .into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "receipt_not_found",
            format!(
                "No receipt {id} was verified by this proxy (it keeps the last {RECEIPTS_KEPT})."
            ),
        )
        .into_response(),
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
            "/v1/chat/completions",
            post(|State(s): State<AppState>, h: HeaderMap, b: Body| {
                sealed_handler(s, "/v1/chat/completions", h, b)
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
                    if s.route(&id).is_none() {
                        return ApiError::model_not_found(&id).into_response();
                    }
                    forward_get(&s, &format!("/v1/models/{id}"), &h).await
                },
            ),
        )
        .route(
            "/v1/receipts/{id}",
            get(
                |State(s): State<AppState>, UrlPath(id): UrlPath<String>| async move {
                    kept_receipt(&s, &id)
                },
            ),
        )
        .route(
            "/healthz",
            get(|State(s): State<AppState>| async move {
                let models: Vec<_> = s
                    .routes
                    .iter()
                    .map(|r| {
                        let t = r.current();
                        json!({
                            "model": r.model,
                            "mock": t.verified.mock,
                            "measurements": t.verified.measurements,
                        })
                    })
                    .collect();
                Json(json!({
                    "status": "ok",
                    "upstream": s.upstream,
                    "models": models,
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

/// The upstream's model ids (`GET /v1/models`).
async fn upstream_models(client: &reqwest::Client, upstream: &str) -> Result<Vec<String>> {
    let url = format!("{upstream}/v1/models");
    let r = client
        .get(&url)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = r.status();
    let v: serde_json::Value = r.json().await.with_context(|| format!("GET {url}"))?;
    if !status.is_success() {
        anyhow::bail!("GET {url}: {status}: {v}");
    }
    Ok(v["data"]
        .as_array()
        .map(|l| {
            l.iter()
                .filter_map(|m| m["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default())
}

/// Attests every upstream model against the policies: each policy must
/// accept at least one model. Returns the routes, or the lines to print.
async fn attest_all(
    client: &reqwest::Client,
    upstream: &str,
    policies: Vec<(PathBuf, Policy)>,
) -> Result<Vec<Route>, Vec<String>> {
    let models = upstream_models(client, upstream)
        .await
        .map_err(|e| vec![format!("fetching the upstream's evidence failed: {e:#}")])?;
    let mut routes: Vec<Route> = Vec::new();
    for (path, policy) in policies {
        let mut why = Vec::new();
        let mut accepted = false;
        let free: Vec<String> = models
            .iter()
            .filter(|m| !routes.iter().any(|r| &r.model == *m))
            .cloned()
            .collect();
        for model in &free {
            match attest(client, upstream, model, &policy).await {
                Ok((verified, bundle, nonce)) => {
                    log_verified(model, &verified, "attested upstream");
                    routes.push(Route {
                        model: model.clone(),
                        policy: policy.clone(),
                        trusted: RwLock::new(Arc::new(Trusted {
                            verified,
                            bundle,
                            nonce,
                            epoch: 1,
                            at: Instant::now(),
                        })),
                        reattest: tokio::sync::Mutex::new(()),
                    });
                    accepted = true;
                }
                Err(e) => why.push(format!("model {model}: {}", e.message())),
            }
        }
        if !accepted {
            let mut lines = vec![format!(
                "policy {}: no upstream model's evidence verifies against it",
                path.display()
            )];
            lines.extend(why);
            return Err(lines);
        }
    }
    Ok(routes)
}

/// Runs `gateway proxy`; returns the exit code.
pub fn run(a: ProxyArgs) -> Result<i32> {
    let policies = a
        .policy
        .iter()
        .map(|p| Ok((p.clone(), Policy::load(p).map_err(|e| anyhow!(e))?)))
        .collect::<Result<Vec<_>>>()?;
    let upstream = base_url(&a.upstream)?;
    let client = http_client(Duration::from_secs(a.timeout_secs))?;
    if let Some(dir) = &a.archive {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let routes = match attest_all(&client, &upstream, policies).await {
            Ok(r) => r,
            Err(lines) => {
                for l in &lines {
                    eprintln!("{l}");
                }
                eprintln!("refusing to start: the upstream's evidence does not verify against the policy");
                return Ok(EXIT_FAILED);
            }
        };
        let state = Arc::new(Proxy {
            upstream: upstream.clone(),
            aead: a.aead.into(),
            client,
            max_body: a.max_body_bytes,
            idle: Duration::from_secs(a.timeout_secs),
            routes,
            receipts: Mutex::new(VecDeque::new()),
            archive: a.archive,
        });
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

#[cfg(test)]
mod tests {
    use super::{forwardable, STREAM_DONE};

    #[test]
    fn whole_events_go_out_and_done_waits() {
        let ev = b"data: {\"a\":1}\n\n";
        // A partial event waits for the rest.
        assert_eq!(forwardable(&ev[..7], 0), (0, false));
        assert_eq!(forwardable(ev, 0), (ev.len(), false));
        let mut all = ev.to_vec();
        all.extend_from_slice(ev);
        all.extend_from_slice(&STREAM_DONE[..8]);
        // `[DONE]` split across pieces: nothing of it goes out...
        assert_eq!(forwardable(&all, ev.len()), (2 * ev.len(), false));
        all.extend_from_slice(&STREAM_DONE[8..]);
        // ...and once whole it is recognised and held.
        assert_eq!(forwardable(&all, 2 * ev.len()), (2 * ev.len(), true));
        // `data: [DONE]` inside an event's text is not the end.
        let inner = b"data: {\"t\":\"data: [DONE]\"}\n\n";
        assert_eq!(forwardable(inner, 0), (inner.len(), false));
    }

    /// A one-stage receipt for `request`/`response` whose entry link says it
    /// opened `opened`, in format `version`.
    fn receipt(
        key: &ed25519_dalek::SigningKey,
        stage: &proto::receipt::StageKeys,
        x: &super::Exchange,
        response: &[u8],
        opened: proto::receipt::OpenedKey,
        version: proto::receipt::ReceiptVersion,
    ) -> Vec<u8> {
        use proto::digest::Sha256Digest;
        use proto::receipt::{sign_receipt, Link, ReceiptBody, Sealing};
        let link = Link {
            receipt_id: [1; 16],
            stage_index: 0,
            layers: stage.layers,
            evidence_digest: stage.evidence_digest,
            received_digest: Sha256Digest::of(&x.request),
            sent_digest: Sha256Digest::of(response),
            prev_link_digest: None,
            opened: (version != proto::receipt::ReceiptVersion::V2).then_some(opened),
        };
        sign_receipt(
            key,
            &ReceiptBody {
                version,
                receipt_id: [1; 16],
                issued_at_ms: 0,
                endpoint: x.endpoint.into(),
                model_id: "m".into(),
                manifest_digest: Sha256Digest::of(b"manifest"),
                request_digest: Sha256Digest::of(&x.request),
                response_digest: Sha256Digest::of(response),
                client_nonce: Some(x.nonce.clone()),
                sequence: 0,
                mock: true,
                sealing: Sealing::Enclave,
                chain: Vec::new(),
                exit_link: link,
            },
        )
    }

    /// The proxy accepts a receipt only when its entry stage says it opened
    /// the proxy's own encapsulated key: a host that opened the request and
    /// re-sealed it (the receipt still saying "enclave") is refused, and so
    /// is a v2 receipt, which cannot say.
    #[test]
    fn receipts_must_prove_the_enclave_opened_the_proxys_key() {
        use proto::digest::Sha256Digest;
        use proto::receipt::{OpenedKey, ReceiptVersion, SealedTo, StageKeys};
        let key = ed25519_dalek::SigningKey::from_bytes(&[3; 32]);
        let stage = StageKeys {
            stage_index: 0,
            layers: [0, 30],
            evidence_digest: Sha256Digest::of(b"evidence"),
            receipt_key: key.verifying_key().to_bytes(),
        };
        let verified = proto::bundle::VerifiedBundle {
            stage_keys: vec![stage.clone()],
            entry_keys: Vec::new(),
            manifest_digest: Sha256Digest::of(b"manifest"),
            mock: true,
            measurements: Vec::new(),
        };
        let x = super::Exchange {
            endpoint: "/v1/completions",
            route: 0,
            request: super::Bytes::from_static(b"{\"prompt\":\"hi\"}"),
            nonce: vec![9; 16],
        };
        let response = b"{\"choices\":[]}";
        let enc = [0x11; 32];
        let sealed_to = SealedTo {
            key_id: 5,
            enc: &enc,
        };
        let check = |opened: OpenedKey, version: ReceiptVersion| {
            let rc = receipt(&key, &stage, &x, response, opened, version);
            super::check_receipt(&verified, true, &x, sealed_to, &rc, response)
        };
        let honest = check(OpenedKey::of(5, &enc), ReceiptVersion::CURRENT);
        assert!(honest.ok(), "{:#?}", honest.checks);
        let resealed = check(OpenedKey::of(5, &[0x22; 32]), ReceiptVersion::CURRENT);
        assert_eq!(
            resealed.failure().map(|e| e.code()),
            Some("sealing_mismatch"),
            "{:#?}",
            resealed.checks
        );
        let old = check(OpenedKey::of(5, &enc), ReceiptVersion::V2);
        assert!(!old.ok());
        let failed: Vec<_> = old
            .checks
            .iter()
            .filter(|c| c.error.is_some())
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(failed, ["proxy.sealing"], "{:#?}", old.checks);
    }
}
