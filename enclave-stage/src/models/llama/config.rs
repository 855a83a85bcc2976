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

/// The decoder families this stage runs, by the GGUF's `general.architecture`.
/// They share one block (RMSNorm, rotary attention with grouped KV heads,
/// SwiGLU) and differ in a few places, each named here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `llama`: Llama 2 and 3.x, Mistral-style, SmolLM, TinyLlama. Rotary
    /// embedding on adjacent pairs (the GGUF's q/k rows are permuted for it);
    /// optional q/k/v/output biases.
    Llama,
    /// `qwen2`: Qwen2 and Qwen2.5. Rotary embedding on the two halves of a
    /// head (NEOX style); q/k/v biases.
    Qwen2,
    /// `qwen3`: Qwen3 dense. As `qwen2` without the biases, plus an RMSNorm
    /// of each query and key head before the rotary embedding.
    Qwen3,
    /// `phi3`: Phi-3 and Phi-3.5 (mini, medium); Phi-4 and Phi-4-mini (a
    /// rotary embedding on part of each head). NEOX rotary; the
    /// q/k/v products in one `attn_qkv` matrix and the gate and up products
    /// in one `ffn_up` (gate rows first); Phi-3.5's LongRoPE factors
    /// (`rope_factors_long`/`_short`) and attention factor. Its sliding
    /// window is not applied, as llama.cpp does not apply it.
    Phi3,
    /// `gemma2`: Gemma 2. NEOX rotary; the token embedding scaled by
    /// `sqrt(hidden)`; an RMSNorm after attention and after the
    /// feed-forward product as well as before each; a GELU (tanh) gate;
    /// attention scores and output logits soft-capped (`cap · tanh(s /
    /// cap)`); a sliding window on alternate layers ([`SlidingWindow`]);
    /// the head always tied to the embedding.
    Gemma2,
}

/// The activation of the feed-forward gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU): every family but Gemma.
    Silu,
    /// GELU, tanh approximation (GeGLU): Gemma.
    GeluTanh,
}

/// Attention limited to the last `window` positions (a query at position
/// `p` sees keys `p − window + 1 ..= p`) on the layers `pattern` picks, as
/// llama.cpp's `LLAMA_SWA_TYPE_STANDARD` with `set_swa_pattern`: layer `i`
/// is windowed when `i % pattern < pattern − 1` (Gemma 2: every even layer),
/// every layer when `pattern` is 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlidingWindow {
    /// Positions a query sees, itself included.
    pub window: usize,
    /// Layers per repeat of the pattern (the last of each is global).
    pub pattern: usize,
}

impl SlidingWindow {
    /// Whether layer `layer` (of the whole model) is windowed.
    pub fn applies(&self, layer: usize) -> bool {
        self.pattern == 0 || layer % self.pattern < self.pattern - 1
    }
}

/// How the rotary embedding pairs a head's dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Dimensions `2i` and `2i + 1` (llama.cpp's `LLAMA_ROPE_TYPE_NORM`).
    Interleaved,
    /// Dimensions `i` and `i + d/2` (llama.cpp's `LLAMA_ROPE_TYPE_NEOX`).
    Halves,
}

impl Architecture {
    /// Every architecture name this stage loads.
    pub const NAMES: [&'static str; 5] = ["llama", "qwen2", "qwen3", "phi3", "gemma2"];

    /// The architecture a GGUF names, or an error naming it and what is
    /// supported.
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name {
            "llama" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            "qwen3" => Ok(Self::Qwen3),
            "phi3" => Ok(Self::Phi3),
            "gemma2" => Ok(Self::Gemma2),
            other => Err(format!(
                "GGUF architecture {other:?} is not supported (supported: {})",
                Self::NAMES.join(", ")
            )),
        }
    }

