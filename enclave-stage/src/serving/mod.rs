//! How a stage serves its model kind across the pipeline: sentence
//! embeddings ([`embedding`]: micro-batching, the compute thread, receipt
//! bookkeeping) and text generation ([`generation`]: continuous batching,
//! chat templates, grammars, output rules, the compute thread). Each kind
//! implements `crate::model`'s traits in its `service` module; [`load`] is
//! the one place that picks the kind.

pub mod embedding;
pub mod generation;

use crate::model::LoadedModel;
use crate::models::llama::WeightFormat;
use crate::role::StageSpec;
use anyhow::Result;
use proto::manifest::{LoadedManifest, ModelTask};
use std::path::Path;

/// Loads the model in `model_dir` for this stage: a completion manifest is
/// a generation model, anything else an embedding model, each held as
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
        Box::new(generation::model::GenModel::load(model_dir, spec, w)?)
    } else {
        let w = pick(&WeightFormat::EMBEDDING, EMBEDDING_DEFAULT, "embedding")?;
        Box::new(embedding::engine::Engine::load(model_dir, spec, w)?)
    })
}

/// How a generation stage holds its weights unless told: the GGUF's own
/// Q4_1 blocks (`benchmark_results/quality.md`, `peers.md`).
pub const GENERATION_DEFAULT: WeightFormat = WeightFormat::Q4_1;

/// How an embedding stage holds its weights unless told: bf16, measured
/// faster than f32 with AVX-512 BF16 and within cosine 0.9999 of it
/// (`benchmark_results/embeddings.md`).
pub const EMBEDDING_DEFAULT: WeightFormat = WeightFormat::Bf16;
