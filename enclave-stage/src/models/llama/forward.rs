//! One decoder block over a packed batch: rotary tables, attention with
//! each sequence's cache, the causal mask (and sliding window), soft caps.

use super::cache::{KvCache, SeqId, SeqSlice};
use super::config::{Activation, LlamaConfig, RopeStyle};
use super::{Block, Weight};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;

/// The rotary embedding's angle per position and pair of dimensions,
/// `[1, rope_dim / 2]`, computed in f32 as Hugging Face does
/// (`inv_freq = 1 / theta^(2i/d)`, `d` the rotary width), each divided by Llama 3's
/// `rope_freqs` (or LongRoPE) factor where the file has one and by the
/// linear scaling factor, as llama.cpp applies them.
pub(super) fn rope_inv_freq(
    cfg: &LlamaConfig,
    factors: Option<&[f32]>,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let d = cfg.rope_dim;
    if let Some(f) = factors {
        if f.len() != d / 2 || f.iter().any(|v| !(v.is_finite() && *v > 0.0)) {
            candle_core::bail!(
                "{} has {} factors (need {} positive ones)",
                cfg.rope_factors.unwrap_or("the rotary factor tensor"),
                f.len(),
                d / 2
            );
        }
    }
    let inv_freq: Vec<f32> = (0..d / 2)
        .map(|i| {
            let base = 1f32 / cfg.rope_theta.powf((2 * i) as f32 / d as f32);
            base / factors.map_or(1.0, |f| f[i]) / cfg.rope_linear_factor
        })
        .collect();
    Tensor::from_vec(inv_freq, (1, d / 2), device)
}

/// `cos`/`sin` tables `[positions, rope_dim / 2]` for the positions of a
/// batch's tokens (computed per step: a table for the whole context would
/// take 64 MiB at 128K positions), each multiplied by `attn_factor`
/// (LongRoPE's; llama.cpp's `mscale`).
pub(super) fn rope_for(
    inv_freq: &Tensor,
    positions: &[u32],
    attn_factor: f32,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let pos = Tensor::new(positions, device)?
        .to_dtype(DType::F32)?
        .reshape((positions.len(), 1))?;
    let freqs = pos.broadcast_mul(inv_freq)?;
    let (cos, sin) = (freqs.cos()?, freqs.sin()?);
    if attn_factor == 1.0 {
        return Ok((cos, sin));
    }
    let f = f64::from(attn_factor);
    Ok(((cos * f)?, (sin * f)?))
}

/// Query rows per attention chunk of a long prefill.
pub(super) const ATTN_CHUNK: usize = 256;

