//! What a stage claims about itself ([`StageClaims`]: position, layers,
//! model, keys, weight format), and how the claims are bound into its
//! attestation documents for a purpose ([`EvidencePurpose`],
//! [`claims_binding`], [`attest_claims`], [`bound_claims`]). Built only on the evidence types; the attestation
//! code, the Nitro provider, the policy and the frames build on it.

use crate::digest::Sha256Digest;
use crate::evidence::{
    AttestError, AttestationProvider, Evidence, EvidenceFormat, VerifiedDocument,
};
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
    /// How the stage holds its weights: the format changes the outputs, so
    /// the evidence says which. Absent from embedding stages that hold the
    /// model's own f32 weights (and from evidence made before embedding
    /// stages had a choice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<WeightFormat>,
}

/// How a stage holds its weights (a pipeline's `weights` config key, the
/// stage's `--weights`, and its claims: the format changes the outputs).
/// Generation stages hold their linear layers and output head as `f32`,
/// `q8_0` or `q4_1`; embedding stages their dense layers as `f32` or `bf16`.
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
    /// The GGUF's blocks as packaged, where a kernel takes them (Q4_1 and
    /// Q8_0 as they are; Q4_0, Q4_K and Q6_K repacked with the same
    /// values); the other types (F32, F16, BF16, Q5_K) re-quantized to
    /// Q8_0. The default: for SmolLM2 (Q4_1 layers, a Q8_0
    /// embedding) the packaged model's exact weights in the fewest bytes,
    /// so the fastest format that meets the quality bar.
    #[default]
    #[serde(rename = "q4_1")]
    Q4_1,
    /// Embedding stages: the dense layers' weights rounded to bfloat16, and
    /// their inputs rounded alike for each product, summed in f32 (AVX-512
    /// BF16 where the CPU has it). Cost against f32: benchmark_results/embeddings.md.
    #[serde(rename = "bf16")]
    Bf16,
}

impl WeightFormat {
    /// Every format.
    pub const ALL: [WeightFormat; 4] = [
        WeightFormat::F32,
        WeightFormat::Q8_0,
        WeightFormat::Q4_1,
        WeightFormat::Bf16,
    ];
    /// The formats a generation (Llama) stage serves, in the order
    /// benchmarks report them.
    pub const GENERATION: [WeightFormat; 3] =
        [WeightFormat::F32, WeightFormat::Q8_0, WeightFormat::Q4_1];
    /// The formats an embedding (BERT) stage serves.
    pub const EMBEDDING: [WeightFormat; 2] = [WeightFormat::F32, WeightFormat::Bf16];

    /// `self` if it is among `served`, else the error that lists them.
    pub fn served_by(self, served: &[WeightFormat]) -> Result<Self, String> {
        if served.contains(&self) {
            return Ok(self);
        }
        let names: Vec<&str> = served.iter().map(|f| f.as_str()).collect();
        Err(format!(
            "{self} is not served here ({})",
            names.join(" or ")
        ))
    }

    /// The config and command-line name.
    pub fn as_str(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q4_1 => "q4_1",
            WeightFormat::Bf16 => "bf16",
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
            .ok_or_else(|| format!("unknown weight format {s:?} (f32, q8_0, q4_1 or bf16)"))
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

/// What an attestation document was made for. The purpose is bound with
/// the claims ([`claims_binding`]), so evidence made for one purpose is
/// never accepted for another: a document fetched through
/// `/v1/attestation` cannot pass as channel or boot evidence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvidencePurpose {
    /// The attested channel handshake (binds the channel's ephemeral key
    /// and the peer's challenge).
    Channel,
    /// Made at stage start (binds the receipt key, empty nonce); receipt
    /// links name its digest.
    Boot,
    /// Fresh evidence for a verifier's nonce (`/v1/attestation`).
    Attestation,
}

impl EvidencePurpose {
    /// The label bound into the document.
    pub fn label(self) -> &'static str {
        match self {
            Self::Channel => "channel",
            Self::Boot => "boot",
            Self::Attestation => "attestation",
        }
    }
}

