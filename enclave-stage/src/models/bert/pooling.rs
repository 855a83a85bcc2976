//! How the exit stage turns token vectors into one sentence vector, as the
//! model's sentence-transformers files say: the modules of `modules.json`
//! (`Transformer`, then `Pooling`, then optionally `Normalize`) and the
//! pooling mode of the `Pooling` module's `config.json` (mean, CLS token or
//! max). A folder without `modules.json` is pooled as sentence-transformers
//! pools it: mean, not normalized. Anything else (a `Dense` module, a
//! concatenation of modes, the weighted or last-token modes) is refused at
//! load, named.

use anyhow::{bail, Context, Result};
use candle_core::{Tensor, D};
use proto::manifest::LoadedManifest;
use serde::Deserialize;
use serde_json::Value;

/// Which token vectors make the sentence vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolMode {
    /// The mean of the real tokens' vectors.
    Mean,
    /// The first token's (`[CLS]`) vector.
    Cls,
    /// The element-wise maximum over the real tokens.
    Max,
}

/// The exit stage's pooling: a mode, then L2 normalization or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pooling {
    /// How the tokens are combined.
    pub mode: PoolMode,
    /// Whether each vector is scaled to unit length (a `Normalize` module).
    pub normalize: bool,
}

/// One entry of `modules.json`.
#[derive(Deserialize)]
struct Module {
    path: String,
    #[serde(rename = "type")]
    kind: String,
}

/// The legacy boolean keys of a `Pooling` module's `config.json` (as
/// sentence-transformers before 6 writes it) and the mode each names in the
/// current form (`"pooling_mode": "mean"`).
const LEGACY_MODES: [(&str, &str); 6] = [
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len_tokens"),
    ("pooling_mode_weightedmean_tokens", "weightedmean"),
    ("pooling_mode_lasttoken", "lasttoken"),
];

/// The pooling modes a `Pooling` module's `config.json` names, in either
/// form, and the width it names (if any).
fn pooling_modes(cfg: &Value) -> Result<(Vec<String>, Option<u64>)> {
    let width = cfg["embedding_dimension"]
        .as_u64()
        .or_else(|| cfg["word_embedding_dimension"].as_u64());
    let modes = match &cfg["pooling_mode"] {
        Value::String(m) => vec![m.clone()],
        Value::Array(ms) => ms
            .iter()
            .map(|m| {
                m.as_str()
                    .map(String::from)
                    .context("pooling_mode lists a non-string")
            })
            .collect::<Result<_>>()?,
        Value::Null => {
            let legacy = LEGACY_MODES.iter().any(|(key, _)| cfg.get(*key).is_some());
            let on: Vec<String> = LEGACY_MODES
                .iter()
                .filter(|(key, _)| cfg[*key] == Value::Bool(true))
                .map(|(_, mode)| mode.to_string())
                .collect();
            // sentence-transformers before 6 defaults the mean key to true
            // (and concatenates it with any other mode set), 6 to false:
            // a file that leaves it out means two things.
            if legacy && !on.is_empty() && cfg.get("pooling_mode_mean_tokens").is_none() {
                bail!(
                    "pooling_mode_mean_tokens is missing, which sentence-transformers before 6 \
                     reads as true (concatenated with {}) and 6 as false: set it",
                    on.join(", ")
                );
            }
            // No mode at all is mean, as sentence-transformers reads it.
            if on.is_empty() {
                vec!["mean".to_string()]
            } else {
                on
            }
        }
        other => bail!("pooling_mode {other} is neither a mode nor a list of modes"),
    };
    Ok((modes, width))
}

/// The class name of a module type (`sentence_transformers.models.Pooling`
/// → `Pooling`), whatever package path a version of sentence-transformers
/// writes (the gateway's `own_model::sentence_transformers` finds the
/// pooling config to pin by the same rule).
pub fn class_name(kind: &str) -> &str {
    kind.rsplit('.').next().unwrap_or(kind)
}

impl Pooling {
    /// sentence-transformers' default for a plain model folder.
    pub const PLAIN: Pooling = Pooling {
        mode: PoolMode::Mean,
        normalize: false,
    };

