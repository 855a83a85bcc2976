//! bf16 weight products for the BERT stages (`weights = "bf16"`): `W · X`
//! with the weights and the activations rounded to bfloat16 and every
//! product summed in f32.
//!
//! Why written here: the embedding stages spend about two thirds of their
//! cycles in f32 GEMM (`benchmark_results/peers.md`), and neither Candle
//! nor the `gemm` crate has a bf16 CPU product that uses the AVX-512 BF16
//! instruction `vdpbf16ps` (two bf16 multiply-adds per f32 lane, twice the
//! f32 FMA rate on the same execution units). A bf16 × bf16 product is
//! exact in f32 (8 + 8 significant bits), so the only rounding is of the
//! inputs to 8 significant bits and the f32 summation; measured on
//! all-MiniLM-L6-v2 the sentence embeddings keep cosine ≥ 0.9999 to the
//! f32 ones (`enclave-stage/tests/reference.rs`, `benchmark_results/`).
//!
//! Kernels, chosen once at load ([`Kernel::detect`]):
//! - **AVX-512 BF16** (x86-64 with `avx512bf16`, e.g. AMD Zen 4, Intel
//!   Sapphire Rapids): a register tile of [`MR`] weight rows × 32 tokens.
//!   The activations, feature-major `[k, tokens]`, are packed per call into
//!   pairs of consecutive features (one 32-bit word per token and pair, 16
//!   tokens per vector); each weight pair is broadcast and multiplied into
//!   the 16-token vectors, so every accumulator is 16 consecutive outputs
//!   of one row, stored as they lie in the feature-major result.
//! - **portable** (every other CPU): the same rounded values through
//!   Candle's f32 GEMM, so the results equal the AVX-512 kernel's up to the
//!   f32 summation order (and the tests use it as the reference). It is no
//!   faster than f32 weights: on such CPUs configure `weights = "f32"`.
//!
//! Each output element is one dot product summed in the same order however
//! the batch is made up, so a sentence's embedding does not depend on what
//! it was batched with.

use super::contiguous;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Weight rows per register tile.
pub const MR: usize = 12;
/// Tokens per vector (16 f32 lanes).
const LANES: usize = 16;
/// Products smaller than this many multiply-adds run on the calling thread.
const PARALLEL_MIN_MACS: usize = 1 << 20;

/// Which kernel runs the products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Candle's f32 GEMM on the bf16-rounded values (any CPU).
    Portable,
    /// x86-64 AVX-512 F + BF16 (`vdpbf16ps`).
    Avx512Bf16,
}

impl Kernel {
    /// The fastest kernel this CPU supports.
    pub fn detect() -> Self {
        if super::CpuFeatures::get().avx512_bf16 {
            Kernel::Avx512Bf16
        } else {
            Kernel::Portable
        }
    }

    /// Its name, for logs.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Portable => "portable",
            Kernel::Avx512Bf16 => "avx512bf16",
        }
    }
}

/// `x` rounded to the nearest bfloat16 (ties to even), as its 16 bits.
#[inline(always)]
fn bf16_bits(x: f32) -> u32 {
    let u = x.to_bits();
    (u + 0x7fff + ((u >> 16) & 1)) >> 16
}

/// A weight matrix `[rows, cols]` held as bf16, applied as `W · X` to
/// feature-major activations `X` (`[cols, tokens]`).
#[derive(Clone, Debug)]
pub struct Bf16Matrix {
    rows: usize,
    cols: usize,
    held: Held,
}

/// The rounded weights in the layout their kernel reads.
#[derive(Clone, Debug)]
enum Held {
    /// [`Kernel::Avx512Bf16`]: row tiles of [`MR`] rows (the last padded
    /// with zero rows), each `[pairs][MR]` words: the bf16 of column `2p`
    /// in the low half, of column `2p + 1` (zero past the end) in the high.
    Packed(Vec<u32>),
    /// [`Kernel::Portable`]: the rounded weights as an f32 `[rows, cols]` tensor.
    Rounded(Tensor),
}

