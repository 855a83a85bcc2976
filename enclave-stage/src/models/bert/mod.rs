//! BERT encoder split by layers (all-MiniLM-L6-v2 and the BERT-family
//! sentence-transformers models: bge, e5, gte; and XLM-RoBERTa's, such as
//! multilingual-e5, the same encoder with positions counted from after the
//! padding id), written on Candle's primitives because candle-transformers'
//! `BertModel` does not expose a layer range. A stage loads only the tensors of its own layers (plus the
//! embeddings for the entry stage). Its fused CPU operations are in [`ops`],
//! the exit stage's pooling as the model's sentence-transformers files name
//! it in [`pooling`], the entry stage's tokenizer as transformers builds it
//! in [`tokenizer`].

pub mod ops;
pub mod pooling;
pub mod tokenizer;

use crate::kernels::bf16_matmul::{Bf16Matrix, Kernel};
use crate::models::bert::ops::{Attention, BiasGelu, BiasResidualNorm};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{embedding, layer_norm, Embedding, LayerNorm, VarBuilder};
use proto::frames::WeightFormat;
use serde::Deserialize;
use std::ops::Range;

/// The `model_type`s this encoder serves: `bert`, and `xlm-roberta` (whose
/// layers are BERT's; only its position ids and tokenizer differ).
pub const SERVED: [&str; 2] = ["bert", "xlm-roberta"];

/// The fields of a BERT `config.json` this model uses.
#[derive(Clone, Debug, Deserialize)]
pub struct BertConfig {
    /// The transformers model type (one of [`SERVED`]).
    pub model_type: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Hidden width.
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Feed-forward width.
    pub intermediate_size: usize,
    /// Position embeddings available.
    pub max_position_embeddings: usize,
    /// Token type vocabulary.
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// Activation (only `gelu`, the exact erf form, is served).
    pub hidden_act: String,
    /// How positions are embedded (only `absolute`, the default, is served).
    #[serde(default)]
    pub position_embedding_type: Option<String>,
    /// The padding token's id: XLM-RoBERTa's positions start after it
    /// (transformers' `XLMRobertaConfig` default: 1).
    #[serde(default)]
    pub pad_token_id: Option<usize>,
}

impl BertConfig {
    /// Refuses, naming it, what this encoder does not implement and sizes
    /// that would fail or panic later rather than at load.
    pub fn check(&self) -> candle_core::Result<()> {
        if !SERVED.contains(&self.model_type.as_str()) {
            candle_core::bail!(
                "config.json: model_type {:?} is not served (served: {})",
                self.model_type,
                SERVED.map(|t| format!("{t:?}")).join(", ")
            );
        }
        if self.hidden_act != "gelu" {
            candle_core::bail!(
                "config.json: hidden_act {:?} is not served (served: \"gelu\")",
                self.hidden_act
            );
        }
        if let Some(p) = self
            .position_embedding_type
            .as_deref()
            .filter(|p| *p != "absolute")
        {
            candle_core::bail!(
                "config.json: position_embedding_type {p:?} is not served (served: \"absolute\")"
            );
        }
        for (key, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ] {
            if v == 0 {
                candle_core::bail!("config.json: {key} is 0");
            }
        }
        if self.max_position_embeddings > u32::MAX as usize {
            candle_core::bail!(
                "config.json: max_position_embeddings {} is too large",
                self.max_position_embeddings
            );
        }
        if self.is_xlm_roberta() {
            // Its padding id names a row of both tables (torch refuses
            // a padding index outside them).
            let pad = self.padding_id();
            if pad >= self.vocab_size || pad >= self.max_position_embeddings {
                candle_core::bail!(
                    "config.json: pad_token_id {pad} is outside the vocabulary ({}) or the \
                     position table ({})",
                    self.vocab_size,
                    self.max_position_embeddings
                );
            }
        }
        if self.max_tokens() == 0 {
            candle_core::bail!(
                "config.json: max_position_embeddings {} leaves no position after the first, {}",
                self.max_position_embeddings,
                self.first_position()
            );
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            candle_core::bail!(
                "config.json: hidden_size {} is not a multiple of num_attention_heads {}",
                self.hidden_size,
                self.num_attention_heads
            );
        }
        Ok(())
    }

