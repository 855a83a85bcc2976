//! The model routes (`/v1/embeddings`, `/v1/completions`,
//! `/v1/chat/completions`) as HTTP: the body and headers read into a
//! [`ModelRequest`], the service's [`ModelAnswer`] written back as a
//! response with its receipt headers. What happens in between is
//! `crate::service`.

use super::{
    AppState, HEADER_RECEIPT, HEADER_RECEIPT_DIGEST_SALT, HEADER_RECEIPT_ID, HEADER_RECEIPT_NONCE,
    MAX_RECEIPT_HEADER,
};
use crate::auth::Caller;
use crate::openai_error::ApiError;
use crate::service::{ModelAnswer, ModelRequest, Owner, StreamAnswer, WholeAnswer};
use axum::body::{to_bytes, Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use base64::Engine as _;
use proto::openai::ApiEndpoint;
use proto::receipt::ReceiptTrailer;
use proto::sealing::{SealedHeaders, HEADER_KEY_ID};
use std::time::Instant;

/// `POST /v1/embeddings`.
pub(super) async fn embeddings_handler(
    State(s): State<AppState>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    model_route(s, ApiEndpoint::Embeddings, owner_of(caller), headers, body).await
}

/// The receipt owner of a request: its API key's name (`[auth]` on).
pub(super) fn owner_of(caller: Option<Extension<Caller>>) -> Owner {
    caller.map(|Extension(Caller(name))| name)
}

/// One model request through the service, logged with its status and
/// latency (never its content).
pub(super) async fn model_route(
    s: AppState,
    endpoint: ApiEndpoint,
    owner: Owner,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let started = Instant::now();
    let resp = match answer(&s, endpoint, owner, &headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    tracing::info!(
        endpoint = endpoint.path(),
        status = resp.status().as_u16(),
        latency_ms = started.elapsed().as_secs_f64() * 1e3,
        "request"
    );
    resp
}

async fn answer(
    s: &AppState,
    endpoint: ApiEndpoint,
    owner: Owner,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let (replicas, endpoint) = s.service.replicas_for(endpoint)?;
    let body = read_body(s.limits.max_body_bytes, headers, body).await?;
    let nonce = receipt_nonce(headers)?;
    // Some replica must be serving, whatever the request.
    replicas.ready().map_err(|r| ApiError::not_ready(&r))?;
    let sealing = if headers.contains_key(HEADER_KEY_ID) {
        Some(
            SealedHeaders::from_header_values(|name| {
                headers.get(name).and_then(|v| v.to_str().ok())
            })
            .map_err(|e| {
                ApiError::invalid(Some(HEADER_KEY_ID), format!("Bad sealing headers: {e}"))
            })?,
        )
    } else {
        None
    };
    let req = ModelRequest {
        endpoint,
        sealing,
        body,
        nonce,
        owner,
    };
    Ok(match s.service.answer(replicas, req).await? {
        ModelAnswer::Whole(w) => whole_response(w),
        ModelAnswer::Stream(st) => stream_response(st),
    })
}

/// The body, refused with 413 above `limit` (by its `Content-Length` at
/// once, or as it is read).
async fn read_body(limit: usize, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
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

/// The client's `receipt-nonce` header: hex, at most 64 bytes.
fn receipt_nonce(headers: &HeaderMap) -> Result<Option<Vec<u8>>, ApiError> {
    match headers
        .get(HEADER_RECEIPT_NONCE)
        .map(|v| v.to_str().map(hex::decode))
    {
        None => Ok(None),
        Some(Ok(Ok(n))) if n.len() <= 64 => Ok(Some(n)),
        Some(_) => Err(ApiError::invalid(
            Some(HEADER_RECEIPT_NONCE),
            "The receipt-nonce header must be hex, at most 64 bytes.",
        )),
    }
}

fn status_of(code: u16) -> StatusCode {
    StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

/// A whole answer: JSON, or sealed bytes, with its receipt headers and
/// `Retry-After`.
fn whole_response(w: WholeAnswer) -> Response {
    let content_type = if w.sealed {
        "application/octet-stream"
    } else {
        "application/json"
    };
    let mut r = (
        status_of(w.status),
        [(header::CONTENT_TYPE, content_type)],
        w.body,
    )
        .into_response();
    if w.sealed {
        r.headers_mut().insert(
            header::HeaderName::from_static("hpke-sealed"),
            HeaderValue::from_static("response"),
        );
    }
    if let Some((id, receipt)) = &w.receipt {
        receipt_headers(&mut r, *id, receipt);
    }
    if let Some(secs) = w.retry_after {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    r
}

/// Puts the receipt's id, the receipt (if it fits) and the salt of its
/// digests (if the gateway knows it) in the response headers.
fn receipt_headers(r: &mut Response, id: [u8; 16], kept: &ReceiptTrailer) {
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&hex::encode(id)) {
        h.insert(HEADER_RECEIPT_ID, v);
    }
    if let Some(salt) = kept.digest_salt {
        if let Ok(v) = HeaderValue::from_str(&hex::encode(salt)) {
            h.insert(HEADER_RECEIPT_DIGEST_SALT, v);
        }
    }
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&kept.receipt);
    if b64.len() <= MAX_RECEIPT_HEADER {
        if let Ok(v) = HeaderValue::from_str(&b64) {
            h.insert(HEADER_RECEIPT, v);
        }
    }
}

/// A streamed answer: server-sent events for a plain client, sealed
/// chunks otherwise; the receipt id in the headers (the receipt comes at
/// the stream's end).
fn stream_response(st: StreamAnswer) -> Response {
    let body = Body::from_stream(futures_util::stream::unfold(
        st.chunks,
        |mut rx| async move {
            rx.recv()
                .await
                .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
        },
    ));
    let mut r = if st.sealed {
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
    } else {
        (
            StatusCode::OK,
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            body,
        )
            .into_response()
    };
    if let Ok(v) = HeaderValue::from_str(&hex::encode(st.receipt_id)) {
        r.headers_mut().insert(HEADER_RECEIPT_ID, v);
    }
    r
}
