//! One request sealed to verified evidence, and the opening and checking of
//! its answer, with no I/O: `gateway proxy` and the Python package
//! (`client/python`) wrap their own HTTP stacks around this same code, so
//! what is refused is refused alike in both.
//!
//! 1. [`Attested::verify`]: an evidence bundle, fetched with a fresh nonce,
//!    checked against a measurement policy;
//! 2. [`Sealed::new`]: the request body sealed to the attested entry key,
//!    with the headers to send;
//! 3. the answer: a whole one opened ([`Sealed::open`]) and its receipt
//!    checked ([`Sealed::check`], [`refusal`]), a stream opened piece by piece
//!    ([`Sealed::stream`], [`StreamOpen`]), or a sealed stage error opened
//!    ([`Sealed::open_error`]).

use crate::client_key::pick_key;
use crate::verify::verify_evidence;
use proto::bundle::{EvidenceBundle, VerifiedBundle};
use proto::policy::Policy;
use proto::receipt::{
    verify_receipt, Check, CheckStatus, ReceiptError, ReceiptTrailer, SealedTo, Sealing,
    VerifyInputs, VerifyReport,
};
use proto::sealing::{
    open_response_with_trailer, seal_request, Aead, ClientResponseKey, SealedHeaders,
};

mod archive;
pub mod inclusion;
pub mod sse;
mod stream;

pub use archive::archive;
pub use stream::{StreamEnd, StreamOpen};

/// Why an answer (or the evidence) is refused: a machine-readable code, the
/// same the proxy puts in its 502 errors, and a message for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// E.g. `receipt_verification_failed`, `response_unopenable`.
    pub code: &'static str,
    /// What failed, for the log and the caller.
    pub message: String,
}

impl Refused {
    /// A refusal with `code`.
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for Refused {}

/// Evidence that verified against a policy, with what it was fetched with.
#[derive(Clone, Debug)]
pub struct Attested {
    /// What the evidence proves: stage keys, entry keys, measurements.
    pub verified: VerifiedBundle,
    /// The bundle itself (for archives).
    pub bundle: EvidenceBundle,
    /// The nonce it was fetched with.
    pub nonce: Vec<u8>,
    /// The policy's `allow_mock` (receipts from mock stages are accepted).
    pub allow_mock: bool,
    /// The policy's transparency log, if it is log-backed.
    pub log: Option<proto::policy::LogPolicy>,
}

impl Attested {
    /// Verifies `bundle`, fetched with `nonce`, against `policy`; the error
    /// holds the failed checks, one line each.
    pub fn verify(
        bundle: EvidenceBundle,
        policy: &Policy,
        nonce: &[u8],
    ) -> Result<Self, Vec<String>> {
        // Online: the keys are about to be trusted, so evidence without a
        // purpose label is refused.
        let out = verify_evidence(
            &bundle,
            policy,
            Some(nonce),
            None,
            proto::bundle::LegacyEvidence::Refuse,
        );
        let ok = out.ok();
        match out.verified.filter(|_| ok) {
            Some(verified) => Ok(Self {
                verified,
                bundle,
                nonce: nonce.to_vec(),
                allow_mock: policy.allow_mock,
                log: policy.transparency.clone(),
            }),
            None => Err(out
                .lines
                .iter()
                .filter(|l| l.status == CheckStatus::Fail || l.name == "hint")
                .map(|l| l.to_string())
                .collect()),
        }
    }
}

/// A request as the client sent it and where it was sealed to: what its
/// receipt must name.
#[derive(Clone, Copy, Debug)]
pub struct RequestRecord<'a> {
    /// The API path, e.g. `/v1/embeddings`.
    pub endpoint: &'a str,
    /// The plaintext body.
    pub body: &'a [u8],
    /// The receipt nonce sent with it.
    pub nonce: &'a [u8],
    /// The key id and encapsulated key it was sealed with.
    pub sealed_to: SealedTo<'a>,
}