    /// Whether this is an XLM-RoBERTa encoder.
    pub fn is_xlm_roberta(&self) -> bool {
        self.model_type == "xlm-roberta"
    }

    /// The position id of a sequence's first token: 0 for BERT; for
    /// XLM-RoBERTa the padding id + 1 (fairseq's convention, as transformers'
    /// `create_position_ids_from_input_ids` numbers the tokens that are not
    /// padding).
    pub fn first_position(&self) -> usize {
        if self.is_xlm_roberta() {
            self.padding_id().saturating_add(1)
        } else {
            0
        }
    }

    /// `pad_token_id`, or transformers' `XLMRobertaConfig` default, 1.
    fn padding_id(&self) -> usize {
        self.pad_token_id.unwrap_or(1)
    }

    /// The longest sequence, in tokens, the position embeddings cover.
    pub fn max_tokens(&self) -> usize {
        self.max_position_embeddings
            .saturating_sub(self.first_position())
    }
}

struct Embeddings {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    norm: LayerNorm,
}

/// A dense layer's `[out, in]` weight as the stage holds it.
enum Dense {
    /// f32, for Candle's GEMM.
    F32(Tensor),
    /// Rounded to bf16 ([`crate::kernels::bf16_matmul`]).
    Bf16(Bf16Matrix),
}

impl Dense {
    fn new(w: Tensor, format: WeightFormat) -> candle_core::Result<Self> {
        match format {
            WeightFormat::F32 => Ok(Dense::F32(w)),
            WeightFormat::Bf16 => Ok(Dense::Bf16(Bf16Matrix::new(&w, Kernel::detect())?)),
            other => candle_core::bail!(
                "weights {}",
                other.served_by(&WeightFormat::EMBEDDING).unwrap_err()
            ),
        }
    }

    /// `W · x` for feature-major `x` (`[in, tokens]`).
    fn matmul(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Dense::F32(w) => w.matmul(x),
            Dense::Bf16(w) => w.matmul(x),
        }
    }
}

/// One encoder layer: weights as `[out, in]` matrices, biases and norms
/// folded into the fused ops of [`crate::models::bert::ops`].
struct Layer {
    /// Query, key and value projections stacked: `[3h, h]`.
    qkv: Dense,
    attention: Attention,
    attn_out: Dense,
    attn_norm: BiasResidualNorm,
    intermediate: Dense,
    gelu: BiasGelu,
    output: Dense,
    out_norm: BiasResidualNorm,
}

/// A dense layer's `[out, in]` weight and its bias as a plain vector.
fn dense(vb: VarBuilder, in_dim: usize, out_dim: usize) -> candle_core::Result<(Tensor, Vec<f32>)> {
    let w = vb.get((out_dim, in_dim), "weight")?;
    let b = vb.get(out_dim, "bias")?.to_vec1::<f32>()?;
    Ok((w, b))
}

/// A layer norm's scale and shift folded with the bias of the dense layer before it.
fn norm(
    vb: VarBuilder,
    h: usize,
    eps: f64,
    bias: Vec<f32>,
) -> candle_core::Result<BiasResidualNorm> {
    Ok(BiasResidualNorm {
        bias,
        gamma: vb.get(h, "weight")?.to_vec1::<f32>()?,
        beta: vb.get(h, "bias")?.to_vec1::<f32>()?,
        eps: eps as f32,
    })
}

/// The part of a BERT encoder one stage runs.
pub struct BertPart {
    cfg: BertConfig,
    embeddings: Option<Embeddings>,
    layers: Vec<Layer>,
    device: Device,
}

