//! Requests the client sealed to an entry stage's key: relayed as
//! ciphertext to the replica whose entry stage holds that key, and the
//! sealed answer passed back as it came. The gateway sees no plaintext.

use super::stream::StreamMode;
use super::{out_of_order, ModelAnswer, Owner, Service, WholeAnswer};
use crate::openai_error::ApiError;
use crate::pipeline::{Replicas, Reply};
use bytes::Bytes;
use proto::openai::ApiEndpoint;
use proto::receipt::{ReceiptTrailer, Sealing};
use proto::sealing::SealedHeaders;
use std::sync::Arc;

impl Service {
    /// Relays an enclave-sealed request and its answer.
    pub(super) async fn relay(
        &self,
        replicas: &Arc<Replicas>,
        endpoint: ApiEndpoint,
        owner: &Owner,
        sealed: SealedHeaders,
        body: Bytes,
        nonce: Option<Vec<u8>>,
    ) -> Result<ModelAnswer, ApiError> {
        // The key names the replica whose entry stage holds it: only that
        // one can open the request.
        let Some(pipeline) = replicas.holding(sealed.key_id, sealed.aead) else {
            return Err(ApiError::unknown_key(sealed.key_id));
        };
        // Counted once it is known to be for an entry stage's key.
        self.metrics.sealing(Sealing::Enclave);
        let (reply, sub) = pipeline
            .submit(
                endpoint.path(),
                sealed,
                body.to_vec(),
                nonce,
                Sealing::Enclave,
                self.deadline(endpoint),
            )
            .await
            .map_err(|f| self.failure_error(f))?;
        Ok(match reply {
            Reply::StreamStart { receipt_id } => {
                ModelAnswer::Stream(self.stream(owner, sub, receipt_id, StreamMode::Relay))
            }
            Reply::Response(w) => {
                // Sealed to the enclave: the salt is in the sealed trailer,
                // for the client only.
                let kept = ReceiptTrailer {
                    receipt: w.receipt,
                    digest_salt: None,
                };
                let answer = WholeAnswer {
                    status: w.status,
                    body: w.body,
                    sealed: true,
                    receipt: Some((w.receipt_id, kept)),
                    retry_after: None,
                };
                self.keep(owner, &answer).await;
                ModelAnswer::Whole(answer)
            }
            Reply::Failed(mut e) => {
                let retry_after = e.retry_after_secs;
                match e.sealed_body.take() {
                    Some(body) => ModelAnswer::Whole(WholeAnswer {
                        status: e.status,
                        body,
                        sealed: true,
                        receipt: None,
                        retry_after,
                    }),
                    None => {
                        let api = ApiError::from_pipeline(e);
                        ModelAnswer::Whole(WholeAnswer {
                            status: api.status.as_u16(),
                            body: api.body_bytes(),
                            sealed: false,
                            receipt: None,
                            retry_after,
                        })
                    }
                }
            }
            _ => return Err(out_of_order()),
        })
    }
}