impl Bf16Matrix {
    /// Rounds an f32 `[rows, cols]` weight to bf16 for `kernel`.
    pub fn new(w: &Tensor, kernel: Kernel) -> Result<Self> {
        if kernel == Kernel::Avx512Bf16 && Kernel::detect() != kernel {
            candle_core::bail!("this CPU has no AVX-512 BF16");
        }
        let (rows, cols) = w.dims2()?;
        let v = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let held = match kernel {
            Kernel::Portable => {
                let r: Vec<f32> = v
                    .iter()
                    .map(|&x| f32::from_bits(bf16_bits(x) << 16))
                    .collect();
                Held::Rounded(Tensor::from_vec(r, (rows, cols), w.device())?)
            }
            Kernel::Avx512Bf16 => {
                let pairs = cols.div_ceil(2);
                let tiles = rows.div_ceil(MR);
                let mut packed = vec![0u32; tiles * pairs * MR];
                let at = |r: usize, c: usize| {
                    if c < cols {
                        bf16_bits(v[r * cols + c])
                    } else {
                        0
                    }
                };
                for r in 0..rows {
                    let (t, i) = (r / MR, r % MR);
                    for p in 0..pairs {
                        packed[(t * pairs + p) * MR + i] = at(r, 2 * p) | (at(r, 2 * p + 1) << 16);
                    }
                }
                Held::Packed(packed)
            }
        };
        Ok(Self { rows, cols, held })
    }

    /// The kernel that runs its products.
    pub fn kernel(&self) -> Kernel {
        match self.held {
            Held::Packed(_) => Kernel::Avx512Bf16,
            Held::Rounded(_) => Kernel::Portable,
        }
    }

    /// `W · x` for feature-major `x` (`[cols, tokens]`, f32): `[rows, tokens]`.
    pub fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        match &self.held {
            Held::Rounded(w) => w.matmul(&x.to_dtype(DType::BF16)?.to_dtype(DType::F32)?),
            Held::Packed(_) => x.apply_op1_no_bwd(self),
        }
    }

    /// The AVX-512 path on plain slices: `x` is `[cols, n]`, row-major.
    fn run_packed(&self, packed: &[u32], x: &[f32], n: usize) -> Vec<f32> {
        let pairs = self.cols.div_ceil(2);
        let parallel = self.rows * self.cols * n >= PARALLEL_MIN_MACS;
        // Tokens in groups of 16, the last group padded with zeros:
        // `xp[(g · pairs + p) · 16 + j]` packs features 2p and 2p+1 of
        // token 16g + j.
        let groups = n.div_ceil(LANES);
        let mut xp = vec![0u32; groups * pairs * LANES];
        let pack = |(g, dst): (usize, &mut [u32])| {
            let t0 = g * LANES;
            let width = LANES.min(n - t0);
            for p in 0..pairs {
                let lo = &x[2 * p * n + t0..][..width];
                let d = &mut dst[p * LANES..][..width];
                if 2 * p + 1 < self.cols {
                    let hi = &x[(2 * p + 1) * n + t0..][..width];
                    for ((d, &a), &b) in d.iter_mut().zip(lo).zip(hi) {
                        *d = bf16_bits(a) | (bf16_bits(b) << 16);
                    }
                } else {
                    for (d, &a) in d.iter_mut().zip(lo) {
                        *d = bf16_bits(a);
                    }
                }
            }
        };
        if parallel {
            xp.par_chunks_mut(pairs * LANES).enumerate().for_each(pack);
        } else {
            xp.chunks_mut(pairs * LANES).enumerate().for_each(pack);
        }
        let mut out = vec![0f32; self.rows * n];
        let tile_len = MR * n;
        let run = |(t, dst): (usize, &mut [f32])| {
            let w = &packed[t * pairs * MR..][..pairs * MR];
            // SAFETY: this kernel is only chosen when the CPU has AVX-512 F
            // and BF16 (`Kernel::detect`); the slices hold the packed
            // layouts `tile` reads (checked there).
            #[cfg(target_arch = "x86_64")]
            unsafe {
                avx512::tile_rows(w, &xp, pairs, groups, n, dst)
            }
            #[cfg(not(target_arch = "x86_64"))]
            unreachable!("the AVX-512 kernel on {w:p} {dst:p}")
        };
        if parallel {
            out.par_chunks_mut(tile_len).enumerate().for_each(run);
        } else {
            out.chunks_mut(tile_len).enumerate().for_each(run);
        }
        out
    }
}

