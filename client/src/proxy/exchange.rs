//! One proxied exchange: sealing and sending the request, re-attesting when
//! the upstream's keys changed, opening a whole response and verifying its
//! receipt.

use super::api_error::ApiError;
use super::{
    attest, bad_gateway, is_sealed, json_response, log_verified, Exchange, Proxy, Route, Sent,
    Trusted, HEADER_RECEIPT, HEADER_RECEIPT_DIGEST_SALT, HEADER_RECEIPT_ID, HEADER_RECEIPT_NONCE,
    HEADER_RECEIPT_SEALING, HEADER_RECEIPT_VERIFIED, MAX_RECEIPT_HEADER, RECEIPTS_KEPT,
    SUSPECT_REATTEST_INTERVAL,
};
use crate::sealed::inclusion::{
    inclusion_path, never_logged, INCLUSION_POLL_FIRST, INCLUSION_POLL_MAX, INCLUSION_WAIT,
    NOT_LOGGED,
};
use crate::sealed::{archive, not_sealed, unknown_signer, Attested, Sealed};
use axum::body::Bytes;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use proto::receipt::ReceiptTrailer;
use std::sync::Arc;
use std::time::Instant;

impl Proxy {
    /// The route for a request's `model`.
    pub(super) fn route(&self, model: &str) -> Option<&Route> {
        self.routes.iter().find(|r| r.model == model)
    }