/// One decoder layer over a packed batch: `layer` indexes this part's
/// caches, `window` is the layer's sliding window if it has one.
#[allow(clippy::too_many_arguments)]
pub(super) fn block_forward(
    cfg: &LlamaConfig,
    b: &Block,
    layer: usize,
    window: Option<usize>,
    x: &Tensor,
    batch: &[SeqSlice],
    cos: &Tensor,
    sin: &Tensor,
    caches: &HashMap<SeqId, KvCache>,
) -> candle_core::Result<Tensor> {
    let eps = cfg.rms_norm_eps as f32;
    let (t, hidden) = x.dims2()?;
    let (nh, nkv, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
    let group = nh / nkv;

    let xn = candle_nn::ops::rms_norm(x, &b.attn_norm, eps)?;
    // [tokens, heads * d] → [1, heads, tokens, d] for the rotary kernel.
    let heads = |y: Tensor, n: usize| -> candle_core::Result<Tensor> {
        y.reshape((t, n, d))?
            .transpose(0, 1)?
            .contiguous()?
            .unsqueeze(0)
    };
    let with_bias = |y: Tensor, bias: &Option<Tensor>| -> candle_core::Result<Tensor> {
        match bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    };
    let [q, k, v] = products(Weight::forward_many(&[&b.q, &b.k, &b.v], &xn)?)?;
    let mut q = heads(with_bias(q, &b.bias.q)?, nh)?;
    let mut k = heads(with_bias(k, &b.bias.k)?, nkv)?;
    let v = heads(with_bias(v, &b.bias.v)?, nkv)?;
    if let Some((qn, kn)) = &b.qk_norm {
        // Qwen3: every head normalized over its own width.
        q = candle_nn::ops::rms_norm(&q, qn, eps)?;
        k = candle_nn::ops::rms_norm(&k, kn, eps)?;
    }
    let rope = match cfg.architecture.rope_style() {
        RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i,
        RopeStyle::Halves => candle_nn::rotary_emb::rope,
    };
    let r = cfg.rope_dim;
    // A partial rotary embedding turns the first `r` dimensions of each
    // head and passes the rest (llama.cpp's `n_rot` < head width).
    let turn = |x: &Tensor| -> candle_core::Result<Tensor> {
        if r == d {
            return rope(x, cos, sin);
        }
        let turned = rope(&x.narrow(3, 0, r)?.contiguous()?, cos, sin)?;
        Tensor::cat(&[turned, x.narrow(3, r, d - r)?], 3)
    };
    let q = turn(&q)?.squeeze(0)?;
    let k = turn(&k)?.squeeze(0)?;
    let v = v.squeeze(0)?;

    let scale = cfg.attn_scale;
    let mut outs = Vec::with_capacity(batch.len());
    let mut off = 0;
    for s in batch {
        let n = s.len;
        let cache = caches.get(&s.seq_id).expect("prepared");
        let (kc, vc) = &cache.layers[layer];
        kc.slice_set(&k.narrow(1, off, n)?.contiguous()?, 1, s.pos)?;
        vc.slice_set(&v.narrow(1, off, n)?.contiguous()?, 1, s.pos)?;
        // Long prefills attend in chunks of query rows, so the score matrix
        // stays at most [kv, group * ATTN_CHUNK, total].
        let mut c0 = 0;
        while c0 < n {
            let c = (n - c0).min(ATTN_CHUNK);
            let past = s.pos + c0;
            let total = past + c;
            // The oldest key a query of this chunk sees: the first, or
            // the first in the window of the chunk's first query.
            let start = window.map_or(0, |w| (past + 1).saturating_sub(w));
            let keys = kc.narrow(1, start, total - start)?; // [kv, seen, d]
            let vals = vc.narrow(1, start, total - start)?;
            // Query heads that share a KV head are stacked: [kv, group * c, d].
            let qs = q
                .narrow(1, off + c0, c)?
                .contiguous()?
                .reshape((nkv, group * c, d))?;
            let mut scores = (qs.matmul(&keys.t()?)? * scale)?; // [kv, group * c, seen]
            if let Some(cap) = cfg.attn_softcap {
                scores = soft_cap(&scores, cap)?;
            }
            // One query sees every key from `start` on; more need a mask.
            if c > 1 {
                let mask = attention_mask(group, c, past, start, window, x.device())?;
                scores = scores.broadcast_add(&mask)?;
            }
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let ctx = probs
                .matmul(&vals)? // [kv, group * c, d]
                .reshape((nh, c, d))?
                .transpose(0, 1)?
                .reshape((c, nh * d))?;
            outs.push(ctx);
            c0 += c;
        }
        off += n;
    }
    let ctx = if outs.len() == 1 {
        outs.pop().expect("one")
    } else {
        Tensor::cat(&outs, 0)?
    };
    // Gemma 2 normalizes each sub-layer's output before adding it.
    let post = |y: Tensor, which: fn(&(Tensor, Tensor)) -> &Tensor| match &b.post_norms {
        Some(norms) => candle_nn::ops::rms_norm(&y, which(norms), eps),
        None => Ok(y),
    };
    let x = (x + post(proj_ctx(b, &ctx)?, |n| &n.0)?)?;
    debug_assert_eq!(x.dims2()?, (t, hidden));

    let xn = candle_nn::ops::rms_norm(&x, &b.ffn_norm, eps)?;
    let [gate, up] = products(Weight::forward_many(&[&b.gate, &b.up], &xn)?)?;
    let gate = match cfg.architecture.activation() {
        Activation::Silu => candle_nn::ops::silu(&gate)?,
        Activation::GeluTanh => gate.gelu()?,
    };
    x + post(b.down.forward(&(gate * up)?)?, |n| &n.1)?
}

/// `cap · tanh(x / cap)`: Gemma 2's soft cap of attention scores and
/// logits, computed as llama.cpp does (scale by `1 / cap`, tanh, scale).
pub(super) fn soft_cap(x: &Tensor, cap: f32) -> candle_core::Result<Tensor> {
    (x * f64::from(1.0 / cap))?.tanh()? * f64::from(cap)
}

/// The `N` products of one [`Weight::forward_many`] call.
fn products<const N: usize>(v: Vec<Tensor>) -> candle_core::Result<[Tensor; N]> {
    <[Tensor; N]>::try_from(v)
        .map_err(|v| candle_core::Error::Msg(format!("{} products, not {N}", v.len())))
}

/// The attention output projection, with its bias where there is one.
fn proj_ctx(b: &Block, ctx: &Tensor) -> candle_core::Result<Tensor> {
    let y = b.o.forward(ctx)?;
    match &b.bias.o {
        Some(bias) => y.broadcast_add(bias),
        None => Ok(y),
    }
}

/// Additive attention mask `[group * n, past + n − start]` for `n` new
/// tokens after `past` cached ones, over the keys from position `start` on
/// (rows repeat per query head of a group): the query at position `p` sees
/// keys at positions `≤ p` and, with a sliding `window`, `> p − window` (as
/// llama.cpp's standard window masks a key `window` or more behind).
pub(super) fn attention_mask(
    group: usize,
    n: usize,
    past: usize,
    start: usize,
    window: Option<usize>,
    dev: &Device,
) -> candle_core::Result<Tensor> {
    let seen = past + n - start;
    let mut m = vec![0f32; group * n * seen];
    for (r, row) in m.chunks_exact_mut(seen).enumerate() {
        let p = past + r % n;
        for (j, x) in row.iter_mut().enumerate() {
            let key = start + j;
            if key > p || window.is_some_and(|w| p - key >= w) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    Tensor::from_vec(m, (group * n, seen), dev)
}

/// Index of the largest logit of each row of `[rows, vocab]` logits (greedy
/// decoding). Ties go to the lowest index; NaN never wins.
pub fn argmax_rows(logits: &Tensor) -> candle_core::Result<Vec<u32>> {
    Ok(logits
        .to_dtype(DType::F32)?
        .to_vec2::<f32>()?
        .iter()
        .map(|r| crate::sampling::argmax(r))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of a mask: which keys (by position) each query row sees.
    fn seen(m: &Tensor, start: usize) -> Vec<Vec<usize>> {
        m.to_vec2::<f32>()
            .unwrap()
            .iter()
            .map(|r| {
                r.iter()
                    .enumerate()
                    .filter(|(_, x)| x.is_finite())
                    .map(|(j, _)| start + j)
                    .collect()
            })
            .collect()
    }

    /// Causal without a window; with a window of 2, each query sees itself
    /// and the key before it, over keys that start where the chunk's first
    /// query's window does; rows repeat per head of a group.
    #[test]
    fn masks_are_causal_and_windowed() {
        let dev = Device::Cpu;
        let m = attention_mask(1, 2, 1, 0, None, &dev).unwrap();
        assert_eq!(seen(&m, 0), [vec![0, 1], vec![0, 1, 2]]);
        // Queries at positions 3, 4, 5 with a window of 2: keys from 2 on.
        let m = attention_mask(2, 3, 3, 2, Some(2), &dev).unwrap();
        let want = [vec![2, 3], vec![3, 4], vec![4, 5]];
        assert_eq!(seen(&m, 2), [&want[..], &want[..]].concat());
    }

    /// `cap · tanh(x / cap)`: near the identity for small scores, bounded
    /// by the cap for large ones.
    #[test]
    fn soft_cap_bounds_scores() {
        let x = Tensor::new(&[0.5f32, 100.0, -100.0], &Device::Cpu).unwrap();
        let y = soft_cap(&x, 5.0).unwrap().to_vec1::<f32>().unwrap();
        assert!((y[0] - 5.0 * (0.1f32).tanh()).abs() < 1e-6, "{y:?}");
        assert!(y[1] <= 5.0 && y[1] > 4.99 && y[2] >= -5.0, "{y:?}");
    }
}