impl BertPart {
    /// Loads layers `range` (and the embeddings if `with_embeddings`), the
    /// dense layers' weights held as `weights` (`f32` or `bf16`).
    pub fn load(
        vb: VarBuilder,
        cfg: BertConfig,
        range: Range<usize>,
        with_embeddings: bool,
        weights: WeightFormat,
    ) -> candle_core::Result<Self> {
        cfg.check()?;
        if range.end > cfg.num_hidden_layers || range.start > range.end {
            candle_core::bail!(
                "layer range {range:?} outside the model's {} layers",
                cfg.num_hidden_layers
            );
        }
        let h = cfg.hidden_size;
        // A `BertModel` (`XLMRobertaModel`) saves its tensors unprefixed; one
        // saved from a `BertFor…` (`XLMRobertaFor…`) head model, as some
        // hubs' files are, under `bert.` (`roberta.`).
        let vb = if vb.contains_tensor("embeddings.word_embeddings.weight")
            || vb.contains_tensor("encoder.layer.0.attention.self.query.weight")
        {
            vb
        } else if cfg.is_xlm_roberta() {
            vb.pp("roberta")
        } else {
            vb.pp("bert")
        };
        let embeddings = if with_embeddings {
            let e = vb.pp("embeddings");
            Some(Embeddings {
                word: embedding(cfg.vocab_size, h, e.pp("word_embeddings"))?,
                position: embedding(cfg.max_position_embeddings, h, e.pp("position_embeddings"))?,
                token_type: embedding(cfg.type_vocab_size, h, e.pp("token_type_embeddings"))?,
                norm: layer_norm(h, cfg.layer_norm_eps, e.pp("LayerNorm"))?,
            })
        } else {
            None
        };
        let mut layers = Vec::with_capacity(range.len());
        for i in range {
            let l = vb.pp(format!("encoder.layer.{i}"));
            let a = l.pp("attention");
            let (q, qb) = dense(a.pp("self.query"), h, h)?;
            let (k, kb) = dense(a.pp("self.key"), h, h)?;
            let (v, vb_) = dense(a.pp("self.value"), h, h)?;
            let (attn_out, ob) = dense(a.pp("output.dense"), h, h)?;
            let (intermediate, ib) = dense(l.pp("intermediate.dense"), h, cfg.intermediate_size)?;
            let (output, fb) = dense(l.pp("output.dense"), cfg.intermediate_size, h)?;
            let eps = cfg.layer_norm_eps;
            let d = |w: Tensor| Dense::new(w, weights);
            layers.push(Layer {
                qkv: d(Tensor::cat(&[&q, &k, &v], 0)?)?,
                attention: Attention {
                    heads: cfg.num_attention_heads,
                    qkv_bias: [qb, kb, vb_].concat(),
                },
                attn_out: d(attn_out)?,
                attn_norm: norm(a.pp("output.LayerNorm"), h, eps, ob)?,
                intermediate: d(intermediate)?,
                gelu: BiasGelu { bias: ib },
                output: d(output)?,
                out_norm: norm(l.pp("output.LayerNorm"), h, eps, fb)?,
            });
        }
        Ok(Self {
            device: vb.device().clone(),
            cfg,
            embeddings,
            layers,
        })
    }

