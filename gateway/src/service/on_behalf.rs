//! Requests the gateway seals to an entry stage for the client: plain
//! OpenAI requests, and requests sealed to the gateway's own key (opened
//! here, answered sealed back to the client). The gateway sees their
//! plaintext, and their receipts say so (`sealing = plain | gateway`).

use super::stream::StreamMode;
use super::{out_of_order, ModelAnswer, Owner, Service, WholeAnswer};
use crate::openai_error::ApiError;
use crate::pipeline::{Failure, Replicas, Reply, Submission};
use proto::openai::ApiEndpoint;
use proto::receipt::{ReceiptTrailer, Sealing};
use proto::sealing::{
    open_response, open_response_with_trailer, seal_request_as, seal_response,
    seal_response_with_trailer, Aead, ClientResponseKey, ResponseSealer, SealedHeaders, Sealer,
};
use std::sync::Arc;

/// What came back for a request the gateway sealed itself.
enum Opened {
    /// A whole (opened) response or error.
    Whole(WholeAnswer),
    /// A stream: its rest comes through `sub`, sealed to `client_key`.
    Stream {
        receipt_id: [u8; 16],
        sub: Submission,
        client_key: ClientResponseKey,
    },
}

impl Service {
    /// A plain OpenAI client: the gateway seals to the entry stage itself
    /// and answers in plain JSON (or server-sent events).
    pub(super) async fn for_plain_client(
        &self,
        replicas: &Arc<Replicas>,
        endpoint: ApiEndpoint,
        owner: &Owner,
        plaintext: &[u8],
        nonce: Option<Vec<u8>>,
    ) -> Result<ModelAnswer, ApiError> {
        Ok(
            match self
                .seal_to_entry(replicas, endpoint, plaintext, nonce, Sealing::Plain)
                .await?
            {
                Opened::Whole(w) => {
                    self.keep(owner, &w).await;
                    ModelAnswer::Whole(w)
                }
                Opened::Stream {
                    receipt_id,
                    sub,
                    client_key,
                } => ModelAnswer::Stream(self.stream(
                    owner,
                    sub,
                    receipt_id,
                    StreamMode::Open(client_key),
                )),
            },
        )
    }

    /// Opens a request sealed to the gateway's own key, runs it as a plain
    /// request (sealed on to the entry stage), and seals the answer back to
    /// the client.
    pub(super) async fn via_gateway_key(
        &self,
        replicas: &Arc<Replicas>,
        endpoint: ApiEndpoint,
        owner: &Owner,
        sealed: &SealedHeaders,
        bytes: &[u8],
        nonce: Option<Vec<u8>>,
    ) -> Result<ModelAnswer, ApiError> {
        let (plaintext, material) = self.gateway_key.open(sealed, bytes)?;
        match self
            .seal_to_entry(replicas, endpoint, &plaintext, nonce, Sealing::Gateway)
            .await?
        {
            Opened::Whole(mut w) => {
                // A receipt rides along as the sealed body's trailer.
                w.body = match &w.receipt {
                    Some((_, t)) => seal_response_with_trailer(&material, &w.body, &t.encode()),
                    None => seal_response(&material, &w.body),
                }
                .map_err(|e| ApiError::internal(format!("sealing the response failed: {e}")))?;
                w.sealed = true;
                self.keep(owner, &w).await;
                Ok(ModelAnswer::Whole(w))
            }
            Opened::Stream {
                receipt_id,
                sub,
                client_key,
            } => {
                let sealer = ResponseSealer::new(&material)
                    .map_err(|e| ApiError::internal(format!("sealing the response failed: {e}")))?;
                Ok(ModelAnswer::Stream(self.stream(
                    owner,
                    sub,
                    receipt_id,
                    StreamMode::Reseal(client_key, sealer),
                )))
            }
        }
    }

    /// Seals `plaintext` to the entry stage of the least-loaded ready
    /// replica, waits, and opens the answer (or hands back the stream to
    /// open as it comes). A replica the request could not be sent to (its
    /// pipeline broke a moment ago) is passed over for the next; once a
    /// replica has the request, its failure is the answer.
    async fn seal_to_entry(
        &self,
        replicas: &Arc<Replicas>,
        endpoint: ApiEndpoint,
        plaintext: &[u8],
        nonce: Option<Vec<u8>>,
        sealing: Sealing,
    ) -> Result<Opened, ApiError> {
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
            let (sealed, body, client_key) = seal_request_as(key, aead, plaintext, Sealer::Host)
                .map_err(|e| ApiError::internal(format!("sealing failed: {e}")))?;
            match pipeline
                .submit(
                    endpoint.path(),
                    sealed,
                    body,
                    nonce.clone(),
                    sealing,
                    self.deadline(endpoint),
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
                Err(f) => return Err(self.failure_error(f)),
            }
        }
        let Some((reply, sub, client_key)) = sent else {
            let f = not_sent.unwrap_or_else(|| Failure::NotReady(replicas.not_ready_reason()));
            return Err(self.failure_error(f));
        };
        let unopened = |e: proto::sealing::SealError| {
            ApiError::internal(format!("the stage's response does not open: {e}"))
        };
        Ok(match reply {
            Reply::Response(w) => {
                let (body, trailer) =
                    open_response_with_trailer(&client_key, &w.body).map_err(unopened)?;
                // The stage's trailer holds the receipt and the salt of its digests.
                let digest_salt = trailer
                    .and_then(|t| ReceiptTrailer::decode(&t).ok())
                    .and_then(|t| t.digest_salt);
                let receipt = ReceiptTrailer {
                    receipt: w.receipt,
                    digest_salt,
                };
                Opened::Whole(WholeAnswer {
                    status: w.status,
                    body,
                    sealed: false,
                    receipt: Some((w.receipt_id, receipt)),
                    retry_after: None,
                })
            }
            Reply::Failed(mut e) => {
                let retry_after = e.retry_after_secs;
                let (status, body) = match e.sealed_body.take() {
                    Some(body) => (
                        e.status,
                        open_response(&client_key, &body).map_err(unopened)?,
                    ),
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
                Opened::Whole(WholeAnswer {
                    status,
                    body,
                    sealed: false,
                    receipt: None,
                    retry_after,
                })
            }
            Reply::StreamStart { receipt_id } => Opened::Stream {
                receipt_id,
                sub,
                client_key,
            },
            _ => return Err(out_of_order()),
        })
    }
}