/// Verifies a receipt for a request sealed to the entry stage: everything
/// [`verify_receipt`] checks, plus what only the sender knows (that the
/// entry stage opened *its* encapsulated key, and the endpoint).
pub fn check_receipt(
    v: &VerifiedBundle,
    allow_mock: bool,
    req: &RequestRecord<'_>,
    receipt: &ReceiptTrailer,
    response: &[u8],
) -> VerifyReport {
    let mut inputs = VerifyInputs::new(&receipt.receipt, &v.stage_keys);
    inputs.digest_salt = receipt.digest_salt.as_ref();
    inputs.sealed_to = Some(req.sealed_to);
    inputs.request = Some(req.body);
    inputs.response = Some(response);
    inputs.expected_nonce = Some(req.nonce);
    inputs.expected_manifest = Some(v.manifest_digest);
    inputs.allow_mock = allow_mock;
    let mut report = verify_receipt(&inputs);
    // `sealing` must be proven against the sender's own encapsulated key (a
    // v3 receipt's entry link), not taken on the host's word.
    let proven = report.proven_sealing();
    if let Some(r) = report.receipt.clone() {
        let mut extra = |name: &str, ok: bool, detail: String| {
            report.checks.push(Check {
                name: name.into(),
                status: if ok {
                    CheckStatus::Pass
                } else {
                    CheckStatus::Fail
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
                    "the entry stage opened {:?}-sealed bytes; the client sealed to the enclave key",
                    s.as_str()
                ),
                None => format!(
                    "receipt records sealing {:?}, but does not prove that the entry stage \
                     opened the client's own encapsulated key",
                    r.sealing.as_str()
                ),
            },
        );
        extra(
            "proxy.endpoint",
            r.endpoint == req.endpoint,
            format!(
                "receipt names endpoint {}, the request went to {}",
                r.endpoint, req.endpoint
            ),
        );
    }
    report
}

/// The refusal for a report with a failed check (`None` when all held).
pub fn refusal(report: &VerifyReport) -> Option<Refused> {
    let fail = report.checks.iter().find(|c| c.error.is_some())?;
    let code = fail.error.as_ref().map(|e| e.code()).unwrap_or("failed");
    Some(Refused::new(
        "receipt_verification_failed",
        format!(
            "The upstream's receipt does not verify ({code}: {}: {}); the response was withheld.",
            fail.name, fail.detail
        ),
    ))
}

/// Whether a report failed only because a signer is not in the evidence
/// (the stages may have restarted: worth one re-attestation).
pub fn unknown_signer(report: &VerifyReport) -> bool {
    matches!(
        report.failure(),
        Some(ReceiptError::UnknownSigner | ReceiptError::LinkUnknownSigner { .. })
    )
}

/// A request sealed to an attested entry key.
pub struct Sealed {
    /// The API path it goes to.
    pub endpoint: String,
    /// The plaintext body (what the receipt's request digest covers).
    pub request: Vec<u8>,
    /// The receipt nonce to send (`receipt-nonce`, hex).
    pub nonce: Vec<u8>,
    /// The key id it is sealed to.
    pub key_id: u8,
    /// The sealing headers (`hpke-key-id`, `hpke-aead`,
    /// `hpke-encapsulated-key`, `hpke-sealed-at`); [`Sealed::send_headers`]
    /// adds the rest.
    headers: Vec<(&'static str, String)>,
    /// The sealed body to send.
    pub body: Vec<u8>,
    client_key: ClientResponseKey,
}

impl Sealed {
    /// Seals `request` for `endpoint` to the first entry key of `attested`
    /// that supports `aead`.
    pub fn new(
        attested: &VerifiedBundle,
        aead: Aead,
        endpoint: &str,
        request: &[u8],
        nonce: &[u8],
    ) -> Result<Self, Refused> {
        let key = pick_key(&attested.entry_keys, None, aead).map_err(|e| {
            Refused::new("hpke_key_unavailable", format!("attested entry key: {e}"))
        })?;
        let (headers, body, client_key) = seal_request(&key, aead, request)
            .map_err(|e| Refused::new("sealing_failed", format!("sealing failed: {e}")))?;
        Ok(Self {
            endpoint: endpoint.to_string(),
            request: request.to_vec(),
            nonce: nonce.to_vec(),
            key_id: key.key_id,
            headers: headers.to_header_values().to_vec(),
            body,
            client_key,
        })
    }

    /// Every header the sealed request goes with: the sealing headers,
    /// `content-type: application/octet-stream` and `receipt-nonce`.
    pub fn send_headers(&self) -> Vec<(&'static str, String)> {
        let mut h = self.headers.clone();
        h.push(("content-type", "application/octet-stream".into()));
        h.push(("receipt-nonce", hex::encode(&self.nonce)));
        h
    }

    /// The sealing headers as the entry stage receives them.
    pub fn sealing_headers(&self) -> SealedHeaders {
        SealedHeaders::from_header_values(|n| {
            self.headers
                .iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.as_str())
        })
        .expect("the headers this request was sealed with parse")
    }

    /// The message a gateway sends the entry stage for this request, under
    /// `request_id` and the sealing label `sealing` (the gateway relays the
    /// ciphertext as is; tests and the fuzz targets play a hostile gateway
    /// with it).
    pub fn stage_request(
        &self,
        request_id: u64,
        sealing: proto::receipt::Sealing,
    ) -> proto::frames::SealedRequest {
        proto::frames::SealedRequest {
            request_id,
            endpoint: self.endpoint.clone(),
            headers: self.sealing_headers(),
            body: self.body.clone(),
            client_nonce: Some(self.nonce.clone()),
            sealing,
            trace: None,
        }
    }

    /// A whole sealed success as the client takes it: the plaintext, when
    /// `body` opens with this request's key, carries a receipt trailer and
    /// the receipt passes every check ([`Self::check`]) and `status` is 200;
    /// otherwise why not. (A hostile host may offer any answer to anyone:
    /// this is what decides whether the client believes it.)
    pub fn accept(
        &self,
        attested: &Attested,
        status: u16,
        body: &[u8],
    ) -> Result<Vec<u8>, Refused> {
        let (plain, receipt) = self.open(body)?;
        let receipt = receipt
            .ok_or_else(|| Refused::new("receipt_verification_failed", "no receipt trailer"))?;
        if let Some(refused) = refusal(&self.check(attested, &receipt, &plain)) {
            return Err(refused);
        }
        if status != 200 {
            return Err(Refused::new(
                "upstream_status_mismatch",
                format!("a sealed success under HTTP {status}"),
            ));
        }
        Ok(plain)
    }

    /// What the receipt must name about this request.
    pub fn record(&self) -> RequestRecord<'_> {
        RequestRecord {
            endpoint: &self.endpoint,
            body: &self.request,
            nonce: &self.nonce,
            sealed_to: SealedTo {
                key_id: self.key_id,
                enc: self.client_key.material().enc(),
            },
        }
    }

    /// Opens a whole sealed success: the plaintext and its receipt trailer
    /// (`None` when the upstream sealed none).
    pub fn open(&self, body: &[u8]) -> Result<(Vec<u8>, Option<ReceiptTrailer>), Refused> {
        let (plain, trailer) =
            open_response_with_trailer(&self.client_key, body).map_err(unopenable)?;
        let receipt = trailer
            .map(|t| {
                ReceiptTrailer::decode(&t).map_err(|e| {
                    Refused::new(
                        "receipt_verification_failed",
                        format!(
                            "the sealed receipt trailer is malformed ({e}); the response was withheld"
                        ),
                    )
                })
            })
            .transpose()?;
        Ok((plain, receipt))
    }

    /// The whole verification report for `receipt` (see [`check_receipt`]).
    pub fn check(
        &self,
        attested: &Attested,
        receipt: &ReceiptTrailer,
        response: &[u8],
    ) -> VerifyReport {
        check_receipt(
            &attested.verified,
            attested.allow_mock,
            &self.record(),
            receipt,
            response,
        )
    }

    /// Opens a sealed body that came under HTTP error `status`. Only the
    /// stages hold the response key, so a body that opens is theirs; the
    /// status around it is the host's word. A stage error is an OpenAI error
    /// object without a receipt: anything else under an error status was
    /// relabelled on the way (fail closed).
    pub fn open_error(&self, status: u16, body: &[u8]) -> Result<Vec<u8>, Refused> {
        match open_response_with_trailer(&self.client_key, body) {
            Ok((_, Some(_))) => Err(Refused::new(
                "upstream_status_mismatch",
                format!(
                    "The upstream answered HTTP {status}, but the sealed body is a complete \
                     answer with its receipt: the status was altered on the way."
                ),
            )),
            Ok((plain, None)) if sse::is_error_object(&plain) => Ok(plain),
            Ok(_) => Err(Refused::new(
                "upstream_status_mismatch",
                format!(
                    "The upstream answered HTTP {status}, but the sealed body is not an error."
                ),
            )),
            Err(e) => Err(unopenable(e)),
        }
    }

    /// An opener for a streamed answer.
    pub fn stream(&self) -> StreamOpen {
        StreamOpen::new(&self.client_key)
    }
}

/// The refusal for a sealed response that does not open.
pub fn unopenable(e: proto::sealing::SealError) -> Refused {
    Refused::new(
        "response_unopenable",
        format!("the upstream's sealed response does not open: {e}"),
    )
}

/// The refusal for a success the upstream did not seal.
pub fn not_sealed() -> Refused {
    Refused::new(
        "response_not_sealed",
        "the upstream answered a sealed request with an unsealed response",
    )
}

#[cfg(test)]
mod tests;
