//! `gateway serve --model FILE.gguf`: a user's GGUF served as the generation
//! pipeline (chat and completions) without writing a config, as
//! `llama-server -m` does. From the file's own metadata this writes what a
//! configured model has: a model folder with a `manifest.json` that pins the
//! file's SHA-256 (the file itself linked, not copied), and a development
//! policy that pins that manifest, for locally launched stages under mock
//! attestation. The stages then load and check the file as any model: an
//! architecture or tensor type they do not serve stops the start with their
//! error naming it.
//!
//! Everything is written under `data/models/<model id>-<digest prefix>/`
//! (relative to the working directory, like the receipt store), so the same
//! file gives the same folder, manifest and policy digests on every start.

use crate::config::{CompletionsConfig, GatewayConfig, Launch, StageConfig};
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

/// `name` with every character outside `[A-Za-z0-9._-]` made `-`, runs of
/// them made one, and no `-` at either end.
fn model_id(name: &str) -> String {
    let mut id = String::new();
    for c in name.chars() {
        let c = if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
            c
        } else {
            '-'
        };
        if !(c == '-' && id.ends_with('-')) {
            id.push(c);
        }
    }
    id.trim_matches('-').to_string()
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

/// `layers` split into `stages` contiguous ranges, as even as can be (the
/// first ranges one layer longer where they do not divide).
pub fn split_layers(layers: u32, stages: usize) -> Result<Vec<[u32; 2]>> {
    if stages == 0 || stages > layers as usize {
        bail!("--stages {stages}: the model has {layers} layers (1 to {layers} stages)");
    }
    let (per, extra) = (layers / stages as u32, layers % stages as u32);
    let mut start = 0;
    Ok((0..stages as u32)
        .map(|i| {
            let end = start + per + u32::from(i < extra);
            let r = [start, end];
            start = end;
            r
        })
        .collect())
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
    if cfg.pipeline.launch != Launch::Local {
        bail!("--model serves a file with locally launched stages (pipeline.launch = \"local\")");
    }
    let dir = root.join(format!("{}-{}", model.model_id, &model.sha256.hex()[..12]));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let manifest = model.manifest();
    let link = dir.join(&manifest.files[0].path);
    match std::fs::read_link(&link) {
        Ok(to) if to == model.path => {}
        _ => {
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&model.path, &link)
                .with_context(|| format!("linking {}", link.display()))?;
        }
    }
    let manifest_bytes = serde_json::to_vec_pretty(&manifest)?;
    write_if_changed(&dir.join("manifest.json"), &manifest_bytes)?;
    let mut policy = format!(
        "# Written by `gateway serve --model` for {}: development only.\n\
         # MOCK evidence is accepted: the stages run as plain processes.\n\
         allow_mock = true\ntrust_local_build = true\n\
         # Pins manifest.json, which pins the file's SHA-256.\n\
         manifest_sha256 = \"{}\"\n",
        model.model_id,
        Sha256Digest::of(&manifest_bytes).hex()
    );
    for (i, l) in layers.iter().enumerate() {
        policy += &format!(
            "\n[[stages]]\nindex = {i}\nlayers = [{}, {}]\nmeasurements = []\n",
            l[0], l[1]
        );
    }
    let policy_path = dir.join("policy.toml");
    write_if_changed(&policy_path, policy.as_bytes())?;
    let stages: Vec<StageConfig> = layers.iter().map(|l| StageConfig::local(*l)).collect();
    let mut c = match &cfg.completions {
        Some(c) => c.clone(),
        None => CompletionsConfig::new(policy_path.clone(), dir.clone(), stages.clone()),
    };
    c.policy = policy_path;
    c.model_dir = dir;
    c.stages = stages;
    Ok(c)
}

/// Writes `bytes` to `path` unless it holds them already (a new file goes in
/// whole: written beside and renamed).
fn write_if_changed(path: &Path, bytes: &[u8]) -> Result<()> {
    if std::fs::read(path).is_ok_and(|b| b == bytes) {
        return Ok(());
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_split_evenly_first_ranges_longer() {
        assert_eq!(split_layers(30, 2).unwrap(), vec![[0, 15], [15, 30]]);
        assert_eq!(
            split_layers(16, 3).unwrap(),
            vec![[0, 6], [6, 11], [11, 16]]
        );
        assert_eq!(split_layers(2, 1).unwrap(), vec![[0, 2]]);
        assert!(split_layers(2, 3)
            .unwrap_err()
            .to_string()
            .contains("2 layers"));
        assert!(split_layers(2, 0).is_err());
    }

    #[test]
    fn model_ids_keep_safe_characters_only() {
        assert_eq!(model_id("Qwen2.5 7B Instruct"), "Qwen2.5-7B-Instruct");
        assert_eq!(model_id("a/b::c "), "a-b-c");
        assert_eq!(model_id("  "), "");
    }
}