    /// Reads the pooling from the manifest's `modules.json` (and the
    /// `Pooling` module's `config.json` it names), each file checked against
    /// the manifest; [`Pooling::PLAIN`] when the manifest lists no
    /// `modules.json`. `hidden` is the encoder's width, which the pooling
    /// config must name if it names one.
    pub fn from_manifest(manifest: &LoadedManifest, hidden: usize) -> Result<Self> {
        if !manifest.lists("modules.json") {
            return Ok(Self::PLAIN);
        }
        let modules: Vec<Module> = serde_json::from_value(manifest.verified_json("modules.json")?)
            .context("parsing modules.json")?;
        let kinds: Vec<&str> = modules.iter().map(|m| class_name(&m.kind)).collect();
        let (pooling_dir, normalize) = match kinds.as_slice() {
            ["Transformer", "Pooling"] => (&modules[1].path, false),
            ["Transformer", "Pooling", "Normalize"] => (&modules[1].path, true),
            _ => bail!(
                "modules.json lists the modules {kinds:?}; served are Transformer, Pooling \
                 and optionally Normalize, in that order"
            ),
        };
        if !modules[0].path.is_empty() {
            bail!(
                "modules.json: the Transformer module is in {:?}; served is the folder itself \
                 (path \"\")",
                modules[0].path
            );
        }
        let rel = if pooling_dir.is_empty() {
            "config.json".to_string()
        } else {
            format!("{}/config.json", pooling_dir.trim_end_matches('/'))
        };
        let cfg = manifest.verified_json(&rel)?;
        let (modes, width) = pooling_modes(&cfg).with_context(|| rel.clone())?;
        if let Some(d) = width {
            if d != hidden as u64 {
                bail!("{rel}: the pooling is {d} wide, but the encoder is {hidden} wide");
            }
        }
        let mode = match modes.as_slice() {
            [m] => match m.as_str() {
                "mean" => PoolMode::Mean,
                "cls" => PoolMode::Cls,
                "max" => PoolMode::Max,
                other => bail!(
                    "{rel}: pooling mode {other:?} is not served (served: \"mean\", \"cls\", \"max\")"
                ),
            },
            [] => bail!("{rel}: pooling_mode lists no mode"),
            _ => bail!(
                "{rel}: several pooling modes at once ({}) would be concatenated; one is served",
                modes.join(", ")
            ),
        };
        Ok(Self { mode, normalize })
    }

