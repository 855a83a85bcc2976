//! The model routes: reading the body, then relaying a client-sealed request
//! as ciphertext, or sealing a plain (or gateway-key) request to the entry
//! stage and opening its answer.

use super::stream::{stream_response, StreamMode};
use super::{
    AppState, GatewayKey, Owner, HEADER_RECEIPT, HEADER_RECEIPT_DIGEST_SALT, HEADER_RECEIPT_ID,
    HEADER_RECEIPT_NONCE, MAX_RECEIPT_HEADER,
};
use crate::auth::Caller;
use crate::openai_error::ApiError;
use crate::pipeline::{Failure, Replicas, Reply, Submission};
use crate::receipts::Stored;
use axum::body::{to_bytes, Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use base64::Engine as _;
use proto::openai::ApiEndpoint;
use proto::receipt::{ReceiptTrailer, Sealing};
use proto::sealing::{
    open_response, open_response_with_trailer, seal_request, seal_response,
    seal_response_with_trailer, Aead, ClientResponseKey, ResponseKeyMaterial, ResponseSealer,
    SealedHeaders, HEADER_KEY_ID,
};
use std::sync::Arc;
use std::time::Instant;

pub(super) fn failure_response(s: &AppState, f: Failure) -> Response {
    match f {
        Failure::NotReady(r) | Failure::NotSent(r) => ApiError::not_ready(&r).into_response(),
        Failure::Timeout => ApiError::timeout(s.limits.timeout.as_secs()).into_response(),
    }
}

pub(super) async fn embeddings_handler(
    State(s): State<AppState>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = Instant::now();
    let replicas = s.pipeline.clone();
    let endpoint = replicas.primary().endpoint;
    let owner = owner_of(caller);
    let resp = relay(&s, &replicas, endpoint, &owner, &headers, body).await;
    log_request(endpoint, started, &resp);
    resp
}

/// The receipt owner of a request: its API key's name (`[auth]` on).
pub(super) fn owner_of(caller: Option<Extension<Caller>>) -> Owner {
    caller.map(|Extension(Caller(name))| name)
}

/// One log line per model request: endpoint, status and latency (never
/// content).
fn log_request(endpoint: ApiEndpoint, started: Instant, resp: &Response) {
    tracing::info!(
        endpoint = endpoint.path(),
        status = resp.status().as_u16(),
        latency_ms = started.elapsed().as_secs_f64() * 1e3,
        "request"
    );
}

pub(super) async fn read_body(
    s: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, ApiError> {
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

/// `/v1/completions` and `/v1/chat/completions`: both go to the completions
/// pipeline, whose entry stage reads (and, for chat, templates) the request.
pub(super) async fn generation_handler(
    s: AppState,
    endpoint: ApiEndpoint,
    owner: Owner,
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
                     configured), so {} is not available.",
                    endpoint.path()
                ),
            )
        }
        .into_response();
    };
    let resp = relay(&s, &pipeline, endpoint, &owner, &headers, body).await;
    log_request(endpoint, started, &resp);
    resp
}

