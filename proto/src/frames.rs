//! Pipeline messages carried inside the stage channel (CBOR).
//!
//! Three directions, three types, so that no endpoint can be handed a
//! message meant for another:
//! - [`HostMessage`]: gateway → a stage (configuration, requests to stage 0);
//! - [`ActivationMessage`]: stage *i* → stage *i+1* (activations, failures);
//! - [`ResultMessage`]: exit stage → gateway (outputs, failures).
//!
//! Every data message carries the request id(s) and micro-batch id it
//! belongs to, so a failure is always attributed to exactly the requests it
//! touched.

use crate::digest::Sha256Digest;
use crate::tensor::TensorFrame;
use serde::{Deserialize, Serialize};

/// What a stage claims about itself; carried as `user_data` in its
/// attestation document, so it is bound to the evidence.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageClaims {
    /// Position in the pipeline (0 = entry stage).
    pub stage_index: u32,
    /// Number of stages in the pipeline.
    pub num_stages: u32,
    /// First layer this stage runs.
    pub layer_start: u32,
    /// One past the last layer this stage runs.
    pub layer_end: u32,
    /// Model id from the manifest.
    pub model_id: String,
    /// Digest of the model manifest the stage loaded.
    pub manifest_sha256: Sha256Digest,
}

impl StageClaims {
    /// Whether this stage is the last one.
    pub fn is_exit(&self) -> bool {
        self.stage_index + 1 == self.num_stages
    }
}

/// A request-scoped error as it travels the pipeline.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineError {
    /// Class of failure.
    pub kind: ErrorKind,
    /// Human-readable reason (never contains request content).
    pub message: String,
}

/// Class of a pipeline failure; decides the HTTP status the gateway returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// The request's input is unusable (400).
    BadInput,
    /// The stage failed on this request (500).
    Internal,
    /// The stage is out of capacity (503).
    Overloaded,
}

/// Gateway → stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum HostMessage {
    /// Sets where this stage sends its output: `Some(endpoint)` for the next
    /// stage (which it dials and attests), `None` when this stage is the exit
    /// stage and answers on this very channel.
    Configure {
        /// Next stage's endpoint, as `tcp://host:port`.
        next: Option<String>,
    },
    /// An embedding request for the entry stage.
    Embed(EmbedRequest),
}

/// An embeddings request as stage 0 receives it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmbedRequest {
    /// Gateway-assigned request id.
    pub request_id: u64,
    /// The texts to embed.
    pub inputs: Vec<String>,
}

/// Stage → gateway on the host channel, in answer to `Configure`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ConfigureOutcome {
    /// Downstream is connected and attested (or this is the exit stage).
    Configured,
    /// Configuration failed; the reason names the peer and check.
    Failed(String),
}

/// One sequence's place in a micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchItem {
    /// Request it belongs to.
    pub request_id: u64,
    /// Index of the input within the request.
    pub index: u32,
    /// Real (unpadded) token count.
    pub tokens: u32,
}

/// Activations of a micro-batch between two stages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActivationBatch {
    /// Micro-batch id, unique per sending stage.
    pub micro_batch_id: u64,
    /// Sequences, in row order.
    pub items: Vec<BatchItem>,
    /// Hidden states `[batch, seq, hidden]`, f32.
    pub hidden: TensorFrame,
    /// Attention mask `[batch, seq]`, u32 0/1.
    pub mask: TensorFrame,
}

/// Stage → next stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ActivationMessage {
    /// A micro-batch to continue.
    Batch(ActivationBatch),
    /// A request failed upstream; pass it on.
    Failed {
        /// The request.
        request_id: u64,
        /// Why.
        error: PipelineError,
    },
}

/// Exit stage → gateway.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ResultMessage {
    /// Finished embeddings of (part of) one request.
    Embeddings {
        /// The request.
        request_id: u64,
        /// Micro-batch they came from.
        micro_batch_id: u64,
        /// Which inputs, in row order of `vectors`.
        items: Vec<BatchItem>,
        /// `[items, dim]`, f32, L2-normalised.
        vectors: TensorFrame,
    },
    /// A request failed somewhere in the pipeline.
    Failed {
        /// The request.
        request_id: u64,
        /// Why.
        error: PipelineError,
    },
}
