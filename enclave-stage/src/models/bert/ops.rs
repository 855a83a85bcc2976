//! Fused CPU operations of a BERT encoder layer, as Candle custom ops.
//!
//! Written by hand because Candle runs each step of a BERT layer as its own
//! pass over memory with its own allocation and thread hand-off (bias add,
//! GELU through scalar `erff`, split into heads with three copies, a batched
//! matmul of tiny per-head products, scale, mask, softmax, a second batched
//! matmul, a transpose copy, residual add, layer norm). Profiled on the
//! 2-core reference machine, those passes took more time than the GEMMs
//! themselves. Here each group is one pass, parallel over rows with rayon:
//!
//! * [`BiasGelu`]: `gelu_erf(y + bias)`, with a vectorisable erf;
//! * [`Attention`]: QKV bias, scaled dot products, key mask, softmax and the
//!   weighted sum of values, from the fused `[b, l, 3h]` QKV product straight
//!   into `[b, l, h]`;
//! * [`BiasResidualNorm`]: `layer_norm(y + bias + residual)`.
//!
//! The GEMMs stay Candle's. Results match the unfused Candle layer to f32
//! rounding (tests below, and the sentence-transformers reference tests).

use crate::kernels::contiguous;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape};
use rayon::prelude::*;

/// `exp(x)` for f32, branch-free so that loops over it vectorise: range
/// reduction to `2^n · e^r` with `|r| ≤ ln2/2` and a degree-6 polynomial
/// (Taylor coefficients; relative error below 2e-7 on that range).
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E).round();
    // ln 2 split in two so that x - n·ln2 stays exact.
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `erf(x)`, Abramowitz & Stegun 7.1.26 (absolute error ≤ 1.5e-7 in exact
/// arithmetic, ≤ 5e-7 in f32).
#[inline(always)]
fn erf_f32(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_7 + t * (-1.453_152_1 + t * 1.061_405_4))));
    (1.0 - poly * exp_f32(-a * a)).copysign(x)
}