/// Seals (plain clients) or relays (sealed clients) one API request.
pub(super) async fn relay(
    s: &AppState,
    replicas: &Arc<Replicas>,
    endpoint: ApiEndpoint,
    owner: &Owner,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    match relay_inner(s, replicas, endpoint, owner, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

pub(super) async fn relay_inner(
    s: &AppState,
    replicas: &Arc<Replicas>,
    endpoint: ApiEndpoint,
    owner: &Owner,
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
    // Some replica must be serving, whatever the request.
    replicas.ready().map_err(|r| ApiError::not_ready(&r))?;
    if headers.contains_key(HEADER_KEY_ID) {
        // Sealed by the client to the enclave key: relay ciphertext only.
        let sealed = SealedHeaders::from_header_values(|name| {
            headers.get(name).and_then(|v| v.to_str().ok())
        })
        .map_err(|e| ApiError::invalid(Some(HEADER_KEY_ID), format!("Bad sealing headers: {e}")))?;
        if GatewayKey::owns(sealed.key_id) {
            s.metrics.sealing(Sealing::Gateway);
            return via_gateway_key(s, replicas, endpoint, owner, &sealed, &bytes, nonce).await;
        }
        // The key names the replica whose entry stage holds it: only that
        // one can open the request.
        let Some(pipeline) = replicas.holding(sealed.key_id, sealed.aead) else {
            return Err(ApiError::unknown_key(sealed.key_id));
        };
        s.metrics.sealing(Sealing::Enclave);
        let (reply, sub) = pipeline
            .submit(
                endpoint.path(),
                sealed,
                bytes.to_vec(),
                nonce,
                Sealing::Enclave,
                s.limits.routes.for_route(endpoint.path()),
            )
            .await
            .map_err(|f| failure_error(s, f))?;
        return Ok(match reply {
            Reply::StreamStart { receipt_id } => {
                stream_response(s, owner, sub, receipt_id, StreamMode::Relay)
            }
            Reply::Response(w) => {
                let mut r = sealed_response(w.status, w.body);
                // Sealed to the enclave: the salt is in the sealed trailer,
                // for the client only.
                let kept = ReceiptTrailer {
                    receipt: w.receipt,
                    digest_salt: None,
                };
                attach_receipt(s, owner, &mut r, w.receipt_id, kept).await;
                r
            }
            Reply::Failed(mut e) => {
                let retry = e.retry_after_secs;
                let mut r = match e.sealed_body.take() {
                    Some(body) => sealed_response(e.status, body),
                    None => ApiError::from_pipeline(e).into_response(),
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
        match seal_to_entry(s, replicas, endpoint, &bytes, nonce, Sealing::Plain).await? {
            Answer::Whole(mut w) => {
                let r = json_response(w.status, std::mem::take(&mut w.body));
                w.finish(s, owner, r).await
            }
            Answer::Stream {
                receipt_id,
                sub,
                client_key,
            } => stream_response(s, owner, sub, receipt_id, StreamMode::Open(client_key)),
        },
    )
}

/// What came back for a request the gateway sealed itself.
pub(super) enum Answer {
    /// A whole (opened) response or error.
    Whole(Whole),
    /// A stream: its rest comes through `sub`, sealed to `client_key`.
    Stream {
        receipt_id: [u8; 16],
        sub: Submission,
        client_key: ClientResponseKey,
    },
}

/// A whole (opened) response or error, and what goes with it.
pub(super) struct Whole {
    status: u16,
    body: Vec<u8>,
    /// The receipt's id, the receipt and the salt of its digests.
    receipt: Option<([u8; 16], ReceiptTrailer)>,
    retry_after: Option<u32>,
}

impl Whole {
    /// `r` (made from this answer's body) with its receipt headers, kept
    /// receipt and `Retry-After`.
    async fn finish(self, s: &AppState, owner: &Owner, mut r: Response) -> Response {
        if let Some((id, receipt)) = self.receipt {
            attach_receipt(s, owner, &mut r, id, receipt).await;
        }
        set_retry_after(&mut r, self.retry_after);
        r
    }
}

pub(super) fn unexpected_reply() -> Response {
    ApiError::internal("the exit stage answered out of order").into_response()
}

pub(super) fn set_retry_after(r: &mut Response, secs: Option<u32>) {
    if let Some(secs) = secs {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
}

/// Seals `plaintext` to the entry stage of the least-loaded ready replica,
/// waits, and opens the answer (or hands back the stream to open as it
/// comes). A replica the request could not be sent to (its pipeline broke
/// a moment ago) is passed over for the next; once a replica has the
/// request, its failure is the answer.
pub(super) async fn seal_to_entry(
    s: &AppState,
    replicas: &Arc<Replicas>,
    endpoint: ApiEndpoint,
    plaintext: &[u8],
    nonce: Option<Vec<u8>>,
    sealing: Sealing,
) -> Result<Answer, ApiError> {
    let mut not_sent = None;
    let mut sent = None;
    for pipeline in replicas.by_load() {
        let Ok(keys) = pipeline.entry_keys() else {
            continue;
        };
        let key = &keys[0];
        let aead = if key.supports(Aead::Aes128Gcm) {
            Aead::Aes128Gcm
        } else {
            key.aeads[0]
        };
        let (sealed, body, client_key) = seal_request(key, aead, plaintext)
            .map_err(|e| ApiError::internal(format!("sealing failed: {e}")))?;
        match pipeline
            .submit(
                endpoint.path(),
                sealed,
                body,
                nonce.clone(),
                sealing,
                s.limits.routes.for_route(endpoint.path()),
            )
            .await
        {
            Ok((reply, sub)) => {
                sent = Some((reply, sub, client_key));
                break;
            }
            Err(Failure::NotSent(reason)) => {
                tracing::warn!(replica = pipeline.replica, reason = %reason, "replica unavailable; trying another");
                not_sent = Some(Failure::NotSent(reason));
            }
            Err(f) => return Err(failure_error(s, f)),
        }
    }
    let Some((reply, sub, client_key)) = sent else {
        let f = not_sent.unwrap_or_else(|| Failure::NotReady(replicas.not_ready_reason()));
        return Err(failure_error(s, f));
    };
    let open = |body: &[u8]| {
        open_response(&client_key, body)
            .map_err(|e| ApiError::internal(format!("the stage's response does not open: {e}")))
    };
    Ok(match reply {
        Reply::Response(w) => {
            let (body, trailer) =
                open_response_with_trailer(&client_key, &w.body).map_err(|e| {
                    ApiError::internal(format!("the stage's response does not open: {e}"))
                })?;
            // The stage's trailer holds the receipt and the salt of its digests.
            let digest_salt = trailer
                .and_then(|t| ReceiptTrailer::decode(&t).ok())
                .and_then(|t| t.digest_salt);
            let receipt = ReceiptTrailer {
                receipt: w.receipt,
                digest_salt,
            };
            Answer::Whole(Whole {
                status: w.status,
                body,
                receipt: Some((w.receipt_id, receipt)),
                retry_after: None,
            })
        }
        Reply::Failed(mut e) => {
            let retry_after = e.retry_after_secs;
            let (status, body) = match e.sealed_body.take() {
                Some(body) => (e.status, open(&body)?),
                // The gateway sealed this request with its own clock: a
                // stale one says the gateway's and the stage's clocks differ.
                None if e.kind == proto::frames::ErrorKind::Stale => {
                    tracing::error!(
                        "the entry stage refused a request the gateway sealed as stale: \
                         the gateway's clock and the stage's differ by more than 300 s"
                    );
                    let api = ApiError::internal(
                        "The gateway's clock and the inference pipeline's disagree; the request was not run.",
                    );
                    (api.status.as_u16(), api.body_bytes())
                }
                None => {
                    let api = ApiError::from_pipeline(e);
                    (api.status.as_u16(), api.body_bytes())
                }
            };
            Answer::Whole(Whole {
                status,
                body,
                receipt: None,
                retry_after,
            })
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
pub(super) async fn via_gateway_key(
    s: &AppState,
    replicas: &Arc<Replicas>,
    endpoint: ApiEndpoint,
    owner: &Owner,
    sealed: &SealedHeaders,
    bytes: &[u8],
    nonce: Option<Vec<u8>>,
) -> Result<Response, ApiError> {
    let (plaintext, material) = s.gateway_key.open(sealed, bytes)?;
    match seal_to_entry(s, replicas, endpoint, &plaintext, nonce, Sealing::Gateway).await? {
        Answer::Whole(w) => {
            // A receipt rides along as the sealed body's trailer.
            let sealed_body = match &w.receipt {
                Some((_, t)) => seal_response_with_trailer(&material, &w.body, &t.encode()),
                None => seal_response(&material, &w.body),
            }
            .map_err(|e| ApiError::internal(format!("sealing the response failed: {e}")))?;
            let r = sealed_response(w.status, sealed_body);
            Ok(w.finish(s, owner, r).await)
        }
        Answer::Stream {
            receipt_id,
            sub,
            client_key,
        } => {
            let sealer = reseal(&material)?;
            Ok(stream_response(
                s,
                owner,
                sub,
                receipt_id,
                StreamMode::Reseal(client_key, sealer),
            ))
        }
    }
}

pub(super) fn reseal(material: &ResponseKeyMaterial) -> Result<ResponseSealer, ApiError> {
    ResponseSealer::new(material)
        .map_err(|e| ApiError::internal(format!("sealing the response failed: {e}")))
}

pub(super) fn failure_error(s: &AppState, f: Failure) -> ApiError {
    match f {
        Failure::NotReady(r) | Failure::NotSent(r) => ApiError::not_ready(&r),
        Failure::Timeout => ApiError::timeout(s.limits.timeout.as_secs()),
    }
}

pub(super) fn status_of(code: u16) -> StatusCode {
    StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

pub(super) fn json_response(status: u16, body: Vec<u8>) -> Response {
    (
        status_of(status),
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

pub(super) fn sealed_response(status: u16, body: Vec<u8>) -> Response {
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

/// Puts the receipt's id, the receipt (if it fits) and the salt of its
/// digests (if the gateway knows it) in the response headers, and keeps the
/// receipt for `GET /v1/receipts/{id}` with its owner.
pub(super) async fn attach_receipt(
    s: &AppState,
    owner: &Owner,
    r: &mut Response,
    id: [u8; 16],
    kept: ReceiptTrailer,
) {
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&hex::encode(id)) {
        h.insert(HEADER_RECEIPT_ID, v);
    }
    if let Some(salt) = kept.digest_salt {
        if let Ok(v) = HeaderValue::from_str(&hex::encode(salt)) {
            h.insert(HEADER_RECEIPT_DIGEST_SALT, v);
        }
    }
    let receipt = &kept.receipt;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(receipt);
    if b64.len() <= MAX_RECEIPT_HEADER {
        if let Ok(v) = HeaderValue::from_str(&b64) {
            h.insert(HEADER_RECEIPT, v);
        }
    }
    // Stored before the response leaves, so that any gateway sharing the
    // store answers for it at once. A store that fails does not fail the
    // request: the client has the receipt in the response.
    let stored = Stored {
        trailer: kept,
        owner: owner.as_deref().map(str::to_string),
    };
    if let Err(e) = s.receipts.insert(id, stored).await {
        tracing::warn!(error = %format!("{e:#}"), "a receipt was not stored");
        s.metrics.receipt_not_stored();
    }
    s.metrics.receipt_issued();
}
