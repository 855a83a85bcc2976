//! The model kinds a stage serves, behind one trait: what the binary needs
//! from a loaded model ([`LoadedModel`]: its manifest and claims, and the
//! start of its compute thread) and what the connection handlers dispatch on
//! ([`StageModel`]). [`load`] is the one place that picks the kind, from the
//! manifest's architecture; each kind lives in a folder of its own
//! ([`crate::serving::embedding`], [`crate::serving::generation`]).

use crate::kernels::bf16_matmul::Kernel;
use crate::keys::StageKeys;
use crate::models::llama::WeightFormat;
use crate::role::StageSpec;
use crate::serving::embedding::batcher::BatchLimits;
use crate::serving::embedding::compute::Compute;
use crate::serving::embedding::engine::Engine;
use crate::serving::generation::compute::{GenLimits, Generator};
use crate::serving::generation::model::GenModel;
use crate::work::{Output, Work};
use anyhow::{Context, Result};
use proto::frames::StageClaims;
use proto::manifest::{LoadedManifest, ModelTask};
use proto::openai::ApiEndpoint;
use std::path::Path;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

/// The limits a compute thread runs under (from the command line).
#[derive(Clone, Debug)]
pub struct ComputeLimits {
    /// Most tokens in one micro-batch (embeddings, padded) or one step
    /// (generation).
    pub token_budget: usize,
    /// Embeddings: most rows in one micro-batch.
    pub max_rows: usize,
    /// Embeddings: activation memory budget of one micro-batch, in bytes.
    pub memory_budget: usize,
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

/// Loads the model in `model_dir` for this stage: a `llama` manifest is a
/// generation model, anything else an embedding model, each held as
/// `weights` (default: [`GENERATION_DEFAULT`], [`EMBEDDING_DEFAULT`]).
pub fn load(
    model_dir: &Path,
    spec: &StageSpec,
    weights: Option<WeightFormat>,
) -> Result<Box<dyn LoadedModel>> {
    let task = LoadedManifest::load(model_dir)?
        .manifest
        .serves()
        .map_err(anyhow::Error::msg)?;
    let pick = |served: &[WeightFormat], default: WeightFormat, kind: &str| {
        weights
            .unwrap_or(default)
            .served_by(served)
            .map_err(|e| anyhow::anyhow!("{kind} stage weights: {e}"))
    };
    Ok(if task == ModelTask::Completion {
        let w = pick(&WeightFormat::GENERATION, GENERATION_DEFAULT, "generation")?;
        Box::new(GenModel::load(model_dir, spec, w)?)
    } else {
        let w = pick(&WeightFormat::EMBEDDING, EMBEDDING_DEFAULT, "embedding")?;
        Box::new(Engine::load(model_dir, spec, w)?)
    })
}

/// How a generation stage holds its weights unless told: the GGUF's own
/// Q4_1 blocks (`benchmark_results/quality.md`, `peers.md`).
pub const GENERATION_DEFAULT: WeightFormat = WeightFormat::Q4_1;

/// How an embedding stage holds its weights unless told: bf16, measured
/// faster than f32 with AVX-512 BF16 and within cosine 0.9999 of it
/// (`benchmark_results/embeddings.md`).
pub const EMBEDDING_DEFAULT: WeightFormat = WeightFormat::Bf16;

/// Starts a stage's compute thread (model work runs off the async runtime).
fn spawn_compute(run: impl FnOnce() + Send + 'static) -> Result<()> {
    std::thread::Builder::new()
        .name("compute".into())
        .spawn(run)?;
    Ok(())
}

impl LoadedModel for Engine {
    fn manifest_and_claims(&mut self) -> (&LoadedManifest, &mut StageClaims) {
        (&self.manifest, &mut self.claims)
    }

    fn start(self: Box<Self>, setup: ComputeSetup) -> Result<StageModel> {
        let (weights, kernel) = self.weights();
        let kernel_name = kernel.map_or("candle-f32", Kernel::name);
        tracing::info!(%weights, kernel = kernel_name, "weights loaded");
        if kernel == Some(Kernel::Portable) {
            tracing::warn!("this CPU has no AVX-512 BF16: bf16 weights run no faster than f32 here (weights = \"f32\" is as fast and exact)");
        }
        let engine = Arc::new(*self);
        let limits = BatchLimits {
            token_budget: setup.limits.token_budget,
            max_rows: setup.limits.max_rows,
            memory_budget: setup.limits.memory_budget,
        };
        let shape = engine.shape();
        let compute = Compute::new(engine.clone(), setup.keys, setup.out, limits, shape);
        let work = setup.work;
        spawn_compute(move || compute.run(work))?;
        Ok(StageModel::Embedding(engine))
    }
}

impl LoadedModel for GenModel {
    fn manifest_and_claims(&mut self) -> (&LoadedManifest, &mut StageClaims) {
        (&self.manifest, &mut self.claims)
    }

    fn start(self: Box<Self>, setup: ComputeSetup) -> Result<StageModel> {
        let part = self.load_part().context("loading the weights")?;
        tracing::info!(
            weights = %part.format(),
            weight_mib = part.weight_bytes() >> 20,
            "weights loaded"
        );
        let l = setup.limits;
        tracing::info!(
            kv_cache_tokens = l.kv_cache_tokens,
            kv_cache_mib = (l.kv_cache_tokens * part.bytes_per_token()) >> 20,
            "KV-cache budget"
        );
        let model = Arc::new(*self);
        let limits = GenLimits {
            kv_tokens: l.kv_cache_tokens,
            step_tokens: l.token_budget,
            max_step_seqs: l.max_step_seqs,
            max_waiting: l.max_waiting,
        };
        let gen = Generator::new(model.clone(), part, setup.keys, setup.out, limits);
        let work = setup.work;
        spawn_compute(move || gen.run(work))?;
        Ok(StageModel::Generation(model))
    }
}

/// The model a stage serves, as the connection handlers dispatch on it.
#[derive(Clone)]
pub enum StageModel {
    /// An embedding model (`/v1/embeddings`).
    Embedding(Arc<Engine>),
    /// A generation model (`/v1/completions` and `/v1/chat/completions`).
    Generation(Arc<GenModel>),
}

impl StageModel {
    /// What the stage claims in its evidence.
    pub fn claims(&self) -> &StageClaims {
        match self {
            StageModel::Embedding(e) => &e.claims,
            StageModel::Generation(g) => &g.claims,
        }
    }

    /// Whether the model serves API path `endpoint`.
    pub fn serves(&self, endpoint: &str) -> bool {
        match (self, ApiEndpoint::from_path(endpoint)) {
            (StageModel::Embedding(_), Some(e)) => !e.is_generation(),
            (StageModel::Generation(_), Some(e)) => e.is_generation(),
            (_, None) => false,
        }
    }
}
