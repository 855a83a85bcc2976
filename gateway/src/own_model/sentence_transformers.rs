//! `gateway serve --embedding-model DIR`: a sentence-transformers model
//! folder (a BERT-family encoder: MiniLM, bge, e5, gte, or XLM-RoBERTa's,
//! such as multilingual-e5) served as the
//! embeddings pipeline. Its manifest pins the files the stages read: the
//! encoder's `config.json` and `model.safetensors`, `tokenizer.json`, and
//! where present `tokenizer_config.json`, `config_sentence_transformers.json`,
//! `modules.json` with the pooling module's `config.json` and
//! `sentence_bert_config.json`. The stages read the pooling and
//! normalization from those files and refuse, by name, what they do not
//! serve (another architecture, a `Dense` module, a pooling mode).

use super::{model_id, write_model_folder};
use crate::config::{GatewayConfig, StageConfig};
use anyhow::{bail, Context, Result};
use proto::digest::Sha256Digest;
use proto::manifest::{ManifestFile, ModelManifest};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// What the gateway reads of a sentence-transformers folder: enough to name
/// it, pin its files and split its layers.
#[derive(Clone, Debug, PartialEq)]
pub struct EmbeddingModel {
    /// The folder, absolute.
    pub dir: PathBuf,
    /// The id clients use: the folder's name (for a Hugging Face cache
    /// snapshot, the repository's name), `[A-Za-z0-9._-]` only.
    pub model_id: String,
    /// `config.json`'s `model_type`.
    pub architecture: String,
    /// `config.json`'s `num_hidden_layers`.
    pub layers: u32,
    /// Longest input in tokens: `sentence_bert_config.json`'s
    /// `max_seq_length`, else the tokenizer's `model_max_length`, at most
    /// the tokens `max_position_embeddings` covers.
    pub max_seq_len: usize,
    /// Every file the stages read, as the manifest names it, with its digest.
    pub files: Vec<ManifestFile>,
}

/// Reads a JSON file of the folder.
fn json(dir: &Path, rel: &str) -> Result<Value> {
    let path = dir.join(rel);
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))
}

