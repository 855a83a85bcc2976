//! The model's hyper-parameters (from GGUF metadata) and what a
//! teacher-forced pass measures.

use candle_core::quantized::gguf_file;
use candle_core::DType;

// Named only in doc links.
#[cfg(doc)]
use super::LlamaPart;

/// What [`LlamaPart::teacher_forced`] measured, one entry per predicted
/// position.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TeacherForced {
    /// The model's most likely next token at each position.
    pub top1: Vec<u32>,
    /// `-ln p(true next token)` at each position.
    pub nll: Vec<f64>,
}

impl TeacherForced {
    /// `exp(mean nll)`.
    pub fn perplexity(&self) -> f64 {
        (self.nll.iter().sum::<f64>() / self.nll.len().max(1) as f64).exp()
    }

    /// Share of positions whose top-1 prediction equals `other`'s.
    pub fn agreement(&self, other: &TeacherForced) -> f64 {
        let same = self
            .top1
            .iter()
            .zip(&other.top1)
            .filter(|(a, b)| a == b)
            .count();
        same as f64 / self.top1.len().min(other.top1.len()).max(1) as f64
    }
}

/// Hyper-parameters of a Llama model, read from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size (rows of the token embedding).
    pub vocab_size: usize,
    /// Hidden width.
    pub hidden_size: usize,
    /// Feed-forward width.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `num_heads`).
    pub num_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Rotary embedding base.
    pub rope_theta: f32,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Context length the model was trained for (positions available).
    pub max_seq_len: usize,
    /// Beginning-of-sequence token id, if the metadata names one.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token id, if the metadata names one.
    pub eos_token_id: Option<u32>,
    /// Whether the output head is the token embedding (no `output.weight`).
    pub tied_embeddings: bool,
}

pub(super) fn md<'a>(
    ct: &'a gguf_file::Content,
    key: &str,
) -> candle_core::Result<&'a gguf_file::Value> {
    ct.metadata
        .get(key)
        .ok_or_else(|| candle_core::Error::Msg(format!("GGUF metadata has no {key}")))
}

impl LlamaConfig {
    /// Reads the configuration from a GGUF's metadata (`llama.*` keys).
    pub fn from_gguf(ct: &gguf_file::Content) -> candle_core::Result<Self> {
        let arch = md(ct, "general.architecture")?.to_string()?;
        if arch != "llama" {
            candle_core::bail!("GGUF architecture is {arch}, not llama");
        }
        let u = |k: &str| -> candle_core::Result<usize> {
            Ok(md(ct, &format!("llama.{k}"))?.to_u32()? as usize)
        };
        let hidden_size = u("embedding_length")?;
        let num_heads = u("attention.head_count")?;
        let num_kv_heads = u("attention.head_count_kv").unwrap_or(num_heads);
        let head_dim = u("rope.dimension_count").unwrap_or(hidden_size / num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            candle_core::bail!("{num_heads} heads cannot share {num_kv_heads} KV heads");
        }
        if head_dim * num_heads != hidden_size || head_dim % 2 != 0 {
            candle_core::bail!("head width {head_dim} × {num_heads} heads ≠ hidden {hidden_size}");
        }
        let embd = ct
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| candle_core::Error::Msg("GGUF has no token_embd.weight".into()))?;
        let vocab_size = embd.shape.dims()[0];
        let token = |k: &str| ct.metadata.get(k).and_then(|v| v.to_u32().ok());
        Ok(Self {
            vocab_size,
            hidden_size,
            intermediate_size: u("feed_forward_length")?,
            num_layers: u("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_theta: md(ct, "llama.rope.freq_base")
                .and_then(|v| v.to_f32())
                .unwrap_or(10_000.0),
            rms_norm_eps: md(ct, "llama.attention.layer_norm_rms_epsilon")?.to_f32()? as f64,
            max_seq_len: u("context_length")?,
            bos_token_id: token("tokenizer.ggml.bos_token_id"),
            eos_token_id: token("tokenizer.ggml.eos_token_id"),
            tied_embeddings: !ct.tensor_infos.contains_key("output.weight"),
        })
    }

    /// Bytes of KV cache one token takes in `layers` layers (f32 keys and values).
    pub fn kv_bytes_per_token(&self, layers: usize) -> usize {
        layers * 2 * self.num_kv_heads * self.head_dim * DType::F32.size_in_bytes()
    }
}
