//! Streams: whole events forwarded as they open, `[DONE]` held back until
//! the receipt over the whole event stream verifies.

use super::*;

/// A streamed answer: events are forwarded as they open; the `[DONE]` event
/// waits for the receipt (the sealed stream's trailer) to verify.
pub(super) async fn finish_streaming(
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
    let trailer = opener.trailer().map(ReceiptTrailer::decode).transpose();
    opener.finish().map_err(unopenable)?;
    let trailer = trailer.map_err(|e| {
        bad_gateway(
            "receipt_verification_failed",
            format!("The stream's sealed receipt trailer is malformed ({e}); [DONE] was withheld."),
        )
    })?;
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
        // No receipt: only a stage that ended the stream with an error
        // event may do that (never after a [DONE]); anything else is not a
        // complete answer, and the client must not take it for one.
        None if at_done || !ends_with_error_event(&all) => {
            return Err(bad_gateway(
                "receipt_verification_failed",
                "The upstream stream ended without its receipt or an error event; \
                 [DONE] was withheld.",
            ))
        }
        None => {}
    }
    if forwarded < all.len() {
        let _ = tx.send(Bytes::copy_from_slice(&all[forwarded..])).await;
    }
    Ok(())
}

pub(super) fn unopenable(e: proto::sealing::SealError) -> ApiError {
    bad_gateway(
        "response_unopenable",
        format!("the upstream's sealed response does not open: {e}"),
    )
}
