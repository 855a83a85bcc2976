//! The proxy's HTTP handlers and router.

use super::api_error::ApiError;
use super::exchange::ProxyError;
use super::stream::finish_streaming;
use super::{
    bad_gateway, error, AppState, Exchange, Proxy, HEADER_RECEIPT_NONCE, HEADER_RECEIPT_VERIFIED,
    RECEIPTS_KEPT,
};
use crate::client_key::aead_name;
use crate::io::parse_hex;
use crate::transport::random_nonce;
use axum::body::{to_bytes, Body, Bytes};
use axum::extract::{Path as UrlPath, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

pub(super) async fn sealed_handler(
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

pub(super) async fn sealed_inner(
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
    let x = Exchange {
        endpoint,
        route,
        request,
        nonce,
        auth: headers.get(header::AUTHORIZATION).cloned(),
    };
    let sent = s.send_sealed(&x).await?;
    if stream {
        return finish_streaming(s.clone(), x, sent).await;
    }
    s.finish_buffered(&x, sent).await
}

/// Forwards a GET unchanged (model listing: nothing confidential), keeping
/// to the models this proxy attested.
pub(super) async fn forward_get(s: &Proxy, path: &str, headers: &HeaderMap) -> Response {
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
pub(super) fn kept_receipt(s: &Proxy, id: &str) -> Response {
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

pub(super) fn router(state: AppState) -> Router {
    // Every model API: sealed to the attested entry stage, receipt verified.
    let mut r = Router::new();
    for e in proto::openai::ApiEndpoint::ALL {
        r = r.route(
            e.path(),
            post(move |State(s): State<AppState>, h: HeaderMap, b: Body| {
                sealed_handler(s, e.path(), h, b)
            }),
        );
    }
    r.route(
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
                        "mock": t.att.verified.mock,
                        "measurements": t.att.verified.measurements,
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