    /// Pools `[batch, seq, hidden]` over the `[batch, seq]` mask (1 for real
    /// tokens) into `[batch, hidden]`, normalized if the model says so.
    pub fn apply(&self, hidden: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let m = mask.unsqueeze(2)?;
        let pooled = match self.mode {
            PoolMode::Mean => {
                let summed = hidden.broadcast_mul(&m)?.sum(1)?;
                let counts = m.sum(1)?.clamp(1e-9, f64::MAX)?;
                summed.broadcast_div(&counts)?
            }
            PoolMode::Cls => hidden.narrow(1, 0, 1)?.squeeze(1)?,
            PoolMode::Max => {
                // Padding set far below any value, as sentence-transformers does.
                let pad = ((m.ones_like()? - &m)? * -1e9)?;
                hidden.broadcast_add(&pad)?.max(1)?
            }
        };
        if !self.normalize {
            return Ok(pooled);
        }
        let norm = pooled
            .sqr()?
            .sum_keepdim(D::Minus1)?
            .sqrt()?
            .clamp(1e-12, f64::MAX)?;
        pooled.broadcast_div(&norm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn batch() -> (Tensor, Tensor) {
        // Two sequences of 3 positions, hidden 2; the second has one real token.
        let h = Tensor::new(
            &[
                [[3f32, 0.], [1., 4.], [2., -2.]],
                [[0., 2.], [9., 9.], [9., 9.]],
            ],
            &Device::Cpu,
        )
        .unwrap();
        let m = Tensor::new(&[[1f32, 1., 1.], [1., 0., 0.]], &Device::Cpu).unwrap();
        (h, m)
    }

    fn pool(mode: PoolMode, normalize: bool) -> Vec<Vec<f32>> {
        let (h, m) = batch();
        Pooling { mode, normalize }
            .apply(&h, &m)
            .unwrap()
            .to_vec2()
            .unwrap()
    }

    #[test]
    fn each_mode_ignores_padding() {
        assert_eq!(pool(PoolMode::Mean, false), [[2., 2. / 3.], [0., 2.]]);
        assert_eq!(pool(PoolMode::Cls, false), [[3., 0.], [0., 2.]]);
        assert_eq!(pool(PoolMode::Max, false), [[3., 4.], [0., 2.]]);
        assert_eq!(pool(PoolMode::Cls, true), [[1., 0.], [0., 1.]]);
    }

    /// A model folder holding `files` (path, contents) and a manifest that
    /// pins them; returns the loaded manifest.
    fn folder(name: &str, files: &[(&str, String)]) -> LoadedManifest {
        use proto::digest::Sha256Digest;
        let dir = std::env::temp_dir().join(format!("pooling-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut pinned = Vec::new();
        for (rel, text) in files {
            let path = dir.join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, text).unwrap();
            pinned.push(
                serde_json::json!({"path": rel, "sha256": Sha256Digest::of(text.as_bytes()).hex()}),
            );
        }
        let manifest = serde_json::json!({"schema": 1, "model_id": "m", "architecture": "bert",
            "task": "embedding", "source": "test", "max_seq_len": 8, "files": pinned});
        std::fs::write(dir.join("manifest.json"), manifest.to_string()).unwrap();
        LoadedManifest::load(&dir).unwrap()
    }

    fn modules(kinds: &[(&str, &str)]) -> String {
        let list: Vec<_> = kinds
            .iter()
            .map(|(kind, path)| serde_json::json!({"path": path, "type": kind}))
            .collect();
        serde_json::to_string(&list).unwrap()
    }

    fn read(name: &str, modules_json: String, pooling: serde_json::Value) -> Result<Pooling> {
        let m = folder(
            name,
            &[
                ("modules.json", modules_json),
                ("1_Pooling/config.json", pooling.to_string()),
            ],
        );
        Pooling::from_manifest(&m, 4)
    }

    const V2: [(&str, &str); 3] = [
        ("sentence_transformers.models.Transformer", ""),
        ("sentence_transformers.models.Pooling", "1_Pooling"),
        ("sentence_transformers.models.Normalize", ""),
    ];

    #[test]
    fn both_config_forms_are_read() {
        let legacy = serde_json::json!({"word_embedding_dimension": 4, "pooling_mode_cls_token": true,
            "pooling_mode_mean_tokens": false});
        assert_eq!(
            read("legacy", modules(&V2), legacy).unwrap(),
            Pooling {
                mode: PoolMode::Cls,
                normalize: true
            }
        );
        let v6 = [
            (
                "sentence_transformers.base.modules.transformer.Transformer",
                "",
            ),
            (
                "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
                "1_Pooling",
            ),
        ];
        let current = serde_json::json!({"embedding_dimension": 4, "pooling_mode": "max"});
        assert_eq!(
            read("current", modules(&v6), current).unwrap(),
            Pooling {
                mode: PoolMode::Max,
                normalize: false
            }
        );
        assert_eq!(
            Pooling::from_manifest(&folder("plain", &[]), 4).unwrap(),
            Pooling::PLAIN
        );
        // No mode key at all is mean, as sentence-transformers reads it.
        let empty = serde_json::json!({"word_embedding_dimension": 4});
        assert_eq!(
            read("empty", modules(&V2[..2]), empty).unwrap(),
            Pooling::PLAIN
        );
    }

    #[test]
    fn what_is_not_served_is_refused_by_name() {
        let err = |name: &str, m: String, p: serde_json::Value| {
            format!("{:#}", read(name, m, p).unwrap_err())
        };
        let mean = serde_json::json!({"pooling_mode": "mean"});
        let dense = modules(&[
            V2[0],
            V2[1],
            ("sentence_transformers.models.Dense", "2_Dense"),
        ]);
        assert!(err("dense", dense, mean.clone()).contains("Dense"));
        let e = err(
            "last",
            modules(&V2),
            serde_json::json!({"pooling_mode": "lasttoken"}),
        );
        assert!(e.contains("\"lasttoken\" is not served"), "{e}");
        let e = err(
            "two",
            modules(&V2),
            serde_json::json!({"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": true}),
        );
        assert!(
            e.contains("several pooling modes") && e.contains("cls"),
            "{e}"
        );
        let e = err(
            "none",
            modules(&V2),
            serde_json::json!({"pooling_mode": []}),
        );
        assert!(e.contains("lists no mode"), "{e}");
        // The older form, leaving out the mean key while setting another.
        let e = err(
            "ambiguous",
            modules(&V2),
            serde_json::json!({"pooling_mode_cls_token": true}),
        );
        assert!(e.contains("pooling_mode_mean_tokens is missing"), "{e}");
        let sub = modules(&[
            ("sentence_transformers.models.Transformer", "0_Transformer"),
            V2[1],
        ]);
        assert!(err("subfolder", sub, mean.clone()).contains("0_Transformer"));
        let wide = serde_json::json!({"pooling_mode": "mean", "embedding_dimension": 8});
        assert!(err("wide", modules(&V2), wide).contains("8 wide"));
        // The pooling config is checked against the manifest like any file.
        let m = folder(
            "tampered",
            &[
                ("modules.json", modules(&V2)),
                ("1_Pooling/config.json", mean.to_string()),
            ],
        );
        std::fs::write(
            m.dir.join("1_Pooling/config.json"),
            "{\"pooling_mode\": \"cls\"}",
        )
        .unwrap();
        let e = Pooling::from_manifest(&m, 4).unwrap_err().to_string();
        assert!(e.contains("does not match the manifest"), "{e}");
    }
}
