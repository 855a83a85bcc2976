//! BERT encoder split by layers (all-MiniLM-L6-v2), written on Candle's
//! primitives because candle-transformers' `BertModel` does not expose a
//! layer range. A stage loads only the tensors of its own layers (plus the
//! embeddings for the entry stage).

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{embedding, layer_norm, linear, Embedding, LayerNorm, Linear, VarBuilder};
use serde::Deserialize;
use std::ops::Range;

/// The fields of a BERT `config.json` this model uses.
#[derive(Clone, Debug, Deserialize)]
pub struct BertConfig {
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
    /// Activation (only `gelu` is supported).
    pub hidden_act: String,
}

struct Embeddings {
    word: Embedding,
    position: Embedding,
    token_type: Embedding,
    norm: LayerNorm,
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    out_norm: LayerNorm,
}

/// The part of a BERT encoder one stage runs.
pub struct BertPart {
    cfg: BertConfig,
    embeddings: Option<Embeddings>,
    layers: Vec<Layer>,
    device: Device,
}

impl BertPart {
    /// Loads layers `range` (and the embeddings if `with_embeddings`).
    pub fn load(
        vb: VarBuilder,
        cfg: BertConfig,
        range: Range<usize>,
        with_embeddings: bool,
    ) -> candle_core::Result<Self> {
        if cfg.hidden_act != "gelu" {
            candle_core::bail!("unsupported activation {}", cfg.hidden_act);
        }
        if range.end > cfg.num_hidden_layers || range.start > range.end {
            candle_core::bail!(
                "layer range {range:?} outside the model's {} layers",
                cfg.num_hidden_layers
            );
        }
        let h = cfg.hidden_size;
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
            layers.push(Layer {
                query: linear(h, h, a.pp("self.query"))?,
                key: linear(h, h, a.pp("self.key"))?,
                value: linear(h, h, a.pp("self.value"))?,
                attn_out: linear(h, h, a.pp("output.dense"))?,
                attn_norm: layer_norm(h, cfg.layer_norm_eps, a.pp("output.LayerNorm"))?,
                intermediate: linear(h, cfg.intermediate_size, l.pp("intermediate.dense"))?,
                output: linear(cfg.intermediate_size, h, l.pp("output.dense"))?,
                out_norm: layer_norm(h, cfg.layer_norm_eps, l.pp("output.LayerNorm"))?,
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
        if l > self.cfg.max_position_embeddings {
            candle_core::bail!("sequence of {l} tokens exceeds position embeddings");
        }
        let pos = Tensor::arange(0u32, l as u32, &self.device)?
            .unsqueeze(0)?
            .broadcast_as((b, l))?;
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
    pub fn forward_layers(&self, hidden: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let (b, l, _) = hidden.dims3()?;
        // Additive mask: 0 where attended, f32::MIN where padded (as in HF BERT).
        let add_mask =
            ((mask.ones_like()? - mask)? * f64::from(f32::MIN))?.reshape((b, 1, 1, l))?;
        let mut x = hidden.clone();
        for layer in &self.layers {
            x = self.layer_forward(layer, &x, &add_mask)?;
        }
        Ok(x)
    }

    fn layer_forward(
        &self,
        layer: &Layer,
        x: &Tensor,
        add_mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let (b, l, h) = x.dims3()?;
        let heads = self.cfg.num_attention_heads;
        let d = h / heads;
        let split = |t: Tensor| -> candle_core::Result<Tensor> {
            t.reshape((b, l, heads, d))?.transpose(1, 2)?.contiguous()
        };
        let q = split(layer.query.forward(x)?)?;
        let k = split(layer.key.forward(x)?)?;
        let v = split(layer.value.forward(x)?)?;
        let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?.broadcast_add(add_mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let ctx = probs
            .matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((b, l, h))?;
        let a = layer
            .attn_norm
            .forward(&(layer.attn_out.forward(&ctx)? + x)?)?;
        let i = layer.intermediate.forward(&a)?.gelu_erf()?;
        layer.out_norm.forward(&(layer.output.forward(&i)? + a)?)
    }
}

/// Mean-pools `[batch, seq, hidden]` over the mask and L2-normalises each row
/// (sentence-transformers' Pooling(mean) + Normalize).
pub fn mean_pool_normalize(hidden: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
    let m = mask.unsqueeze(2)?;
    let summed = hidden.broadcast_mul(&m)?.sum(1)?;
    let counts = m.sum(1)?.clamp(1e-9, f64::MAX)?;
    let mean = summed.broadcast_div(&counts)?;
    let norm = mean
        .sqr()?
        .sum_keepdim(D::Minus1)?
        .sqrt()?
        .clamp(1e-12, f64::MAX)?;
    mean.broadcast_div(&norm)
}
