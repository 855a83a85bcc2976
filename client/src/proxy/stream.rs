//! Streams: whole events forwarded as they open, `[DONE]` held back until
//! the receipt over the whole event stream verifies.

use super::api_error::ApiError;
use super::exchange::ProxyError;
use super::{bad_gateway, Exchange, Proxy, Sent, HEADER_RECEIPT_ID, HEADER_RECEIPT_NONCE};
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

/// A streamed answer: events are forwarded as they open; the `[DONE]` event
/// waits for the receipt (the sealed stream's trailer) to verify.
pub(super) async fn finish_streaming(
    proxy: Arc<Proxy>,
    x: Exchange,
    sent: Sent,
) -> Result<Response, ProxyError> {
    let receipt_id = sent.response.headers().get(HEADER_RECEIPT_ID).cloned();
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(64);
    let nonce = x.nonce.clone();
    tokio::spawn(async move {
        let events = pump_stream(&proxy, &x, sent, &tx).await;
        if let Err(e) = events {
            tracing::warn!(error = %e.0.message, "stream from the upstream ended without a verified receipt");
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
pub(super) async fn pump_stream(
    proxy: &Proxy,
    x: &Exchange,
    sent: Sent,
    tx: &tokio::sync::mpsc::Sender<Bytes>,
) -> Result<(), ApiError> {
    let (mut response, sealed, trusted) = (sent.response, sent.sealed, sent.trusted);
    let mut opener = sealed.stream();
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
        let out = opener.feed(&piece)?;
        if !out.is_empty() && tx.send(Bytes::from(out)).await.is_err() {
            return Ok(());
        }
        if opener.is_complete() {
            break;
        }
    }
    let end = opener.finish()?;
    if let Some(receipt) = &end.receipt {
        proxy
            .verified(x, trusted, &sealed, receipt, &end.all)
            .await?;
    }
    if !end.rest.is_empty() {
        let _ = tx.send(Bytes::from(end.rest)).await;
    }
    Ok(())
}

/// An error as a Server-Sent Event (how OpenAI ends a failed stream).
pub(super) fn error_event(e: &ApiError) -> Vec<u8> {
    let mut ev = b"data: ".to_vec();
    ev.extend(e.body_bytes());
    ev.extend(b"\n\n");
    ev
}