    /// Re-attests `route` unless someone already did since `seen_epoch`.
    pub(super) async fn refresh(
        &self,
        route: &Route,
        seen_epoch: u64,
    ) -> Result<Arc<Trusted>, ApiError> {
        let _guard = route.reattest.lock().await;
        let cur = route.current();
        if cur.epoch != seen_epoch {
            return Ok(cur);
        }
        let attested = attest(
            &self.client,
            &self.upstream,
            &route.model,
            &route.policy,
            &self.log,
        )
        .await;
        match attested {
            Ok(att) => {
                log_verified(&route.model, &att.verified, "re-attested upstream");
                let t = Arc::new(Trusted {
                    att,
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
    pub(super) async fn send_sealed(&self, x: &Exchange) -> Result<Sent, ProxyError> {
        let route = &self.routes[x.route];
        let mut trusted = route.current();
        let mut refreshed = false;
        loop {
            let mut sealed = Sealed::new(
                &trusted.att.verified,
                self.aead,
                x.endpoint,
                &x.request,
                &x.nonce,
            )
            .map_err(|r| match r.code {
                // Sealing itself failed here, not upstream: an internal error.
                "sealing_failed" => ApiError::internal(r.message),
                _ => ApiError::from(r),
            })?;
            let mut rb = self
                .client
                .post(format!("{}{}", self.upstream, x.endpoint))
                .body(std::mem::take(&mut sealed.body));
            for (k, v) in sealed.send_headers() {
                rb = rb.header(k, v);
            }
            if let Some(a) = &x.auth {
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
                        key_id = sealed.key_id,
                        code = code.as_deref().unwrap_or("none"),
                        "upstream refused a sealed request: re-attesting to check its keys"
                    );
                    let fresh = self.refresh(route, trusted.epoch).await?;
                    if key_unknown
                        || fresh.att.verified.entry_keys != trusted.att.verified.entry_keys
                    {
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
                return Err(self.not_success(response, &sealed).await);
            }
            return Ok(Sent {
                response,
                sealed,
                trusted,
            });
        }
    }

    /// An upstream answer that is not a sealed success: a host-made error
    /// passes through, a sealed stage error is opened.
    pub(super) async fn not_success(
        &self,
        response: reqwest::Response,
        sealed: &Sealed,
    ) -> ProxyError {
        let status = response.status();
        let is_sealed = is_sealed(&response);
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
        if !is_sealed {
            if status.is_success() {
                return ApiError::from(not_sealed()).into();
            }
            // An error the host answered itself (OpenAI-shaped): pass it on.
            return ProxyError::Upstream(PassThrough {
                status,
                headers,
                body,
            });
        }
        match sealed.open_error(status.as_u16(), &body) {
            Ok(plain) => ProxyError::Sealed(status, plain),
            Err(r) => ApiError::from(r).into(),
        }
    }

    /// Reads a whole sealed response, opens it and verifies its receipt.
    pub(super) async fn finish_buffered(
        &self,
        x: &Exchange,
        sent: Sent,
    ) -> Result<Response, ProxyError> {
        let Sent {
            response,
            sealed,
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
        let (plain, trailer) = sealed.open(&body).map_err(ApiError::from)?;
        let receipt = match trailer {
            Some(t) => t,
            // An upstream that seals no trailer: the receipt without the
            // salt of its digests, which fails to verify if they are salted.
            None => ReceiptTrailer {
                receipt: self.receipt_for(&headers, x.auth.as_ref()).await?,
                digest_salt: None,
            },
        };
        let body_receipt = self.verified(x, trusted, &sealed, &receipt, &plain).await?;
        let mut r = json_response(status, plain);
        let h = r.headers_mut();
        h.insert(
            HEADER_RECEIPT_ID,
            HeaderValue::from_str(&hex::encode(body_receipt.receipt_id)).expect("hex"),
        );
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&receipt.receipt);
        if b64.len() <= MAX_RECEIPT_HEADER {
            h.insert(
                HEADER_RECEIPT,
                HeaderValue::from_str(&b64).expect("base64url"),
            );
        }
        h.insert(HEADER_RECEIPT_VERIFIED, HeaderValue::from_static("true"));
        if let Some(salt) = receipt.digest_salt {
            h.insert(
                HEADER_RECEIPT_DIGEST_SALT,
                HeaderValue::from_str(&hex::encode(salt)).expect("hex"),
            );
        }
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
    pub(super) async fn verified(
        &self,
        x: &Exchange,
        mut trusted: Arc<Trusted>,
        sealed: &Sealed,
        receipt: &ReceiptTrailer,
        response: &[u8],
    ) -> Result<proto::receipt::ReceiptBody, ApiError> {
        let route = &self.routes[x.route];
        let mut report = sealed.check(&trusted.att, receipt, response);
        if unknown_signer(&report) {
            tracing::info!("receipt signed by a key not in the evidence: re-attesting once");
            trusted = self.refresh(route, trusted.epoch).await?;
            report = sealed.check(&trusted.att, receipt, response);
        }
        if let Some(refused) = crate::sealed::refusal(&report) {
            let fail = report.checks.iter().find(|c| c.error.is_some());
            let code = fail
                .and_then(|c| c.error.as_ref())
                .map_or("failed", |e| e.code());
            tracing::error!(check = %fail.map_or("", |c| c.name.as_str()), reason = code, "receipt does not verify: answer withheld");
            return Err(refused.into());
        }
        let body = report.receipt.expect("a verified receipt has a body");
        let inclusion = if trusted.att.receipts_logged() {
            Some(
                self.prove_logged(x, &trusted.att, &receipt.receipt, &body.receipt_id)
                    .await?,
            )
        } else {
            None
        };
        self.keep(body.receipt_id, &receipt.receipt);
        if let Some(dir) = &self.archive {
            let written = archive(
                dir,
                &body.receipt_id,
                &sealed.record(),
                &trusted.att,
                receipt,
                inclusion.as_deref(),
                response,
            );
            if let Err(e) = written {
                // The answer verified; an archive that cannot be written is
                // the operator's problem, not a reason to withhold it.
                tracing::error!(error = %format!("{e:#}"), "writing the archive failed");
            }
        }
        Ok(body)
    }

    /// Under a policy with `receipts_logged`: fetches the inclusion receipt
    /// of receipt `id` (asking again, with growing pauses, while the
    /// gateway has not appended it, up to [`INCLUSION_WAIT`]), checks it,
    /// and checks its tree against the latest checkpoint kept (no split
    /// view). Returns its bytes; the error withholds the answer.
    async fn prove_logged(
        &self,
        x: &Exchange,
        att: &Attested,
        receipt: &[u8],
        id: &[u8; 16],
    ) -> Result<Vec<u8>, ApiError> {
        let url = format!("{}{}", self.upstream, inclusion_path(id));
        let deadline = Instant::now() + INCLUSION_WAIT;
        let mut pause = INCLUSION_POLL_FIRST;
        let bytes = loop {
            let mut rb = self.client.get(&url);
            if let Some(a) = &x.auth {
                rb = rb.header(header::AUTHORIZATION, a.clone());
            }
            let (last, again) = match rb.send().await {
                Ok(r) if r.status().is_success() => match r.bytes().await {
                    Ok(b) => break b.to_vec(),
                    Err(e) => (format!("GET {url}: {e}"), true),
                },
                // A 404 without Retry-After is final: a gateway that does
                // not log receipts (or no longer holds this one).
                Ok(r) => (
                    format!("GET {url}: {}", r.status()),
                    r.headers().contains_key(header::RETRY_AFTER)
                        || r.status() != reqwest::StatusCode::NOT_FOUND,
                ),
                Err(e) => (format!("GET {url}: {e}"), true),
            };
            if !again || Instant::now() + pause > deadline {
                tracing::error!(reason = %last, "receipt not proven logged: answer withheld");
                return Err(never_logged(&last).into());
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(INCLUSION_POLL_MAX);
        };
        let proven = att.check_inclusion(receipt, &bytes).inspect_err(|r| {
            tracing::error!(reason = %r.message, "receipt not proven logged: answer withheld");
        })?;
        let log = att.log.as_ref().expect("receipts_logged names a log");
        // Held across the check: trees checked at once are checked against
        // each other through the one remembered.
        let mut state = self.log.state.lock().await;
        match state
            .check_root(&log.log_key, proven.size, proven.root, &self.log.tiles)
            .await
        {
            Ok(seen) => {
                tracing::debug!(
                    index = proven.index,
                    size = proven.size,
                    "receipt logged: {seen}"
                );
                Ok(bytes)
            }
            Err(e) => {
                let msg = format!("the receipt's log entry: {e:#}; the response was withheld");
                tracing::error!(reason = %msg, "receipt's log tree not consistent: answer withheld");
                Err(bad_gateway(NOT_LOGGED, msg))
            }
        }
    }

    pub(super) fn keep(&self, id: [u8; 16], receipt: &[u8]) {
        let mut kept = self.receipts.lock().expect("lock");
        if kept.len() == RECEIPTS_KEPT {
            kept.pop_front();
        }
        kept.push_back((id, receipt.to_vec()));
    }

    /// The receipt of a response from an upstream that sends no trailer:
    /// its header, or fetched by id with the caller's API key (a gateway
    /// serves a receipt to the key that made the request only).
    pub(super) async fn receipt_for(
        &self,
        headers: &reqwest::header::HeaderMap,
        auth: Option<&HeaderValue>,
    ) -> Result<Vec<u8>, ApiError> {
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
        let mut rb = self.client.get(&url);
        if let Some(a) = auth {
            rb = rb.header(header::AUTHORIZATION, a.clone());
        }
        let r = rb
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

/// An upstream answer passed on unchanged (an error the host made itself).
pub(super) struct PassThrough {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Bytes,
}

/// An OpenAI error made here, an upstream error passed through, or a stage
/// error that came sealed and was opened.
pub(super) enum ProxyError {
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
        // No error carries a verified receipt: say so on every one.
        let mut r = self.into_unmarked_response();
        r.headers_mut()
            .insert(HEADER_RECEIPT_VERIFIED, HeaderValue::from_static("false"));
        r
    }
}

impl ProxyError {
    fn into_unmarked_response(self) -> Response {
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
