//! What a model kind gives the rest of the stage, behind two traits: a
//! loaded model before it serves ([`LoadedModel`]: its manifest and
//! claims, and the start of its compute thread) and a serving model as the
//! connection handlers see it ([`ServedModel`]: which endpoints it answers,
//! and the admission of an opened request). The connection handlers know
//! only these; each model kind implements them in its own folder under
//! `serving/`, whose `load` picks the kind from the manifest. (This module
//! names neither, so the dependencies point one way: both use it.)

use crate::keys::StageKeys;
use crate::work::{Output, Work};
use anyhow::Result;
use proto::frames::{Envelope, StageClaims};
use proto::manifest::LoadedManifest;
use proto::openai::{ApiEndpoint, ApiError};
use std::future::Future;
use std::pin::Pin;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

/// The limits a stage serves under (from the command line).
#[derive(Clone, Debug)]
pub struct ComputeLimits {
    /// Most tokens in one micro-batch (embeddings, padded) or one step
    /// (generation).
    pub token_budget: usize,
    /// Embeddings: most rows in one micro-batch.
    pub max_rows: usize,
    /// Embeddings: activation memory budget of one micro-batch, in bytes.
    pub memory_budget: usize,
    /// Embeddings: most inputs in one request.
    pub max_inputs: usize,
    /// Generation: tokens of KV cache this stage may hold.
    pub kv_cache_tokens: usize,
    /// Generation: most sequences in one step.
    pub max_step_seqs: usize,
    /// Generation: most requests waiting for admission (entry stage).
    pub max_waiting: usize,
}

/// What a compute thread is started with.
pub struct ComputeSetup {
    /// The stage's keys (receipt signing, HPKE).
    pub keys: Arc<StageKeys>,
    /// Where its outputs go.
    pub out: tokio::sync::mpsc::Sender<Output>,
    /// Its work, in arrival order.
    pub work: Receiver<Work>,
    /// Its limits.
    pub limits: ComputeLimits,
}

/// A model loaded by a stage, before it serves.
pub trait LoadedModel: Send {
    /// The manifest its files were checked against, and what the stage
    /// claims in its evidence (the binary fills in the keys).
    fn manifest_and_claims(&mut self) -> (&LoadedManifest, &mut StageClaims);
    /// Starts the compute thread; returns the model as the connection
    /// handlers see it.
    fn start(self: Box<Self>, setup: ComputeSetup) -> Result<StageModel>;
}

/// The model a stage serves, as the connection handlers see it.
pub type StageModel = Arc<dyn ServedModel>;

/// A request the entry stage opened (key id, HPKE and freshness checked)
/// and has not yet remembered in its replay guard.
pub struct OpenedRequest<'a> {
    /// The host's id for it (only ever used to route its work and answer).
    pub request_id: u64,
    /// The API it was sealed for (checked with [`ServedModel::serves`]).
    pub endpoint: ApiEndpoint,
    /// The client's JSON body.
    pub plaintext: &'a [u8],
}

/// A future a [`ServedModel`] returns.
pub type Pending<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A request the model accepted. The stage then records it in its replay
/// guard, builds its envelope, and hands [`Admission::work`]'s items to the
/// compute thread in order.
pub struct Admission {
    /// The compute thread's work for the request, given its envelope.
    pub work: Box<dyn FnOnce(Envelope) -> Vec<Work> + Send>,
    /// Gives back what admission reserved (queue room), for a request whose
    /// work never reaches the compute thread.
    pub release: Option<Box<dyn FnOnce() + Send>>,
}

impl Admission {
    /// Gives back what admission reserved.
    pub fn release(self) {
        if let Some(r) = self.release {
            r()
        }
    }
}

/// Why a model refused a request: the OpenAI error sealed to the client,
/// and (a full queue: 503) when to retry.
#[derive(Debug)]
pub struct Refusal {
    /// The error the client reads.
    pub api: ApiError,
    /// `Retry-After`, in seconds.
    pub retry_after_secs: Option<u32>,
}

impl From<ApiError> for Refusal {
    fn from(api: ApiError) -> Self {
        Self {
            api,
            retry_after_secs: None,
        }
    }
}

/// A model kind as the connection handlers see it once it serves.
pub trait ServedModel: Send + Sync {
    /// What the stage claims in its evidence.
    fn claims(&self) -> &StageClaims;
    /// Whether the model answers `endpoint`.
    fn serves(&self, endpoint: ApiEndpoint) -> bool;
    /// Whether the exit stage sends its output back to the entry stage
    /// (generation: each sampled token is the next step's input).
    fn has_feedback(&self) -> bool;
    /// Validates and tokenizes an opened request (entry stage) for an
    /// endpoint [`ServedModel::serves`] accepted (the caller checks):
    /// its work for the compute thread, or the error the client is sent.
    fn admit<'a>(&'a self, request: OpenedRequest<'a>) -> Pending<'a, Result<Admission, Refusal>>;
}

/// Starts a stage's compute thread (model work runs off the async runtime).
pub fn spawn_compute(run: impl FnOnce() + Send + 'static) -> Result<()> {
    std::thread::Builder::new()
        .name("compute".into())
        .spawn(run)?;
    Ok(())
}