/// The id a folder is known by: its name, or for a Hugging Face cache
/// snapshot (`models--ORG--NAME/snapshots/<commit>`) the repository's name.
fn folder_id(dir: &Path) -> String {
    let name = |p: Option<&Path>| {
        p.and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let parent = dir.parent();
    if name(parent) == "snapshots" {
        let repo = name(parent.and_then(|p| p.parent()));
        if let Some(r) = repo.strip_prefix("models--") {
            return model_id(r.rsplit("--").next().unwrap_or(r));
        }
    }
    model_id(&name(Some(dir)))
}

impl EmbeddingModel {
    /// Reads the folder's configuration and hashes the files the stages read.
    pub fn inspect(dir: &Path) -> Result<Self> {
        let dir = std::fs::canonicalize(dir)
            .with_context(|| format!("--embedding-model {}", dir.display()))?;
        if !dir.is_dir() {
            bail!("{} is not a folder", dir.display());
        }
        let config = json(&dir, "config.json")?;
        let architecture = config["model_type"]
            .as_str()
            .context("config.json has no model_type")?
            .to_string();
        let layers = config["num_hidden_layers"]
            .as_u64()
            .filter(|&l| l > 0 && l <= u32::MAX as u64)
            .context("config.json: num_hidden_layers must be a positive number")?
            as u32;
        let positions = config["max_position_embeddings"]
            .as_u64()
            .filter(|&p| p > 0)
            .context("config.json: max_position_embeddings must be a positive number")?
            as usize;
        // The tokens those positions cover: XLM-RoBERTa numbers a sequence's
        // positions from its padding id + 1 (the stage's rule,
        // `enclave_stage::models::bert::BertConfig::first_position`).
        let first = if architecture == "xlm-roberta" {
            (config["pad_token_id"].as_u64().unwrap_or(1) as usize).saturating_add(1)
        } else {
            0
        };
        let positions = positions.saturating_sub(first).max(1);
        if !dir.join("model.safetensors").is_file() {
            let why = if dir.join("model.safetensors.index.json").is_file() {
                "its weights are sharded (model.safetensors.index.json); one model.safetensors is read"
            } else if dir.join("pytorch_model.bin").is_file() {
                "its weights are pytorch_model.bin (a pickle, which is never read); \
                 save them as model.safetensors"
            } else {
                "it has no model.safetensors"
            };
            bail!("{}: {why}", dir.display());
        }
        if !dir.join("tokenizer.json").is_file() {
            bail!(
                "{}: it has no tokenizer.json (a fast tokenizer; `AutoTokenizer.from_pretrained(dir)\
                 .save_pretrained(dir)` writes one)",
                dir.display()
            );
        }
        let mut rels: Vec<String> = ["config.json", "model.safetensors", "tokenizer.json"]
            .map(String::from)
            .to_vec();
        // Read by the entry stage when present (the tokenizer's normalizer;
        // a default prompt, which is refused).
        for optional in ["tokenizer_config.json", "config_sentence_transformers.json"] {
            if dir.join(optional).is_file() {
                rels.push(optional.into());
            }
        }
        let mut max_seq_len = None;
        // Without modules.json, sentence-transformers reads no other file of
        // its own (and neither do the stages).
        if dir.join("modules.json").is_file() {
            rels.push("modules.json".into());
            let modules = json(&dir, "modules.json")?;
            for m in modules.as_array().context("modules.json is not a list")? {
                let kind = m["type"].as_str().unwrap_or_default();
                let path = m["path"].as_str().unwrap_or_default();
                // The class name, whatever package path the version wrote:
                // the stage's rule (`enclave_stage::models::bert::pooling::
                // class_name`; the gateway does not link the stage's code).
                if kind.rsplit('.').next() == Some("Pooling") {
                    rels.push(if path.is_empty() {
                        "config.json".into()
                    } else {
                        format!("{}/config.json", path.trim_end_matches('/'))
                    });
                }
            }
            if dir.join("sentence_bert_config.json").is_file() {
                rels.push("sentence_bert_config.json".into());
                max_seq_len = json(&dir, "sentence_bert_config.json")?["max_seq_length"].as_u64();
            }
        }
        if max_seq_len.is_none() && dir.join("tokenizer_config.json").is_file() {
            max_seq_len = json(&dir, "tokenizer_config.json")?["model_max_length"].as_u64();
        }
        let max_seq_len = max_seq_len.map_or(positions, |m| (m as usize).min(positions));
        let mut seen = std::collections::HashSet::new();
        rels.retain(|r| seen.insert(r.clone()));
        let mut files = Vec::new();
        for rel in rels {
            if !proto::manifest::is_plain_relative(&rel) {
                bail!("modules.json names {rel:?}, outside the model folder");
            }
            let path = dir.join(&rel);
            let sha256 = Sha256Digest::of_file(&path)
                .with_context(|| format!("hashing {}", path.display()))?;
            files.push(ManifestFile {
                path: rel,
                sha256: sha256.hex(),
            });
        }
        let model_id = folder_id(&dir);
        if model_id.is_empty() {
            bail!("{}: no usable model name", dir.display());
        }
        Ok(Self {
            dir,
            model_id,
            architecture,
            layers,
            max_seq_len,
            files,
        })
    }

    /// The manifest that pins the files (the stages check them against it).
    pub fn manifest(&self) -> ModelManifest {
        ModelManifest {
            schema: 1,
            model_id: self.model_id.clone(),
            architecture: self.architecture.clone(),
            task: "embedding".into(),
            source: format!("folder:{}", self.model_id),
            max_seq_len: self.max_seq_len,
            files: self.files.clone(),
        }
    }
}

/// Writes the model folder (manifest and links to the files) and the
/// development policy under `root`, and makes the config's `[pipeline]`
/// serve the model on `layers`; its other settings (weights, token budget,
/// threads) are kept.
pub fn embeddings(
    cfg: &mut GatewayConfig,
    model: &EmbeddingModel,
    layers: &[[u32; 2]],
    root: &Path,
) -> Result<()> {
    let manifest = model.manifest();
    let links: Vec<(String, PathBuf)> = manifest
        .files
        .iter()
        .map(|f| (f.path.clone(), model.dir.join(&f.path)))
        .collect();
    // Named by the manifest's digest: a folder differing in any pinned
    // file (pooling, tokenizer) gets a folder of its own.
    let manifest_sha = Sha256Digest::of(&serde_json::to_vec_pretty(&manifest)?).hex();
    let digest12 = &manifest_sha[..12];
    let written = write_model_folder(
        cfg,
        "--embedding-model",
        &manifest,
        &links,
        digest12,
        layers,
        root,
    )?;
    cfg.replace_pipeline_model(
        written.policy,
        written.dir,
        layers.iter().map(|l| StageConfig::local(*l)).collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hub_snapshot_is_named_by_its_repository() {
        let d = Path::new("/h/hub/models--BAAI--bge-small-en-v1.5/snapshots/5c38ec7c");
        assert_eq!(folder_id(d), "bge-small-en-v1.5");
        assert_eq!(folder_id(Path::new("/m/My Model")), "My-Model");
    }

    /// The longest input is what the position table covers: all of it for
    /// BERT, two fewer for XLM-RoBERTa (positions after its padding id 1),
    /// and a shorter `model_max_length` wins.
    #[test]
    fn longest_input_follows_the_position_table() {
        let dir = std::env::temp_dir().join(format!("st-positions-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["model.safetensors", "tokenizer.json"] {
            std::fs::write(dir.join(f), b"{}").unwrap();
        }
        let longest = |model_type: &str, max_length: Option<u64>| {
            let config = serde_json::json!({"model_type": model_type, "num_hidden_layers": 2,
                "max_position_embeddings": 514, "pad_token_id": 1});
            std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
            let _ = std::fs::remove_file(dir.join("tokenizer_config.json"));
            if let Some(m) = max_length {
                let c = serde_json::json!({ "model_max_length": m });
                std::fs::write(dir.join("tokenizer_config.json"), c.to_string()).unwrap();
            }
            EmbeddingModel::inspect(&dir).unwrap().max_seq_len
        };
        assert_eq!(longest("bert", None), 514);
        assert_eq!(longest("xlm-roberta", None), 512);
        assert_eq!(longest("xlm-roberta", Some(100)), 100);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