    /// The GGUF's name for it (its metadata keys' prefix).
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Phi3 => "phi3",
            Self::Gemma2 => "gemma2",
        }
    }

    /// How its rotary embedding pairs dimensions.
    pub fn rope_style(self) -> RopeStyle {
        match self {
            Self::Llama => RopeStyle::Interleaved,
            Self::Qwen2 | Self::Qwen3 | Self::Phi3 | Self::Gemma2 => RopeStyle::Halves,
        }
    }

    /// Whether its blocks must have q/k/v biases.
    pub fn needs_qkv_bias(self) -> bool {
        self == Self::Qwen2
    }

    /// Whether its blocks must have per-head q/k norms.
    pub fn needs_qk_norm(self) -> bool {
        self == Self::Qwen3
    }

    /// Whether its blocks hold q/k/v as one `attn_qkv` matrix and the gate
    /// and up products as one `ffn_up` of twice the feed-forward width.
    pub fn fused_products(self) -> bool {
        self == Self::Phi3
    }

    /// Whether its blocks normalize the attention and feed-forward outputs
    /// too (`post_attention_norm`, `post_ffw_norm`) before adding them.
    pub fn post_norms(self) -> bool {
        self == Self::Gemma2
    }

    /// Whether its token embedding is multiplied by `sqrt(hidden)`.
    pub fn scales_embedding(self) -> bool {
        self == Self::Gemma2
    }

    /// Whether its head is the token embedding even where the file has an
    /// `output.weight` (llama.cpp's gemma2 loader reads none, and refuses a
    /// file with a tensor it does not read).
    pub fn always_tied(self) -> bool {
        self == Self::Gemma2
    }

    /// The feed-forward gate's activation.
    pub fn activation(self) -> Activation {
        match self {
            Self::Gemma2 => Activation::GeluTanh,
            _ => Activation::Silu,
        }
    }
}

/// Hyper-parameters of a decoder, read from GGUF metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// The decoder family.
    pub architecture: Architecture,
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
    /// Width of one head (`heads × head_dim` may differ from the hidden
    /// width, as in Qwen3).
    pub head_dim: usize,
    /// Leading dimensions of each query and key head the rotary embedding
    /// turns (`rope.dimension_count`): the whole head, or a part of it as
    /// in Phi-4-mini (96 of 128); the rest pass unrotated.
    pub rope_dim: usize,
    /// Rotary embedding base.
    pub rope_theta: f32,
    /// Linear rotary scaling (`rope.scaling.type = linear`): positions are
    /// divided by this factor; 1 without scaling.
    pub rope_linear_factor: f32,
    /// The rotary embedding's cos and sin are multiplied by this
    /// (`rope.scaling.attn_factor`, Phi-3.5's LongRoPE); 1 without.
    pub rope_attn_factor: f32,
    /// The tensor of per-pair rotary frequency divisors that applies, if
    /// any: Llama 3's `rope_freqs.weight`, or for LongRoPE
    /// `rope_factors_long.weight` when the context exceeds
    /// `rope.scaling.original_context_length` (as llama.cpp picks them for
    /// a context that long) and `rope_factors_short.weight` otherwise.
    pub rope_factors: Option<&'static str>,
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
    /// Multiplier of the attention scores: `1/sqrt(head_dim)`, or, for a
    /// 46-layer `gemma2` (Gemma 2 27B), `1/sqrt(hidden / heads)`, as
    /// llama.cpp picks it.
    pub attn_scale: f64,
    /// Soft cap of the attention scores (`gemma2`: `attn_logit_softcapping`,
    /// 50 by default), applied after scaling and before the mask.
    pub attn_softcap: Option<f32>,
    /// Soft cap of the output logits (`gemma2`: `final_logit_softcapping`,
    /// 30 by default).
    pub final_softcap: Option<f32>,
    /// The sliding window and the layers it applies to (`gemma2`:
    /// `attention.sliding_window`, 4096 by default, every even layer).
    pub sliding_window: Option<SlidingWindow>,
}

/// Llama 3's per-pair rotary frequency divisors.
pub(super) const ROPE_FREQS: &str = "rope_freqs.weight";
/// LongRoPE's divisors for a context beyond the original one.
pub(super) const LONG_FACTORS: &str = "rope_factors_long.weight";
/// LongRoPE's divisors within the original context.
pub(super) const SHORT_FACTORS: &str = "rope_factors_short.weight";

/// The widest head this stage accepts (the largest in use is 256).
const MAX_HEAD_DIM: usize = 1024;

pub(super) fn md<'a>(
    ct: &'a gguf_file::Content,
    key: &str,
) -> candle_core::Result<&'a gguf_file::Value> {
    ct.metadata
        .get(key)
        .ok_or_else(|| candle_core::Error::Msg(format!("GGUF metadata has no {key}")))
}

