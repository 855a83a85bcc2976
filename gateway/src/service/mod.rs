//! The inference service between the HTTP API and the pipelines: it picks
//! the model's replicas, relays a request the client sealed to the enclave
//! as ciphertext, seals a plain or gateway-key request to an entry stage
//! itself (failing over between replicas) and opens its answer, and keeps
//! every receipt. The HTTP layer only turns HTTP into a [`ModelRequest`] and
//! a [`ModelAnswer`] back into HTTP.
//!
//! - [`relay`]: requests sealed to an entry stage's key;
//! - [`on_behalf`]: requests the gateway seals for the client (plain
//!   clients, and clients that sealed to the gateway's own key);
//! - [`gateway_key`]: the gateway's own rotating HPKE key;
//! - [`stream`]: streamed answers, relayed, opened or sealed again.

mod gateway_key;
mod on_behalf;
mod relay;
mod stream;

pub use gateway_key::{GatewayKey, GATEWAY_HPKE_KEY_IDS};

use crate::metrics::Metrics;
use crate::openai_error::ApiError;
use crate::pipeline::{Failure, Replicas};
use crate::receipt_store::{ReceiptStore, Stored};
use crate::timeouts::RouteTimeouts;
use bytes::Bytes;
use proto::openai::ApiEndpoint;
use proto::receipt::{ReceiptTrailer, Sealing};
use proto::sealing::SealedHeaders;
use std::sync::Arc;
use std::time::Duration;

/// Whose a request's receipt is: the name of the API key that made it
/// (`[auth]` on), or nobody's (`None`, `[auth]` off).
pub type Owner = Option<Arc<str>>;

/// The service: the models' replicas and what the gateway keeps.
pub struct Service {
    /// The embeddings pipeline's replicas.
    pub embeddings: Arc<Replicas>,
    /// The completions pipeline's replicas, when configured.
    pub completions: Option<Arc<Replicas>>,
    /// The gateway's own HPKE key (published as gateway-held).
    pub gateway_key: Arc<GatewayKey>,
    /// Recent receipts.
    pub receipts: Arc<ReceiptStore>,
    /// Where kept receipts' digests are logged (`[transparency]
    /// log_receipts`).
    pub receipt_log: Option<crate::transparency::receipts::ReceiptLogger>,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// Every route's deadline; a request's deadline in the pipeline, and a
    /// stream's idle limit, come from here.
    pub routes: Arc<RouteTimeouts>,
    /// The embeddings deadline, named in timeout errors.
    pub timeout: Duration,
}

/// One model request, as the HTTP layer read it.
pub struct ModelRequest {
    /// The API endpoint.
    pub endpoint: ApiEndpoint,
    /// The client's `hpke-*` headers, when it sealed the body (to an entry
    /// stage's key or to the gateway's); `None` for a plain request.
    pub sealing: Option<SealedHeaders>,
    /// The body as received (ciphertext when sealed).
    pub body: Bytes,
    /// The client's receipt nonce.
    pub nonce: Option<Vec<u8>>,
    /// Whose the receipt is.
    pub owner: Owner,
}

/// What goes back to the client.
pub enum ModelAnswer {
    /// A whole answer or error.
    Whole(WholeAnswer),
    /// A streamed answer.
    Stream(StreamAnswer),
}

/// A whole answer or error; its receipt, if any, is already kept.
pub struct WholeAnswer {
    /// The HTTP status.
    pub status: u16,
    /// JSON for a plain client; for a sealed one, sealed to it.
    pub body: Vec<u8>,
    /// Whether `body` is sealed.
    pub sealed: bool,
    /// The receipt's id, and the receipt with the salt of its digests when
    /// the gateway knows it (never for a request sealed to the enclave).
    pub receipt: Option<([u8; 16], ReceiptTrailer)>,
    /// `Retry-After` seconds, for a refusal that may pass.
    pub retry_after: Option<u32>,
}

/// A streamed answer: server-sent events for a plain client, sealed chunks
/// otherwise. The receipt is kept when the stream ends.
pub struct StreamAnswer {
    /// The receipt's id.
    pub receipt_id: [u8; 16],
    /// Whether the chunks are sealed.
    pub sealed: bool,
    /// The chunks, as they come; closed at the end.
    pub chunks: tokio::sync::mpsc::Receiver<Bytes>,
}

