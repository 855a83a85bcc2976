//! One proxied exchange: sealing and sending the request, re-attesting when
//! the upstream's keys changed, opening a whole response and verifying its
//! receipt.

use super::*;

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
    pub(super) async fn send_sealed(
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
    pub(super) async fn not_success(
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
        // Only the stages hold the response key, so a body that opens is
        // theirs; the HTTP status around it is the host's word. A stage error
        // is an OpenAI error object without a receipt: anything else under
        // an error status was relabelled on the way (fail closed).
        match open_response_with_trailer(client_key, &body) {
            Ok((_, Some(_))) => bad_gateway(
                "upstream_status_mismatch",
                format!(
                    "The upstream answered HTTP {status}, but the sealed body is a complete \
                     answer with its receipt: the status was altered on the way."
                ),
            )
            .into(),
            Ok((plain, None)) if is_error_object(&plain) => ProxyError::Sealed(status, plain),
            Ok(_) => bad_gateway(
                "upstream_status_mismatch",
                format!(
                    "The upstream answered HTTP {status}, but the sealed body is not an error."
                ),
            )
            .into(),
            Err(e) => unopenable(e).into(),
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
            Some(t) => ReceiptTrailer::decode(&t).map_err(|e| {
                bad_gateway(
                    "receipt_verification_failed",
                    format!(
                        "the sealed receipt trailer is malformed ({e}); the response was withheld"
                    ),
                )
            })?,
            // An upstream that seals no trailer: the receipt without the
            // salt of its digests, which fails to verify if they are salted.
            None => ReceiptTrailer {
                receipt: self.receipt_for(&headers).await?,
                digest_salt: None,
            },
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
        sealed_to: SealedTo<'_>,
        receipt: &ReceiptTrailer,
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
        self.keep(body.receipt_id, &receipt.receipt);
        if let Some(dir) = &self.archive {
            if let Err(e) = archive(dir, &body.receipt_id, x, &trusted, receipt, response) {
                // The answer verified; an archive that cannot be written is
                // the operator's problem, not a reason to withhold it.
                tracing::error!(error = %format!("{e:#}"), "writing the archive failed");
            }
        }
        Ok(body)
    }

    pub(super) fn keep(&self, id: [u8; 16], receipt: &[u8]) {
        let mut kept = self.receipts.lock().expect("lock");
        if kept.len() == RECEIPTS_KEPT {
            kept.pop_front();
        }
        kept.push_back((id, receipt.to_vec()));
    }

    /// The receipt of a response from an upstream that sends no trailer:
    /// its header, or fetched by id.
    pub(super) async fn receipt_for(
        &self,
        headers: &reqwest::header::HeaderMap,
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
pub(super) fn check_receipt(
    v: &VerifiedBundle,
    allow_mock: bool,
    x: &Exchange,
    sealed_to: SealedTo<'_>,
    receipt: &ReceiptTrailer,
    response: &[u8],
) -> VerifyReport {
    let mut inputs = VerifyInputs::new(&receipt.receipt, &v.stage_keys);
    inputs.digest_salt = receipt.digest_salt.as_ref();
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