#[inline(always)]
fn gelu_in_place(row: &mut [f32], bias: f32) {
    for v in row {
        let x = *v + bias;
        *v = 0.5 * x * (1.0 + erf_f32(x * std::f32::consts::FRAC_1_SQRT_2));
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gelu_in_place_avx2(row: &mut [f32], bias: f32) {
    gelu_in_place(row, bias)
}

fn avx2() -> bool {
    crate::kernels::CpuFeatures::get().avx2_fma
}

/// `gelu_erf(y + bias)` on a feature-major `[features, tokens]` activation
/// (the feed-forward intermediate).
pub struct BiasGelu {
    /// Bias, one per feature (row).
    pub bias: Vec<f32>,
}

impl CustomOp1 for BiasGelu {
    fn name(&self) -> &'static str {
        "bias-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let x = contiguous(s, l, "bias-gelu")?;
        let (f, t) = l.shape().dims2()?;
        if f != self.bias.len() {
            candle_core::bail!("bias-gelu: {f} rows for {} biases", self.bias.len());
        }
        let mut out = x.to_vec();
        let fast = avx2();
        out.par_chunks_mut(t.max(1))
            .zip(&self.bias)
            .for_each(|(row, &b)| {
                #[cfg(target_arch = "x86_64")]
                if fast {
                    // SAFETY: AVX2 and FMA were detected on this CPU.
                    return unsafe { gelu_in_place_avx2(row, b) };
                }
                let _ = fast;
                gelu_in_place(row, b)
            });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

/// `layer_norm(y + bias + residual)` on feature-major `[h, tokens]`
/// activations: the norm runs down each token's column.
pub struct BiasResidualNorm {
    /// Bias of the dense layer that produced `y`.
    pub bias: Vec<f32>,
    /// Layer-norm scale.
    pub gamma: Vec<f32>,
    /// Layer-norm shift.
    pub beta: Vec<f32>,
    /// Layer-norm epsilon.
    pub eps: f32,
}

impl BiasResidualNorm {
    /// The whole op on slices; rows are features, columns tokens.
    #[inline(always)]
    fn run(&self, y: &[f32], r: &[f32], out: &mut [f32], t: usize) {
        let h = self.bias.len();
        let mut mean = vec![0f32; t];
        for f in 0..h {
            let (o, y, r) = (
                &mut out[f * t..(f + 1) * t],
                &y[f * t..(f + 1) * t],
                &r[f * t..(f + 1) * t],
            );
            let b = self.bias[f];
            for (((o, y), r), m) in o.iter_mut().zip(y).zip(r).zip(mean.iter_mut()) {
                *o = y + b + r;
                *m += *o;
            }
        }
        let inv_h = 1.0 / h as f32;
        mean.iter_mut().for_each(|m| *m *= inv_h);
        let mut var = vec![0f32; t];
        for f in 0..h {
            let o = &mut out[f * t..(f + 1) * t];
            for ((o, m), v) in o.iter_mut().zip(&mean).zip(var.iter_mut()) {
                *o -= m;
                *v += *o * *o;
            }
        }
        var.iter_mut()
            .for_each(|v| *v = 1.0 / (*v * inv_h + self.eps).sqrt());
        for f in 0..h {
            let (g, b) = (self.gamma[f], self.beta[f]);
            for (o, inv) in out[f * t..(f + 1) * t].iter_mut().zip(&var) {
                *o = *o * inv * g + b;
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_avx2(&self, y: &[f32], r: &[f32], out: &mut [f32], t: usize) {
        self.run(y, r, out, t)
    }
}

impl CustomOp2 for BiasResidualNorm {
    fn name(&self) -> &'static str {
        "bias-residual-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = contiguous(s1, l1, "bias-residual-norm")?;
        let r = contiguous(s2, l2, "bias-residual-norm")?;
        let (h, t) = l1.shape().dims2()?;
        if l1.dims() != l2.dims() || h != self.bias.len() {
            candle_core::bail!(
                "bias-residual-norm: shapes {:?} / {:?}",
                l1.dims(),
                l2.dims()
            );
        }
        let mut out = vec![0f32; y.len()];
        #[cfg(target_arch = "x86_64")]
        if avx2() {
            // SAFETY: AVX2 and FMA were detected on this CPU.
            unsafe { self.run_avx2(y, r, &mut out, t) };
            return Ok((CpuStorage::F32(out), l1.shape().clone()));
        }
        self.run(y, r, &mut out, t);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
}

/// Multi-head self-attention on feature-major activations of packed
/// sequences (no padding): from the fused QKV product `[3h, tokens]` (no
/// bias yet; queries, keys, values stacked) and the sequences' lengths
/// `[b]` (u32, summing to `tokens`, the sequences one after another) to the
/// context `[h, tokens]`. Each token attends to the tokens of its own
/// sequence, exactly as HF BERT with its padding mask.
pub struct Attention {
    /// Attention heads.
    pub heads: usize,
    /// Bias of the fused QKV projection (`3h`).
    pub qkv_bias: Vec<f32>,
}

impl Attention {
    /// One sequence, columns `col..col + l` of `qkv` (`t` columns in all),
    /// into a token-major `[l, h]` buffer.
    #[inline(always)]
    fn sequence(&self, qkv: &[f32], t: usize, col: usize, l: usize) -> Vec<f32> {
        let h = self.qkv_bias.len() / 3;
        let d = h / self.heads;
        let scale = 1.0 / (d as f32).sqrt();
        let at =
            |feature: usize, token: usize| qkv[feature * t + col + token] + self.qkv_bias[feature];
        let mut out = vec![0f32; l * h];
        // Per head: queries, keys and values packed token-major, with their
        // bias, for unit-stride dot products.
        let mut q = vec![0f32; l * d];
        let mut k = vec![0f32; l * d];
        let mut v = vec![0f32; l * d];
        let mut p = vec![0f32; l];
        for head in 0..self.heads {
            let (qo, ko, vo) = (head * d, h + head * d, 2 * h + head * d);
            for c in 0..d {
                for i in 0..l {
                    q[i * d + c] = at(qo + c, i) * scale;
                }
                for j in 0..l {
                    k[j * d + c] = at(ko + c, j);
                    v[j * d + c] = at(vo + c, j);
                }
            }
            for i in 0..l {
                let qi = &q[i * d..(i + 1) * d];
                let mut max = f32::NEG_INFINITY;
                for (n, s) in p.iter_mut().enumerate() {
                    *s = dot(qi, &k[n * d..(n + 1) * d]);
                    max = max.max(*s);
                }
                let mut total = 0f32;
                for s in p.iter_mut() {
                    *s = exp_f32(*s - max);
                    total += *s;
                }
                let o = &mut out[i * h + head * d..i * h + (head + 1) * d];
                for (n, s) in p.iter().enumerate() {
                    let w = s / total;
                    for (o, x) in o.iter_mut().zip(&v[n * d..(n + 1) * d]) {
                        *o += w * x;
                    }
                }
            }
        }
        out
    }
}

impl Attention {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sequence_avx2(&self, qkv: &[f32], t: usize, col: usize, l: usize) -> Vec<f32> {
        self.sequence(qkv, t, col, l)
    }
}

/// Dot product with eight independent partial sums, so that it vectorises
/// (a plain `.sum()` adds one product at a time, in order).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

impl CustomOp2 for Attention {
    fn name(&self) -> &'static str {
        "bert-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let qkv = contiguous(s1, l1, "bert-attention")?;
        let lens: Vec<usize> = match (s2, l2.contiguous_offsets()) {
            (CpuStorage::U32(v), Some((a, b))) => v[a..b].iter().map(|&n| n as usize).collect(),
            _ => candle_core::bail!("bert-attention: lengths must be contiguous u32"),
        };
        let (h3, t) = l1.shape().dims2()?;
        let h = h3 / 3;
        if lens.iter().sum::<usize>() != t || h3 != self.qkv_bias.len() || h % self.heads != 0 {
            candle_core::bail!("bert-attention: shapes {:?} / lengths {lens:?}", l1.dims());
        }
        let starts: Vec<usize> = lens
            .iter()
            .scan(0, |acc, &n| {
                let s = *acc;
                *acc += n;
                Some(s)
            })
            .collect();
        let fast = avx2();
        let per_seq: Vec<Vec<f32>> = starts
            .par_iter()
            .zip(&lens)
            .map(|(&col, &l)| {
                #[cfg(target_arch = "x86_64")]
                if fast {
                    // SAFETY: AVX2 and FMA were detected on this CPU.
                    return unsafe { self.sequence_avx2(qkv, t, col, l) };
                }
                self.sequence(qkv, t, col, l)
            })
            .collect();
        let mut out = vec![0f32; h * t];
        for (ctx, &col) in per_seq.iter().zip(&starts) {
            for (i, row) in ctx.chunks_exact(h).enumerate() {
                for (f, x) in row.iter().enumerate() {
                    out[f * t + col + i] = *x;
                }
            }
        }
        Ok((CpuStorage::F32(out), Shape::from((h, t))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_and_erf_are_accurate() {
        for i in -2000..=2000 {
            let x = i as f32 * 0.01;
            let e = exp_f32(x);
            let want = (x as f64).exp();
            assert!(
                ((e as f64 - want) / want).abs() < 5e-7,
                "exp({x}) = {e}, want {want}"
            );
        }
        // erf against a high-precision series on a grid.
        for i in -400..=400 {
            let x = i as f64 * 0.01;
            let series = {
                let (mut sum, mut term, mut n) = (0f64, x, 0);
                while term.abs() > 1e-17 && n < 200 {
                    sum += term / (2 * n + 1) as f64;
                    n += 1;
                    term *= -x * x / n as f64;
                }
                sum * 2.0 / std::f64::consts::PI.sqrt()
            };
            let got = erf_f32(x as f32) as f64;
            assert!(
                (got - series).abs() < 5e-7,
                "erf({x}) = {got}, want {series}"
            );
        }
    }

    fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 2001) as f32 / 1000.0
                    - 1.0
            })
            .collect()
    }

    /// The fused ops against Candle's own primitives on token-major data
    /// (what the layer computed before), with one padded sequence.
    #[test]
    fn fused_ops_match_candle_primitives() -> Result<()> {
        use candle_core::{Device, Tensor};
        let (b, l, heads, d) = (2, 5, 3, 4);
        let (h, t, dev) = (heads * d, b * l, Device::Cpu);
        let qkv = Tensor::from_vec(pseudo(t * 3 * h, 7), (b, l, 3 * h), &dev)?;
        let bias = pseudo(3 * h, 11);
        let mask = Tensor::from_vec(vec![1f32, 1., 1., 1., 1., 1., 1., 0., 0., 0.], (b, l), &dev)?;
        // Candle: bias, split heads, softmax(q kᵀ / √d + additive mask) v.
        let with_bias = qkv.broadcast_add(&Tensor::from_vec(bias.clone(), 3 * h, &dev)?)?;
        let split = |i: usize| -> Result<Tensor> {
            with_bias
                .narrow(2, i * h, h)?
                .reshape((b, l, heads, d))?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (split(0)?, split(1)?, split(2)?);
        let add_mask =
            ((mask.ones_like()? - &mask)? * f64::from(f32::MIN))?.reshape((b, 1, 1, l))?;
        let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?.broadcast_add(&add_mask)?;
        let want = candle_nn::ops::softmax_last_dim(&scores)?
            .matmul(&v)?
            .transpose(1, 2)?
            .contiguous()?
            .reshape((t, h))?;
        // Fused: only the 7 real tokens, packed, with the lengths [5, 2].
        let real = Tensor::new(&[0u32, 1, 2, 3, 4, 5, 6], &dev)?;
        let fused = qkv
            .reshape((t, 3 * h))?
            .index_select(&real, 0)?
            .t()?
            .contiguous()?
            .apply_op2_no_bwd(
                &Tensor::new(&[5u32, 2], &dev)?,
                &Attention {
                    heads,
                    qkv_bias: bias,
                },
            )?
            .t()?;
        let want = want.index_select(&real, 0)?;
        let diff = (fused - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "attention differs by {diff}");

        // Bias + residual + layer norm, and bias + GELU.
        let y = Tensor::from_vec(pseudo(t * h, 3), (t, h), &dev)?;
        let r = Tensor::from_vec(pseudo(t * h, 5), (t, h), &dev)?;
        let (nb, g, be) = (pseudo(h, 13), pseudo(h, 17), pseudo(h, 19));
        let vec = |x: &Vec<f32>| Tensor::from_vec(x.clone(), h, &dev);
        let x = ((y.broadcast_add(&vec(&nb)?)? + &r)?).contiguous()?;
        let want = candle_nn::ops::layer_norm(&x, &vec(&g)?, &vec(&be)?, 1e-12)?;
        let op = BiasResidualNorm {
            bias: nb.clone(),
            gamma: g,
            beta: be,
            eps: 1e-12,
        };
        let fused = y
            .t()?
            .contiguous()?
            .apply_op2_no_bwd(&r.t()?.contiguous()?, &op)?
            .t()?;
        let diff = (fused - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "layer norm differs by {diff}");
        let want = y.broadcast_add(&vec(&nb)?)?.gelu_erf()?;
        let fused = y
            .t()?
            .contiguous()?
            .apply_op1_no_bwd(&BiasGelu { bias: nb })?
            .t()?;
        let diff = (fused - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "gelu differs by {diff}");
        Ok(())
    }
}