impl Service {
    /// Every model's replicas, embeddings first.
    pub fn pipelines(&self) -> Vec<&Arc<Replicas>> {
        std::iter::once(&self.embeddings)
            .chain(self.completions.as_ref())
            .collect()
    }

    /// The replicas serving a model id.
    pub fn by_model(&self, model: &str) -> Option<&Arc<Replicas>> {
        self.pipelines().into_iter().find(|p| p.model_id() == model)
    }

    /// The replicas that serve `endpoint`, and the endpoint as the
    /// pipeline names it; a 404 when no pipeline does (`[completions]`
    /// not configured).
    pub fn replicas_for(
        &self,
        endpoint: ApiEndpoint,
    ) -> Result<(&Arc<Replicas>, ApiEndpoint), ApiError> {
        if endpoint == ApiEndpoint::Embeddings {
            return Ok((&self.embeddings, self.embeddings.primary().endpoint));
        }
        match &self.completions {
            Some(r) => Ok((r, endpoint)),
            None => Err(ApiError {
                code: Some("unknown_url"),
                ..ApiError::from_stage(
                    404,
                    format!(
                        "This gateway serves no completions model ([completions] is not \
                         configured), so {} is not available.",
                        endpoint.path()
                    ),
                )
            }),
        }
    }

    /// Runs one model request on `replicas` (from [`Self::replicas_for`])
    /// and returns its answer. A client-sealed request is relayed as
    /// ciphertext to the replica whose entry stage holds its key; any other
    /// is sealed by the gateway to the least-loaded ready replica.
    pub async fn answer(
        &self,
        replicas: &Arc<Replicas>,
        req: ModelRequest,
    ) -> Result<ModelAnswer, ApiError> {
        match req.sealing {
            Some(sealed) if GatewayKey::owns(sealed.key_id) => {
                self.metrics.sealing(Sealing::Gateway);
                self.via_gateway_key(
                    replicas,
                    req.endpoint,
                    &req.owner,
                    &sealed,
                    &req.body,
                    req.nonce,
                )
                .await
            }
            Some(sealed) => {
                self.relay(
                    replicas,
                    req.endpoint,
                    &req.owner,
                    sealed,
                    req.body,
                    req.nonce,
                )
                .await
            }
            None => {
                self.metrics.sealing(Sealing::Plain);
                self.for_plain_client(replicas, req.endpoint, &req.owner, &req.body, req.nonce)
                    .await
            }
        }
    }

    /// The error for a request the pipeline did not answer.
    fn failure_error(&self, f: Failure) -> ApiError {
        match f {
            Failure::NotReady(r) | Failure::NotSent(r) => ApiError::not_ready(&r),
            Failure::Timeout => ApiError::timeout(self.timeout.as_secs()),
        }
    }

    /// A request's deadline in the pipeline.
    fn deadline(&self, endpoint: ApiEndpoint) -> Duration {
        self.routes.for_route(endpoint.path())
    }

    /// Keeps a whole answer's receipt, if it has one, for `GET
    /// /v1/receipts/{id}` with its owner, before the answer leaves, so that
    /// any gateway sharing the store answers for it at once. (A copy: the
    /// answer's headers carry the receipt too.)
    async fn keep(&self, owner: &Owner, w: &WholeAnswer) {
        if let Some((id, trailer)) = &w.receipt {
            keep_receipt(
                &self.receipts,
                self.receipt_log.as_ref(),
                &self.metrics,
                *id,
                trailer.clone(),
                owner,
            )
            .await;
        }
    }
}

/// Stores a receipt and counts it. A store that fails does not fail the
/// request: the client has the receipt in the answer.
async fn keep_receipt(
    receipts: &ReceiptStore,
    log: Option<&crate::transparency::receipts::ReceiptLogger>,
    metrics: &Metrics,
    id: [u8; 16],
    trailer: ReceiptTrailer,
    owner: &Owner,
) {
    if let Some(log) = log {
        log.log(&trailer.receipt);
    }
    let stored = Stored {
        trailer,
        owner: owner.as_deref().map(str::to_string),
    };
    if let Err(e) = receipts.insert(id, stored).await {
        tracing::warn!(error = %format!("{e:#}"), "a receipt was not stored");
        metrics.receipt_not_stored();
    }
    metrics.receipt_issued();
}

/// The error for a reply that does not fit the request.
fn out_of_order() -> ApiError {
    ApiError::internal("the exit stage answered out of order")
}