/// Domain label of the claims digest Nitro documents carry in `user_data`.
const CLAIMS_DIGEST_LABEL: &str = "stage-claims/v2";
/// The label before documents carried a purpose.
const LEGACY_CLAIMS_DIGEST_LABEL: &str = "stage-claims/v1";

/// What a document of `format` made for `purpose` carries in `user_data`
/// for a stage's claims (their CBOR encoding, `claims_cbor`): mock
/// documents carry the purpose label, a zero byte and the claims
/// themselves; Nitro documents carry `H("stage-claims/v2"; label,
/// claims_cbor)` (32 bytes), because the NSM takes at most 512 bytes of
/// user data, and the claims travel beside the document.
pub fn claims_binding(
    format: EvidenceFormat,
    purpose: EvidencePurpose,
    claims_cbor: &[u8],
) -> Vec<u8> {
    match format {
        EvidenceFormat::Mock => [purpose.label().as_bytes(), &[0], claims_cbor].concat(),
        EvidenceFormat::Nitro => Sha256Digest::of_parts(
            CLAIMS_DIGEST_LABEL,
            &[purpose.label().as_bytes(), claims_cbor],
        )
        .0
        .to_vec(),
    }
}

/// The binding of documents made before they carried a purpose (mock: the
/// claims; Nitro: `H("stage-claims/v1"; claims_cbor)`). Accepted only when
/// an evidence bundle archived then is verified, and reported as such.
pub fn legacy_claims_binding(format: EvidenceFormat, claims_cbor: &[u8]) -> Vec<u8> {
    match format {
        EvidenceFormat::Mock => claims_cbor.to_vec(),
        EvidenceFormat::Nitro => Sha256Digest::of_parts(LEGACY_CLAIMS_DIGEST_LABEL, &[claims_cbor])
            .0
            .to_vec(),
    }
}

/// Asks `provider` for a document made for `purpose` binding `public_key`,
/// `claims` (as [`claims_binding`] says for its format) and `nonce`.
pub fn attest_claims(
    provider: &dyn AttestationProvider,
    public_key: &[u8],
    purpose: EvidencePurpose,
    claims: &StageClaims,
    nonce: &[u8],
) -> Result<Evidence, AttestError> {
    let user_data = claims_binding(provider.format(), purpose, &crate::cbor::to_vec(claims));
    provider.attest(public_key, &user_data, nonce)
}

/// The claims a verified document made for `purpose` binds. Mock documents
/// carry them in `user_data` after the purpose label (`carried`, when
/// given, must be the same bytes); Nitro documents carry their digest, and
/// `carried` (the claims sent beside the document) must match it. A
/// document made for another purpose is refused.
pub fn bound_claims(
    doc: &VerifiedDocument,
    purpose: EvidencePurpose,
    carried: Option<&[u8]>,
) -> Result<StageClaims, String> {
    let bytes = match (doc.format, carried) {
        (EvidenceFormat::Mock, None) => doc
            .user_data
            .strip_prefix(purpose.label().as_bytes())
            .and_then(|rest| rest.strip_prefix(&[0]))
            .ok_or_else(|| {
                format!(
                    "the evidence was not made for the {} purpose",
                    purpose.label()
                )
            })?,
        (EvidenceFormat::Nitro, None) => {
            return Err("Nitro evidence arrived without the claims it binds".into())
        }
        (format, Some(c)) => {
            if claims_binding(format, purpose, c) != doc.user_data {
                return Err(format!(
                    "the evidence does not bind these claims for the {} purpose",
                    purpose.label()
                ));
            }
            c
        }
    };
    crate::cbor::from_slice(bytes).map_err(|e| format!("claims in evidence: {e}"))
}
