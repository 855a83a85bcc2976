//! `gateway serve --model FILE.gguf`: a user's GGUF served as the generation
//! pipeline (chat and completions), as `llama-server -m` does. Its manifest
//! pins the file's SHA-256 (the file itself linked, not copied); the stages
//! then load and check the file as any model: an architecture or tensor type
//! they do not serve stops the start with their error naming it.

use super::{model_id, write_model_folder};
use crate::config::{CompletionsConfig, GatewayConfig, StageConfig};
use crate::plan;
use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use proto::digest::Sha256Digest;
use proto::manifest::{ManifestFile, ModelManifest};
use std::path::{Path, PathBuf};

/// What the gateway reads of a GGUF: enough to name it, pin it and split it.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufModel {
    /// The file, absolute.
    pub path: PathBuf,
    /// The id clients use: the file's `general.name` (or its stem), with
    /// every character outside `[A-Za-z0-9._-]` made `-`.
    pub model_id: String,
    /// `general.architecture`.
    pub architecture: String,
    /// `{arch}.block_count`.
    pub layers: u32,
    /// `{arch}.context_length`.
    pub context_length: usize,
    /// SHA-256 of the whole file.
    pub sha256: Sha256Digest,
}

/// The header (metadata and tensor table) of the GGUF file at `path`.
pub fn read_header(path: &Path) -> Result<gguf_file::Content> {
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    gguf_file::Content::read(&mut f)
        .map_err(|e| anyhow::anyhow!("{} is not a GGUF file: {e}", path.display()))
}

fn metadata<'a>(ct: &'a gguf_file::Content, key: &str) -> Result<&'a gguf_file::Value> {
    ct.metadata
        .get(key)
        .with_context(|| format!("the GGUF's metadata has no {key}"))
}

impl GgufModel {
    /// Reads the GGUF's header and hashes the file.
    pub fn inspect(path: &Path) -> Result<Self> {
        let path =
            std::fs::canonicalize(path).with_context(|| format!("--model {}", path.display()))?;
        let ct = read_header(&path)?;
        let architecture = metadata(&ct, "general.architecture")?.to_string()?.clone();
        let u = |k: &str| -> Result<u32> {
            Ok(metadata(&ct, &format!("{architecture}.{k}"))?.to_u32()?)
        };
        let layers = u("block_count")?;
        if layers == 0 {
            bail!("{} has no layers", path.display());
        }
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let named = match ct.metadata.get("general.name") {
            Some(v) => model_id(v.to_string()?),
            None => String::new(),
        };
        let model_id = if named.is_empty() {
            model_id(&stem)
        } else {
            named
        };
        if model_id.is_empty() {
            bail!("{}: no usable model name", path.display());
        }
        let context_length = u("context_length")? as usize;
        Ok(Self {
            model_id,
            architecture,
            layers,
            context_length,
            sha256: Sha256Digest::of_file(&path)
                .with_context(|| format!("hashing {}", path.display()))?,
            path,
        })
    }

    /// The manifest that pins this file (the stages check it against it).
    pub fn manifest(&self) -> ModelManifest {
        // The link's name, not the file's: a file kept under its digest (a
        // Hugging Face or Ollama cache blob) has no `.gguf` to name it by.
        let file = "model.gguf".to_string();
        let source = self
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        ModelManifest {
            schema: 1,
            model_id: self.model_id.clone(),
            architecture: self.architecture.clone(),
            task: "completion".into(),
            source: format!("file:{}", model_id(&source)),
            max_seq_len: self.context_length,
            files: vec![ManifestFile {
                path: file,
                sha256: self.sha256.hex(),
            }],
        }
    }
}

/// The layers of each stage as [`crate::plan`] splits the model for
/// `stage_memory`, at the KV budget and weight format of `completions` (the
/// config's own table; defaults without one).
pub fn planned_layers(
    model: &GgufModel,
    stage_memory: &str,
    completions: Option<&CompletionsConfig>,
) -> Result<Vec<[u32; 2]>> {
    let ct = read_header(&model.path)?;
    let defaults = CompletionsConfig::new(PathBuf::new(), PathBuf::new(), Vec::new());
    let c = completions.unwrap_or(&defaults);
    let costs = plan::ModelCosts::of(&ct, c.weights)?;
    let stages = costs.plan(
        plan::parse_bytes(stage_memory)?,
        c.kv_cache_tokens as u64,
        plan::DEFAULT_OVERHEAD,
    )?;
    Ok(stages.into_iter().map(|s| s.layers).collect())
}

/// Writes the model folder (manifest and a link to the file) and the
/// development policy under `root`, and returns the `[completions]` table
/// that serves the model on `layers`; settings the config's own
/// `[completions]` has (KV budget, weights, threads) are kept.
pub fn completions(
    cfg: &GatewayConfig,
    model: &GgufModel,
    layers: &[[u32; 2]],
    root: &Path,
) -> Result<CompletionsConfig> {
    let manifest = model.manifest();
    let links = [(manifest.files[0].path.clone(), model.path.clone())];
    let digest12 = &model.sha256.hex()[..12];
    let written = write_model_folder(cfg, "--model", &manifest, &links, digest12, layers, root)?;
    let stages: Vec<StageConfig> = layers.iter().map(|l| StageConfig::local(*l)).collect();
    let mut c = match &cfg.completions {
        Some(c) => c.clone(),
        None => CompletionsConfig::new(PathBuf::new(), PathBuf::new(), Vec::new()),
    };
    c.policy = written.policy;
    c.model_dir = written.dir;
    c.stages = stages;
    Ok(c)
}