    /// The model configuration.
    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }

    /// The bf16 kernel the dense layers' products run on (`None`: f32
    /// weights, or no layers).
    pub fn bf16_kernel(&self) -> Option<Kernel> {
        match self.layers.first().map(|l| &l.qkv) {
            Some(Dense::Bf16(m)) => Some(m.kernel()),
            _ => None,
        }
    }

    /// Hidden width.
    pub fn hidden_size(&self) -> usize {
        self.cfg.hidden_size
    }

    /// The device tensors live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Token ids `[batch, seq]` (u32) → embeddings `[batch, seq, hidden]`.
    pub fn embed(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let e = self
            .embeddings
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("this stage has no embeddings".into()))?;
        let (b, l) = ids.dims2()?;
        if l > self.cfg.max_tokens() {
            candle_core::bail!("sequence of {l} tokens exceeds position embeddings");
        }
        // Padding columns get positions too; every reader masks them.
        let pos = if self.cfg.is_xlm_roberta() {
            // As transformers' `create_position_ids_from_input_ids`: only
            // tokens other than the padding id are counted, from the padding
            // id + 1, and a padding id in the text (a literal `<pad>`) takes
            // the padding row. At most `pad + l` < the table's size (`check`).
            let pad = self.cfg.padding_id() as u32;
            let mut pos = Vec::with_capacity(b * l);
            for row in ids.to_vec2::<u32>()? {
                let mut n = 0;
                pos.extend(row.into_iter().map(|id| {
                    if id == pad {
                        pad
                    } else {
                        n += 1;
                        pad + n
                    }
                }));
            }
            Tensor::from_vec(pos, (b, l), &self.device)?
        } else {
            Tensor::arange(0u32, l as u32, &self.device)?
                .unsqueeze(0)?
                .broadcast_as((b, l))?
        };
        let types = Tensor::zeros((b, l), DType::U32, &self.device)?;
        let x = e
            .word
            .forward(ids)?
            .add(&e.position.forward(&pos)?)?
            .add(&e.token_type.forward(&types)?)?;
        e.norm.forward(&x)
    }

    /// Runs this stage's layers. `mask` is `[batch, seq]` f32 with 1 for real
    /// tokens and 0 for padding.
    ///
    /// Inside, only the real tokens are computed, feature-major
    /// (`[hidden, real tokens]`, the sequences one after another): padding
    /// costs nothing, and each product is `W · Xᵀ` with the weight as
    /// Candle's row-major left operand, which its GEMM runs without a
    /// strided gather of the activations (measured 1.1–2× faster per product
    /// on the reference machine than `X · Wᵀ`, most at one short sentence).
    /// Padded positions come back as zeros (every reader masks them).
    pub fn forward_layers(&self, hidden: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let (b, l, h) = hidden.dims3()?;
        let mask = mask.to_vec2::<f32>()?;
        let keep: Vec<u32> = (0..b * l)
            .filter(|&i| mask[i / l][i % l] != 0.0)
            .map(|i| i as u32)
            .collect();
        let lens: Vec<u32> = mask
            .iter()
            .map(|row| row.iter().filter(|m| **m != 0.0).count() as u32)
            .collect();
        if keep.is_empty() {
            return hidden.zeros_like();
        }
        let index = Tensor::new(keep.as_slice(), &self.device)?;
        let lens = Tensor::new(lens.as_slice(), &self.device)?;
        let mut x = hidden
            .reshape((b * l, h))?
            .index_select(&index, 0)?
            .t()?
            .contiguous()?;
        for layer in &self.layers {
            x = layer_forward(layer, &x, &lens)?;
        }
        let out = Tensor::zeros((b * l, h), hidden.dtype(), &self.device)?;
        out.index_add(&index, &x.t()?.contiguous()?, 0)?
            .reshape((b, l, h))
    }
}

/// One encoder layer on feature-major activations `x` (`[h, tokens]`) of
/// sequences of `lens` real tokens each, one after another.
fn layer_forward(layer: &Layer, x: &Tensor, lens: &Tensor) -> candle_core::Result<Tensor> {
    let ctx = layer
        .qkv
        .matmul(x)?
        .apply_op2_no_bwd(lens, &layer.attention)?;
    let a = layer
        .attn_out
        .matmul(&ctx)?
        .apply_op2_no_bwd(x, &layer.attn_norm)?;
    let i = layer
        .intermediate
        .matmul(&a)?
        .apply_op1_no_bwd(&layer.gelu)?;
    layer
        .output
        .matmul(&i)?
        .apply_op2_no_bwd(&a, &layer.out_norm)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(model_type: &str, pad: Option<usize>) -> BertConfig {
        serde_json::from_value(serde_json::json!({
            "model_type": model_type, "vocab_size": 10, "hidden_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
            "max_position_embeddings": 514, "type_vocab_size": 1, "layer_norm_eps": 1e-5,
            "hidden_act": "gelu", "pad_token_id": pad}))
        .unwrap()
    }

    /// XLM-RoBERTa's positions start after its padding id, so its table
    /// covers that many fewer tokens; BERT's start at 0; RoBERTa is refused.
    #[test]
    fn positions_per_family() {
        let x = config("xlm-roberta", Some(1));
        assert_eq!((x.first_position(), x.max_tokens()), (2, 512));
        assert_eq!(config("xlm-roberta", None).first_position(), 2);
        let b = config("bert", Some(0));
        assert_eq!((b.first_position(), b.max_tokens()), (0, 514));
        let e = config("roberta", Some(1)).check().unwrap_err().to_string();
        assert!(e.contains("roberta") && e.contains("not served"), "{e}");
        let mut short = config("xlm-roberta", Some(1));
        short.max_position_embeddings = 2;
        assert!(short
            .check()
            .unwrap_err()
            .to_string()
            .contains("no position"));
        for pad in [10, usize::MAX] {
            let e = config("xlm-roberta", Some(pad)).check().unwrap_err();
            assert!(e.to_string().contains("pad_token_id"), "{e}");
        }
    }
}
