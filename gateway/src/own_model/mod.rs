//! A user's own model served without writing a config: `gateway serve
//! --model FILE.gguf` (the generation pipeline, [`gguf`]) and
//! `--embedding-model DIR` (a sentence-transformers folder as the
//! embeddings pipeline, [`sentence_transformers`]). From the model's own
//! files this writes what a configured model has: a model folder with a
//! `manifest.json` that pins every file's SHA-256 (the files linked, not
//! copied), and a development policy that pins that manifest, for locally
//! launched stages under mock attestation. The stages then load and check
//! the files as any model's, and refuse what they do not serve by name.
//!
//! Everything is written under `data/models/<model id>-<digest prefix>/`
//! (relative to the working directory, like the receipt store; the GGUF's
//! digest, or an embedding folder's manifest's), so the same files give the
//! same folder, manifest and policy digests on every start. The policy
//! names the stages' layers: starts with another split rewrite it.

pub mod gguf;
pub mod sentence_transformers;

pub use gguf::{completions, planned_layers, read_header, GgufModel};
pub use sentence_transformers::{embeddings, EmbeddingModel};

use crate::config::{GatewayConfig, Launch};
use anyhow::{bail, Context, Result};
use proto::digest::Sha256Digest;
use proto::manifest::ModelManifest;
use std::path::{Path, PathBuf};

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

/// `layers` split into `stages` contiguous ranges, as even as can be (the
/// first ranges one layer longer where they do not divide).
pub fn split_layers(layers: u32, stages: usize) -> Result<Vec<[u32; 2]>> {
    if stages == 0 || stages > layers as usize {
        bail!("{stages} stages: the model has {layers} layers (1 to {layers} stages)");
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

/// Where [`write_model_folder`] put the model and its policy.
struct Written {
    /// The model folder (its `manifest.json` and the links to the files).
    dir: PathBuf,
    /// The development policy that pins the manifest.
    policy: PathBuf,
}

/// Writes `root/<model id>-<digest12>/`: a link for each of `links`
/// (`(path in the manifest, file linked to)`), `manifest.json`, and a
/// development `policy.toml` pinning it for stages on `layers`. `flag`
/// names the command-line option in the policy's comment.
fn write_model_folder(
    cfg: &GatewayConfig,
    flag: &str,
    manifest: &ModelManifest,
    links: &[(String, PathBuf)],
    digest12: &str,
    layers: &[[u32; 2]],
    root: &Path,
) -> Result<Written> {
    if cfg.pipeline.launch != Launch::Local {
        bail!("{flag} serves its model with locally launched stages (pipeline.launch = \"local\")");
    }
    let dir = root.join(format!("{}-{digest12}", manifest.model_id));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (rel, target) in links {
        let link = dir.join(rel);
        if let Some(parent) = link.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        match std::fs::read_link(&link) {
            Ok(to) if &to == target => {}
            _ => {
                let _ = std::fs::remove_file(&link);
                std::os::unix::fs::symlink(target, &link)
                    .with_context(|| format!("linking {}", link.display()))?;
            }
        }
    }
    let manifest_bytes = serde_json::to_vec_pretty(manifest)?;
    write_if_changed(&dir.join("manifest.json"), &manifest_bytes)?;
    let mut policy = format!(
        "# Written by `gateway serve {flag}` for {}: development only.\n\
         # MOCK evidence is accepted: the stages run as plain processes.\n\
         allow_mock = true\ntrust_local_build = true\n\
         # Pins manifest.json, which pins every model file's SHA-256.\n\
         manifest_sha256 = \"{}\"\n",
        manifest.model_id,
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
    Ok(Written {
        dir,
        policy: policy_path,
    })
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
