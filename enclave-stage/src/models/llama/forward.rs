//! One decoder block over a packed batch: rotary tables, attention with
//! each sequence's cache, the causal mask.

use super::cache::{KvCache, SeqSlice};
use super::config::{LlamaConfig, RopeStyle};
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

/// One decoder layer over a packed batch.
#[allow(clippy::too_many_arguments)]
pub(super) fn block_forward(
    cfg: &LlamaConfig,
    b: &Block,
    layer: usize,
    x: &Tensor,
    batch: &[SeqSlice],
    cos: &Tensor,
    sin: &Tensor,
    caches: &HashMap<u64, KvCache>,
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

    let scale = 1.0 / (d as f64).sqrt();
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
            let keys = kc.narrow(1, 0, total)?; // [kv, total, d]
            let vals = vc.narrow(1, 0, total)?;
            // Query heads that share a KV head are stacked: [kv, group * c, d].
            let qs = q
                .narrow(1, off + c0, c)?
                .contiguous()?
                .reshape((nkv, group * c, d))?;
            let mut scores = (qs.matmul(&keys.t()?)? * scale)?; // [kv, group * c, total]
            if c > 1 {
                scores = scores.broadcast_add(&causal_mask(group, c, past, x.device())?)?;
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
    let x = (x + proj_ctx(b, &ctx)?)?;
    debug_assert_eq!(x.dims2()?, (t, hidden));

    let xn = candle_nn::ops::rms_norm(&x, &b.ffn_norm, eps)?;
    let [gate, up] = products(Weight::forward_many(&[&b.gate, &b.up], &xn)?)?;
    let act = (candle_nn::ops::silu(&gate)? * up)?;
    x + b.down.forward(&act)?
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

/// Additive causal mask `[group * n, past + n]` for `n` new tokens after
/// `past` cached ones (rows repeat per query head of a group).
pub(super) fn causal_mask(
    group: usize,
    n: usize,
    past: usize,
    dev: &Device,
) -> candle_core::Result<Tensor> {
    let total = past + n;
    let mut m = vec![0f32; group * n * total];
    for g in 0..group {
        for i in 0..n {
            let row = &mut m[(g * n + i) * total..(g * n + i + 1) * total];
            for x in row.iter_mut().skip(past + i + 1) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    Tensor::from_vec(m, (group * n, total), dev)
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