impl CustomOp1 for Bf16Matrix {
    fn name(&self) -> &'static str {
        "bf16-matmul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (k, n) = l.shape().dims2()?;
        if k != self.cols {
            candle_core::bail!(
                "bf16 matmul: input has {k} features, the weight {}",
                self.cols
            );
        }
        let Held::Packed(packed) = &self.held else {
            candle_core::bail!("bf16 matmul: the portable weights run through Candle's GEMM");
        };
        let x = contiguous(s, l, "bf16 matmul")?;
        let out = self.run_packed(packed, x, n);
        Ok((CpuStorage::F32(out), Shape::from((self.rows, n))))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{LANES, MR};
    use std::arch::x86_64::*;

    /// One row tile: `dst` is its rows of the `[rows, n]` output (fewer
    /// than [`MR`] for the last tile), `w` its packed `[pairs][MR]` words,
    /// `xp` the packed activations (`groups` of 16 tokens).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F and BF16.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn tile_rows(
        w: &[u32],
        xp: &[u32],
        pairs: usize,
        groups: usize,
        n: usize,
        dst: &mut [f32],
    ) {
        assert!(w.len() == pairs * MR && xp.len() == groups * pairs * LANES);
        let rows = dst.len() / n;
        assert!(rows <= MR && dst.len() == rows * n);
        let mut g = 0;
        while g + 2 <= groups {
            let acc = block::<2>(w, xp, pairs, g);
            store::<2>(&acc, dst, rows, n, g);
            g += 2;
        }
        if g < groups {
            let acc = block::<1>(w, xp, pairs, g);
            store::<1>(&acc, dst, rows, n, g);
        }
    }

    /// `MR` rows × `J` groups of 16 tokens, over every pair of features.
    #[inline(always)]
    unsafe fn block<const J: usize>(
        w: &[u32],
        xp: &[u32],
        pairs: usize,
        g: usize,
    ) -> [[__m512; J]; MR] {
        let mut acc = [[_mm512_setzero_ps(); J]; MR];
        let wp = w.as_ptr();
        let xs: [*const u32; J] = std::array::from_fn(|j| xp.as_ptr().add((g + j) * pairs * LANES));
        for p in 0..pairs {
            let xv: [__m512bh; J] = std::array::from_fn(|j| {
                std::mem::transmute(_mm512_loadu_si512(xs[j].add(p * LANES).cast()))
            });
            let wrow = wp.add(p * MR);
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let wb: __m512bh = std::mem::transmute(_mm512_set1_epi32(*wrow.add(r) as i32));
                for j in 0..J {
                    acc_r[j] = _mm512_dpbf16_ps(acc_r[j], wb, xv[j]);
                }
            }
        }
        acc
    }

    /// Writes a block's accumulators into the rows of `dst` (masked at the
    /// last, partial group of tokens).
    #[inline(always)]
    unsafe fn store<const J: usize>(
        acc: &[[__m512; J]; MR],
        dst: &mut [f32],
        rows: usize,
        n: usize,
        g: usize,
    ) {
        for (r, acc_r) in acc.iter().enumerate().take(rows) {
            for (j, a) in acc_r.iter().enumerate() {
                let t0 = (g + j) * LANES;
                let width = LANES.min(n - t0);
                let out = dst.as_mut_ptr().add(r * n + t0);
                if width == LANES {
                    _mm512_storeu_ps(out, *a);
                } else {
                    _mm512_mask_storeu_ps(out, ((1u32 << width) - 1) as u16, *a);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The exact products of the rounded values, summed in f64.
    fn reference(w: &[f32], x: &[f32], rows: usize, cols: usize, n: usize) -> Vec<f64> {
        let r = |v: f32| f32::from_bits(bf16_bits(v) << 16) as f64;
        let mut out = vec![0f64; rows * n];
        for i in 0..rows {
            for t in 0..n {
                out[i * n + t] = (0..cols)
                    .map(|c| r(w[i * cols + c]) * r(x[c * n + t]))
                    .sum();
            }
        }
        out
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even 1.
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties up.
        assert_eq!(bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(bf16_bits(-2.5), 0xc020);
        // Agrees with Candle's (the `half` crate's) conversion.
        for v in pseudo(1000, 9) {
            let t = Tensor::new(&[v * 1000.0], &Device::Cpu).unwrap();
            let c = t
                .to_dtype(DType::BF16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let c = c.to_vec1::<f32>().unwrap()[0];
            assert_eq!(c.to_bits() >> 16, bf16_bits(v * 1000.0), "{v}");
        }
    }

    #[test]
    fn every_kernel_matches_the_rounded_product() -> Result<()> {
        let kernels: Vec<Kernel> = [Kernel::Portable, Kernel::detect()].into_iter().collect();
        // Shapes with partial row tiles, odd feature counts, partial and
        // single token groups, and BERT's own.
        for &(rows, cols, n) in &[
            (1, 1, 1),
            (13, 7, 1),
            (12, 32, 15),
            (25, 33, 17),
            (24, 64, 33),
            (384, 384, 100),
            (1536, 384, 48),
            (384, 1536, 31),
        ] {
            let w = pseudo(rows * cols, rows as u32);
            let x = pseudo(cols * n, n as u32 + 7);
            let want = reference(&w, &x, rows, cols, n);
            let wt = Tensor::from_vec(w, (rows, cols), &Device::Cpu)?;
            let xt = Tensor::from_vec(x, (cols, n), &Device::Cpu)?;
            for &k in &kernels {
                let m = Bf16Matrix::new(&wt, k)?;
                let got = m.matmul(&xt)?;
                assert_eq!(got.dims(), &[rows, n]);
                let got = got.flatten_all()?.to_vec1::<f32>()?;
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    // f32 summation of `cols` terms of magnitude ≤ 1.
                    let tol = 1e-6 * cols as f64 + 1e-6 * e.abs();
                    assert!(
                        (*g as f64 - e).abs() <= tol,
                        "{} {rows}x{cols}x{n} at {i}: {g} vs {e}",
                        k.name()
                    );
                }
            }
        }
        Ok(())
    }

    #[test]
    fn rounding_costs_what_bf16_should() -> Result<()> {
        // Against the unrounded f32 product: relative error of a dot
        // product of 384 random terms stays near 2^-8 / sqrt(384).
        let (rows, cols, n) = (64, 384, 40);
        let w = pseudo(rows * cols, 3);
        let x = pseudo(cols * n, 4);
        let wt = Tensor::from_vec(w, (rows, cols), &Device::Cpu)?;
        let xt = Tensor::from_vec(x, (cols, n), &Device::Cpu)?;
        let exact = wt.matmul(&xt)?.flatten_all()?.to_vec1::<f32>()?;
        let got = Bf16Matrix::new(&wt, Kernel::detect())?
            .matmul(&xt)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let norm = |v: &[f32]| v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
        let diff: Vec<f32> = got.iter().zip(&exact).map(|(a, b)| a - b).collect();
        let rel = norm(&diff) / norm(&exact);
        assert!(rel > 1e-5 && rel < 1e-2, "relative error {rel}");
        Ok(())
    }

    #[test]
    fn a_token_s_result_does_not_depend_on_its_batch() -> Result<()> {
        let (rows, cols) = (40, 96);
        let wt = Tensor::from_vec(pseudo(rows * cols, 5), (rows, cols), &Device::Cpu)?;
        if Kernel::detect() == Kernel::Portable {
            // Candle's GEMM makes no such promise.
            return Ok(());
        }
        let m = Bf16Matrix::new(&wt, Kernel::detect())?;
        let n = 37;
        let xt = Tensor::from_vec(pseudo(cols * n, 6), (cols, n), &Device::Cpu)?;
        let all = m.matmul(&xt)?;
        for t in [0, 16, 36] {
            let one = m.matmul(&xt.narrow(1, t, 1)?.contiguous()?)?;
            let col = all.narrow(1, t, 1)?;
            let d = (one - col)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert_eq!(d, 0.0, "token {t}");
        }
        Ok(())
    }
}