impl LlamaConfig {
    /// Reads the configuration from a GGUF's metadata (`general.architecture`
    /// and that architecture's `{arch}.*` keys). An architecture or a rotary
    /// scaling this stage does not implement is refused, named.
    pub fn from_gguf(ct: &gguf_file::Content) -> candle_core::Result<Self> {
        let arch_name = md(ct, "general.architecture")?.to_string()?;
        let architecture = Architecture::from_name(arch_name).map_err(candle_core::Error::Msg)?;
        let a = architecture.name();
        let get = |k: &str| ct.metadata.get(&format!("{a}.{k}"));
        let u = |k: &str| -> candle_core::Result<usize> {
            Ok(md(ct, &format!("{a}.{k}"))?.to_u32()? as usize)
        };
        let hidden_size = u("embedding_length")?;
        let num_heads = u("attention.head_count")?;
        let num_kv_heads = u("attention.head_count_kv").unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            candle_core::bail!("{num_heads} heads cannot share {num_kv_heads} KV heads");
        }
        if hidden_size == 0 {
            candle_core::bail!("a hidden width of 0");
        }
        let head_dim = u("attention.key_length").unwrap_or(hidden_size / num_heads);
        if head_dim > MAX_HEAD_DIM {
            candle_core::bail!("heads of width {head_dim} (at most {MAX_HEAD_DIM})");
        }
        let value_dim = u("attention.value_length").unwrap_or(head_dim);
        let rope_dim = u("rope.dimension_count").unwrap_or(head_dim);
        // A rotary width narrower than the head only where llama.cpp runs
        // one: the halves (NEOX) families, as Phi-4-mini; it refuses a
        // `llama` file's.
        let partial_ok = architecture.rope_style() == RopeStyle::Halves;
        if value_dim != head_dim
            || rope_dim > head_dim
            || (rope_dim < head_dim && !partial_ok)
            || rope_dim % 2 != 0
            || rope_dim == 0
            || head_dim % 2 != 0
        {
            candle_core::bail!(
                "heads of key width {head_dim}, value width {value_dim} and rotary width \
                 {rope_dim}: this stage needs keys and values of one even width, and an \
                 even rotary width of that (or, for qwen2, qwen3 and phi3, of at most that)"
            );
        }
        // As llama.cpp reads them: the type defaults to linear, and the
        // factor (`rope.scaling.factor`, or older converters'
        // `rope.scale_linear`) scales the positions under none and linear.
        let scaling = match get("rope.scaling.type") {
            Some(v) => v.to_string()?.clone(),
            None => "linear".into(),
        };
        let factor = |key: &str| get(key).and_then(|v| v.to_f32().ok());
        let rope_linear_factor = match scaling.as_str() {
            "none" | "linear" => factor("rope.scaling.factor")
                .or_else(|| factor("rope.scale_linear"))
                .filter(|f| *f != 0.0)
                .unwrap_or(1.0),
            other => candle_core::bail!(
                "rotary scaling {other:?} is not supported (supported: none, linear, \
                 and Llama 3's rope_freqs factors)"
            ),
        };
        if !(rope_linear_factor.is_finite() && rope_linear_factor > 0.0) {
            candle_core::bail!("rotary scaling factor {rope_linear_factor} is not positive");
        }
        let intermediate_size = u("feed_forward_length")?;
        if intermediate_size == 0 {
            candle_core::bail!("a feed-forward width of 0");
        }
        let rope_attn_factor = factor("rope.scaling.attn_factor").unwrap_or(1.0);
        if !(rope_attn_factor.is_finite() && rope_attn_factor > 0.0) {
            candle_core::bail!("rotary attention factor {rope_attn_factor} is not positive");
        }
        let max_seq_len = u("context_length")?;
        let has = |t: &str| ct.tensor_infos.contains_key(t);
        let rope_factors = match (has(LONG_FACTORS), has(SHORT_FACTORS)) {
            _ if has(ROPE_FREQS) => Some(ROPE_FREQS),
            (false, false) => None,
            (true, true) => {
                let original = u("rope.scaling.original_context_length").unwrap_or(max_seq_len);
                Some(if max_seq_len > original {
                    LONG_FACTORS
                } else {
                    SHORT_FACTORS
                })
            }
            _ => candle_core::bail!(
                "the GGUF has only one of {LONG_FACTORS} and {SHORT_FACTORS} (LongRoPE needs both)"
            ),
        };
        let (attn_softcap, final_softcap, sliding_window) = if architecture == Architecture::Gemma2
        {
            let cap = |key: &str, default: f32| -> candle_core::Result<f32> {
                let c = factor(key).unwrap_or(default);
                if !(c.is_finite() && c > 0.0) {
                    candle_core::bail!("{a}.{key} = {c} is not a positive number");
                }
                Ok(c)
            };
            let window = get("attention.sliding_window")
                .map(|v| v.to_u32())
                .transpose()?
                .unwrap_or(4096) as usize;
            let pattern = match get("attention.sliding_window_pattern") {
                None => 2,
                Some(gguf_file::Value::Array(_)) => candle_core::bail!(
                    "{a}.attention.sliding_window_pattern as a per-layer list is not supported \
                     (a layer count is)"
                ),
                Some(v) => v.to_u32()? as usize,
            };
            if window == 0 {
                candle_core::bail!("{a}.attention.sliding_window = 0");
            }
            // llama.cpp turns the windowed layers with this base; a file
            // whose windowed layers turn differently is not one this stage
            // runs (Gemma 2's converter writes none).
            if let Some(swa_base) = factor("rope.freq_base_swa") {
                if swa_base != factor("rope.freq_base").unwrap_or(10_000.0) {
                    candle_core::bail!(
                        "{a}.rope.freq_base_swa = {swa_base}, unlike rope.freq_base: a second \
                         rotary base for the windowed layers is not supported"
                    );
                }
            }
            (
                Some(cap("attn_logit_softcapping", 50.0)?),
                Some(cap("final_logit_softcapping", 30.0)?),
                Some(SlidingWindow { window, pattern }),
            )
        } else {
            (None, None, None)
        };
        let num_layers = u("block_count")?;
        let attn_scale = if architecture == Architecture::Gemma2 && num_layers == 46 {
            1.0 / ((hidden_size / num_heads) as f64).sqrt()
        } else {
            1.0 / (head_dim as f64).sqrt()
        };
        let embd = ct
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| candle_core::Error::Msg("GGUF has no token_embd.weight".into()))?;
        let vocab_size = embd.shape.dims()[0];
        let token = |k: &str| ct.metadata.get(k).and_then(|v| v.to_u32().ok());
        for k in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"] {
            if let Some(t) = token(k).filter(|&t| t as usize >= vocab_size) {
                candle_core::bail!("{k} = {t} is outside the vocabulary of {vocab_size}");
            }
        }
        Ok(Self {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_dim,
            rope_theta: factor("rope.freq_base").unwrap_or(10_000.0),
            rope_linear_factor,
            rope_attn_factor,
            rope_factors,
            rms_norm_eps: md(ct, &format!("{a}.attention.layer_norm_rms_epsilon"))?.to_f32()?
                as f64,
            max_seq_len,
            bos_token_id: token("tokenizer.ggml.bos_token_id"),
            eos_token_id: token("tokenizer.ggml.eos_token_id"),
            tied_embeddings: architecture.always_tied()
                || !ct.tensor_infos.contains_key("output.weight"),
            attn_scale,
            attn_softcap,
            final_softcap,
            sliding_window,
        })
    }

    /// The sliding window of layer `layer` (of the whole model), if it has one.
    pub fn window(&self, layer: usize) -> Option<usize> {
        self.sliding_window
            .filter(|w| w.applies(layer))
            .map(|w| w.window)
    }

    /// Reads the configuration of the GGUF file at `path` (its header only).
    pub fn read(path: &std::path::Path) -> candle_core::Result<Self> {
        let mut f = std::fs::File::open(path)
            .map_err(|e| candle_core::Error::Msg(format!("opening {}: {e}", path.display())))?;
        Self::from_gguf(&gguf_file::Content::read(&mut f).map_err(|e| e.with_path(path))?)
    }

    /// Bytes of KV cache one token takes in `layers` layers (f32 keys and values).
    pub fn kv_bytes_per_token(&self, layers: usize) -> usize {
        layers * 2 * self.num_kv_heads * self.head_dim * DType::F32.size_in_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
    use candle_core::quantized::GgmlDType;

    fn content(arch: &str, extra: &[(&str, Value)]) -> Content {
        let mut metadata = std::collections::HashMap::new();
        metadata.insert("general.architecture".into(), Value::String(arch.into()));
        for (k, v) in [
            ("embedding_length", 256u32),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 2),
            ("feed_forward_length", 512),
            ("block_count", 2),
            ("context_length", 2048),
        ] {
            metadata.insert(format!("{arch}.{k}"), Value::U32(v));
        }
        metadata.insert(
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        );
        for (k, v) in extra {
            metadata.insert(format!("{arch}.{k}"), v.clone());
        }
        let mut tensor_infos = std::collections::HashMap::new();
        tensor_infos.insert(
            "token_embd.weight".to_string(),
            TensorInfo {
                ggml_dtype: GgmlDType::F32,
                shape: (100, 256).into(),
                offset: 0,
            },
        );
        Content {
            magic: VersionedMagic::GgufV3,
            metadata,
            tensor_infos,
            tensor_data_offset: 0,
        }
    }

    #[test]
    fn each_family_reads_its_own_keys() {
        let c = LlamaConfig::from_gguf(&content("llama", &[])).unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!((c.head_dim, c.vocab_size, c.num_kv_heads), (64, 100, 2));
        assert_eq!(c.architecture.rope_style(), RopeStyle::Interleaved);
        assert!(c.tied_embeddings);
        // Qwen3: heads wider than the hidden width shares.
        let c = LlamaConfig::from_gguf(&content(
            "qwen3",
            &[
                ("attention.key_length", Value::U32(128)),
                ("attention.value_length", Value::U32(128)),
            ],
        ))
        .unwrap();
        assert_eq!((c.architecture, c.head_dim), (Architecture::Qwen3, 128));
        assert_eq!(c.architecture.rope_style(), RopeStyle::Halves);
        assert!(c.architecture.needs_qk_norm() && !c.architecture.needs_qkv_bias());
        assert!(Architecture::Qwen2.needs_qkv_bias());
        let c = LlamaConfig::from_gguf(&content("phi3", &[])).unwrap();
        assert_eq!(c.architecture, Architecture::Phi3);
        assert_eq!(c.architecture.rope_style(), RopeStyle::Halves);
        assert!(c.architecture.fused_products() && !Architecture::Llama.fused_products());
        assert_eq!((c.rope_attn_factor, c.rope_factors), (1.0, None));
    }

    /// Gemma 2 reads its caps and window with llama.cpp's defaults, windows
    /// the even layers, scales 27B's scores by the hidden width's share,
    /// and refuses what it does not run (a per-layer pattern list, a second
    /// rotary base, a cap of 0).
    #[test]
    fn gemma2_reads_caps_and_window() {
        let c = LlamaConfig::from_gguf(&content("gemma2", &[])).unwrap();
        assert_eq!(c.architecture.rope_style(), RopeStyle::Halves);
        assert_eq!((c.attn_softcap, c.final_softcap), (Some(50.0), Some(30.0)));
        assert_eq!(
            (c.window(0), c.window(1), c.window(2)),
            (Some(4096), None, Some(4096))
        );
        assert_eq!(c.attn_scale, 1.0 / 8.0);
        assert!(c.tied_embeddings && c.architecture.post_norms());
        assert_eq!(c.architecture.activation(), Activation::GeluTanh);
        let c = LlamaConfig::from_gguf(&content(
            "gemma2",
            &[
                ("attention.sliding_window", Value::U32(48)),
                ("attention.sliding_window_pattern", Value::U32(3)),
                ("attn_logit_softcapping", Value::F32(20.0)),
                ("final_logit_softcapping", Value::F32(4.0)),
                ("block_count", Value::U32(46)),
                ("attention.key_length", Value::U32(128)),
                ("attention.value_length", Value::U32(128)),
            ],
        ))
        .unwrap();
        assert_eq!((c.attn_softcap, c.final_softcap), (Some(20.0), Some(4.0)));
        let windowed: Vec<_> = (0..6).map(|l| c.window(l)).collect();
        assert_eq!(
            windowed,
            [Some(48), Some(48), None, Some(48), Some(48), None]
        );
        // Gemma 2 27B: hidden / heads (256 / 4), not the key width (128).
        assert_eq!(c.attn_scale, 1.0 / 8.0);
        assert_eq!(
            LlamaConfig::from_gguf(&content("llama", &[]))
                .unwrap()
                .window(0),
            None
        );
        for (key, value, named) in [
            (
                "attention.sliding_window_pattern",
                Value::Array(vec![Value::Bool(true)]),
                "per-layer list",
            ),
            ("rope.freq_base_swa", Value::F32(10.0), "freq_base_swa"),
            ("final_logit_softcapping", Value::F32(0.0), "final_logit"),
            (
                "attention.sliding_window",
                Value::U32(0),
                "sliding_window = 0",
            ),
        ] {
            let e = LlamaConfig::from_gguf(&content("gemma2", &[(key, value)]))
                .unwrap_err()
                .to_string();
            assert!(e.contains(named), "{key}: {e}");
        }
    }

    /// LongRoPE's factor set follows the context as llama.cpp picks it:
    /// long beyond the original context, short within it; one set alone
    /// is refused, and Llama 3's `rope_freqs` wins where a file has it.
    #[test]
    fn longrope_factors_follow_the_context() {
        let factors = |c: &mut Content, names: &[&str]| {
            for n in names {
                c.tensor_infos.insert(
                    n.to_string(),
                    TensorInfo {
                        ggml_dtype: GgmlDType::F32,
                        shape: (32,).into(),
                        offset: 0,
                    },
                );
            }
        };
        let attn = ("rope.scaling.attn_factor", Value::F32(1.19));
        let mut long = content(
            "phi3",
            &[
                attn.clone(),
                ("rope.scaling.original_context_length", Value::U32(1024)),
            ],
        );
        factors(&mut long, &[LONG_FACTORS, SHORT_FACTORS]);
        let c = LlamaConfig::from_gguf(&long).unwrap();
        assert_eq!(
            (c.rope_factors, c.rope_attn_factor),
            (Some(LONG_FACTORS), 1.19)
        );
        let mut short = content(
            "phi3",
            &[
                attn,
                ("rope.scaling.original_context_length", Value::U32(2048)),
            ],
        );
        factors(&mut short, &[LONG_FACTORS, SHORT_FACTORS]);
        let c = LlamaConfig::from_gguf(&short).unwrap();
        assert_eq!(c.rope_factors, Some(SHORT_FACTORS));
        let mut one = content("phi3", &[]);
        factors(&mut one, &[LONG_FACTORS]);
        let e = LlamaConfig::from_gguf(&one).unwrap_err().to_string();
        assert!(e.contains("only one of"), "{e}");
        let mut llama3 = content("llama", &[]);
        factors(&mut llama3, &[ROPE_FREQS]);
        let c = LlamaConfig::from_gguf(&llama3).unwrap();
        assert_eq!(c.rope_factors, Some(ROPE_FREQS));
    }

    #[test]
    fn linear_scaling_is_read_and_other_scalings_are_refused() {
        let linear = content(
            "llama",
            &[
                ("rope.scaling.type", Value::String("linear".into())),
                ("rope.scaling.factor", Value::F32(4.0)),
            ],
        );
        assert_eq!(
            LlamaConfig::from_gguf(&linear).unwrap().rope_linear_factor,
            4.0
        );
        // As llama.cpp: without a type, a factor is linear scaling.
        let untyped = content("llama", &[("rope.scale_linear", Value::F32(2.0))]);
        assert_eq!(
            LlamaConfig::from_gguf(&untyped).unwrap().rope_linear_factor,
            2.0
        );
        let plain = content("llama", &[]);
        assert_eq!(
            LlamaConfig::from_gguf(&plain).unwrap().rope_linear_factor,
            1.0
        );
        let yarn = content(
            "qwen2",
            &[("rope.scaling.type", Value::String("yarn".into()))],
        );
        let e = LlamaConfig::from_gguf(&yarn).unwrap_err().to_string();
        assert!(e.contains("yarn"), "{e}");
    }

    #[test]
    fn unsupported_architectures_and_head_shapes_are_named() {
        let e = LlamaConfig::from_gguf(&content("gemma3", &[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("gemma3") && e.contains("gemma2"), "{e}");
        let mut bad_eos = content("llama", &[]);
        bad_eos
            .metadata
            .insert("tokenizer.ggml.eos_token_id".into(), Value::U32(100));
        let e = LlamaConfig::from_gguf(&bad_eos).unwrap_err().to_string();
        assert!(e.contains("eos_token_id = 100"), "{e}");
        let partial_rope = content("phi3", &[("rope.dimension_count", Value::U32(48))]);
        let c = LlamaConfig::from_gguf(&partial_rope).unwrap();
        assert_eq!((c.head_dim, c.rope_dim), (64, 48));
        // Wider than the head, odd, or partial in a `llama` file (which
        // llama.cpp refuses).
        for (arch, bad) in [("phi3", 96), ("phi3", 31), ("llama", 32)] {
            let wide_rope = content(arch, &[("rope.dimension_count", Value::U32(bad))]);
            let e = LlamaConfig::from_gguf(&wide_rope).unwrap_err().to_string();
            assert!(e.contains(&format!("rotary width {bad}")), "{e}");
        }
        let no_ffn = content("phi3", &[("feed_forward_length", Value::U32(0))]);
        let e = LlamaConfig::from_gguf(&no_ffn).unwrap_err().to_string();
        assert!(e.contains("feed-forward width of 0"), "{e}");
    }
}
