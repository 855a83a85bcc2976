//! What a stage claims about itself ([`StageClaims`]: position, layers,
//! model, keys, weight format), bound into its attestation documents. A leaf
//! module shared by the attestation code, the policy and the frames.

use crate::digest::Sha256Digest;
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
    /// The stage's Ed25519 receipt-signing public key.
    #[serde(with = "serde_bytes")]
    pub receipt_key: [u8; 32],
    /// The entry stage's HPKE key configurations (RFC 9458 list format);
    /// empty for other stages.
    #[serde(with = "serde_bytes")]
    pub hpke_keys: Vec<u8>,
    /// How a generation stage holds its weights: the quantization changes
    /// the outputs, so the evidence says which. Absent for embedding stages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightFormat>,
}

/// How a generation stage holds its linear-layer and output-head weights
/// (the completions pipeline's `weights` config key, the stage's
/// `--weights`, and its claims: the quantization changes the outputs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum WeightFormat {
    /// Dequantized to f32 at load: the reference path.
    #[serde(rename = "f32")]
    F32,
    /// Re-quantized at load to Q8_0 (blocks of 32 int8 with one scale).
    /// For SmolLM2 this loses information: the packaged weights are Q4_1,
    /// whose grid Q8_0 does not contain (quality: benchmark_results/quality.md).
    #[serde(rename = "q8_0")]
    Q8_0,
    /// The GGUF's blocks as packaged: its Q4_1 layers (4-bit, f16 scale and
    /// min) and its Q8_0 token embedding / output head. The default: the
    /// packaged model's exact weights in the fewest bytes, so the fastest
    /// format that meets the quality bar.
    #[default]
    #[serde(rename = "q4_1")]
    Q4_1,
}

impl WeightFormat {
    /// Every format, in the order benchmarks report them.
    pub const ALL: [WeightFormat; 3] = [WeightFormat::F32, WeightFormat::Q8_0, WeightFormat::Q4_1];

    /// The config and command-line name.
    pub fn as_str(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q4_1 => "q4_1",
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|w| w.as_str() == s)
            .ok_or_else(|| format!("unknown weight format {s:?} (f32, q8_0 or q4_1)"))
    }
}

impl StageClaims {
    /// Whether this stage is the first one (opens, validates and tokenizes
    /// requests).
    pub fn is_entry(&self) -> bool {
        self.stage_index == 0
    }

    /// Whether this stage is the last one.
    pub fn is_exit(&self) -> bool {
        self.stage_index + 1 == self.num_stages
    }
}
