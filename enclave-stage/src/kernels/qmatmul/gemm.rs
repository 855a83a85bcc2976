//! Prefill products on AVX-512 VNNI: a block-quantized matrix times many
//! activation rows as a register-tiled integer GEMM
//! ([`QMatrix::matmul_t_prefill`]).
//!
//! Why written here: a prefill multiplies every weight by hundreds of
//! activation rows, so it is bound by arithmetic, not by memory. The f32
//! GEMM the other CPUs use (the matrix dequantized for the product) does 16
//! multiply-adds per instruction; `vpdpwssd` does 32 (i16 × i16 pairs summed
//! into i32 lanes), and no crate offers a GEMM on block-quantized weights
//! that keeps 16-bit activations.
//!
//! - **Weights**: the integers the file holds, as they are (Q8_0's int8,
//!   the 4-bit blocks' nibbles, Q6_K's 6-bit values times their 8-bit
//!   half-block scales), widened to i16 once per product into a panel of
//!   [`PANEL`] rows, lanes by row. So a weight's value is exactly the
//!   decode kernels' and the dequantized matrix's.
//! - **Activations**: rounded per 32-value block to i16 of at most
//!   ±[`ACT_MAX`] (relative error ≤ 2⁻¹⁵ of the block's largest value, the
//!   decode kernels' kind of rounding with one bit less), so that 32
//!   products of Q6_K's widest integers (|(q − 32) · sc| ≤ 4096) stay
//!   within an i32 lane.
//! - Each block's integer sum is converted once and multiplied by the
//!   weight block's scale times the activation block's; the 4-bit blocks'
//!   min term adds `m · Σx` with the exact f32 block sums.
//!
//! Register tile: [`PANEL`] weight rows (two vectors of 16 lanes) × up to
//! [`NR`] activation rows. Per pair of features: two panel loads, one
//! broadcast per activation row of its two i16 values (a 32-bit word, as
//! they lie in the rounded row), two `vpdpwssd` per activation row; per
//! block, each integer accumulator is converted and scaled into an f32 one.

use super::blocks::Blocks;
use super::{QMatrix, SendPtr, BLOCK};
use rayon::prelude::*;

/// Weight rows per panel (two vectors of 16 i32 lanes).
const PANEL: usize = 32;
/// Activation rows per register tile.
const NR: usize = 4;
/// Pairs of values per block.
const PAIRS: usize = BLOCK / 2;
/// The largest rounded activation (see the module comment).
const ACT_MAX: f32 = 16383.0;

/// Activation rows rounded for the kernel: `q` `[m, cols]`, and per block
/// its scale `d` and its exact f32 sum (the 4-bit blocks' min term),
/// `[m, cols / 32]` each.
struct Rounded {
    q: Vec<i16>,
    d: Vec<f32>,
    sums: Vec<f32>,
}

/// Rounds activation rows per 32-value block to ±[`ACT_MAX`].
fn round_rows(x: &[f32]) -> Rounded {
    let blocks = x.len() / BLOCK;
    let mut q = vec![0i16; x.len()];
    let mut d = vec![0f32; blocks];
    let mut sums = vec![0f32; blocks];
    x.par_chunks_exact(BLOCK)
        .zip(q.par_chunks_exact_mut(BLOCK))
        .zip(d.par_iter_mut().zip(sums.par_iter_mut()))
        .with_min_len(1024)
        .for_each(|((x, q), (d, sum))| {
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            *d = amax / ACT_MAX;
            let inv = if *d > 0.0 { 1.0 / *d } else { 0.0 };
            // Clamped: a block whose largest value is below ~5e-35 has an
            // infinite `inv`, and its values must still stay within
            // ±ACT_MAX (a NaN becomes 0, as in the decode kernels).
            for (q, v) in q.iter_mut().zip(x) {
                *q = (v * inv).round().clamp(-ACT_MAX, ACT_MAX) as i16;
            }
            *sum = x.iter().sum();
        });
    Rounded { q, d, sums }
}

/// [`PANEL`] weight rows widened for the kernel: per block and pair of
/// values `p`, one 32-bit word per row (`v[2p]` low, `v[2p + 1]` high);
/// per block, each row's scale and (4-bit blocks) min. Rows past the
/// matrix are zero.
struct Panel {
    w: Vec<i32>,
    d: Vec<f32>,
    m: Vec<f32>,
}

impl QMatrix {
    /// Row `r`'s block `b` as the integers the file holds (i16), with the
    /// scale and the min (0 but for the 4-bit blocks) that give its values:
    /// `w = scale · v + min`.
    pub(super) fn block_ints(&self, r: usize, b: usize) -> ([i16; BLOCK], f32, f32) {
        let bi = self.at(r, b);
        let mut v = [0i16; BLOCK];
        match &self.blocks {
            Blocks::Q8_0 { qs, d } => {
                let q: &[i8; BLOCK] = qs[bi * BLOCK..][..BLOCK].try_into().expect("a block");
                for (o, &q) in v.iter_mut().zip(q) {
                    *o = q as i16;
                }
                (v, d[bi], 0.0)
            }
            Blocks::Q4_1 { qs, scales } => {
                let (d, m) = scales.dm(bi);
                let bytes: &[u8; 16] = qs[bi * 16..][..16].try_into().expect("a block");
                let (lo, hi) = v.split_at_mut(16);
                for ((lo, hi), &q) in lo.iter_mut().zip(hi).zip(bytes) {
                    *lo = (q & 0x0f) as i16;
                    *hi = (q >> 4) as i16;
                }
                (v, d, m)
            }
            Blocks::Q6 { .. } => {
                let (codes, sc, d) = self.q6_codes(bi);
                for (e, (o, &q)) in v.iter_mut().zip(&codes).enumerate() {
                    *o = (q as i16 - 32) * sc[e / 16] as i16;
                }
                (v, d, 0.0)
            }
        }
    }

    /// Rows `r0..r0 + PANEL` (those of the matrix) widened into a panel.
    fn panel(&self, r0: usize) -> Panel {
        let nb = self.cols / BLOCK;
        let four_bit = matches!(self.blocks, Blocks::Q4_1 { .. });
        let mut p = Panel {
            w: vec![0i32; nb * PAIRS * PANEL],
            d: vec![0f32; nb * PANEL],
            m: if four_bit {
                vec![0f32; nb * PANEL]
            } else {
                Vec::new()
            },
        };
        for r in 0..PANEL.min(self.rows - r0) {
            for b in 0..nb {
                let (v, d, m) = self.block_ints(r0 + r, b);
                let words = &mut p.w[b * PAIRS * PANEL..][..PAIRS * PANEL];
                for (i, pair) in v.chunks_exact(2).enumerate() {
                    words[i * PANEL + r] =
                        (pair[0] as u16 as u32 | (pair[1] as u16 as u32) << 16) as i32;
                }
                p.d[b * PANEL + r] = d;
                if four_bit {
                    p.m[b * PANEL + r] = m;
                }
            }
        }
        p
    }

    /// `out = x · Wᵀ` for many activation rows (`x` = `[m, cols]`, `out` =
    /// `[m, rows]`) with the AVX-512 VNNI integer GEMM: panels of rows
    /// split across the thread pool, each multiplied with every activation
    /// row.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VNNI (`Kernel::Avx512`).
    #[cfg(target_arch = "x86_64")]
    pub unsafe fn matmul_t_prefill(&self, x: &[f32], out: &mut [f32]) {
        let (n, k) = (self.rows, self.cols);
        assert!(x.len().is_multiple_of(k), "activation width");
        let m = x.len() / k;
        assert_eq!(out.len(), m * n, "output shape");
        let a = round_rows(x);
        let (ptr, len) = (SendPtr(out.as_mut_ptr()), out.len());
        (0..n.div_ceil(PANEL)).into_par_iter().for_each(|pi| {
            let r0 = pi * PANEL;
            let valid = (n - r0).min(PANEL);
            let panel = self.panel(r0);
            let mut tile = [[0f32; PANEL]; NR];
            let mut t0 = 0;
            while t0 < m {
                let rows = (m - t0).min(NR);
                // SAFETY: the caller guarantees the CPU features; `tile`
                // checks the slices it reads.
                unsafe {
                    match rows {
                        4 => tile_product::<4>(&panel, &a, k, t0, &mut tile),
                        3 => tile_product::<3>(&panel, &a, k, t0, &mut tile),
                        2 => tile_product::<2>(&panel, &a, k, t0, &mut tile),
                        _ => tile_product::<1>(&panel, &a, k, t0, &mut tile),
                    }
                }
                for (j, t) in tile.iter().enumerate().take(rows) {
                    let at = (t0 + j) * n + r0;
                    assert!(at + valid <= len, "output columns in bounds");
                    // SAFETY: in bounds (above); no other task writes
                    // columns `r0..r0 + valid` (one panel per task), and the
                    // output outlives the parallel loop.
                    unsafe { std::ptr::copy_nonoverlapping(t.as_ptr(), ptr.get().add(at), valid) };
                }
                t0 += rows;
            }
        });
    }
}

/// Activation rows `t0..t0 + N` times one panel into `out[..N]`.
///
/// # Safety
/// The CPU must have AVX-512 F, BW and VNNI.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tile_product<const N: usize>(
    panel: &Panel,
    a: &Rounded,
    k: usize,
    t0: usize,
    out: &mut [[f32; PANEL]; NR],
) {
    use std::arch::x86_64::*;
    let nb = k / BLOCK;
    assert!(N <= NR && a.q.len() >= (t0 + N) * k && a.d.len() >= (t0 + N) * nb);
    assert!(panel.w.len() == nb * PAIRS * PANEL && panel.d.len() == nb * PANEL);
    let mins = !panel.m.is_empty();
    assert!(!mins || (panel.m.len() == nb * PANEL && a.sums.len() >= (t0 + N) * nb));
    let mut f = [[_mm512_setzero_ps(); 2]; N];
    let w = panel.w.as_ptr();
    let x = a.q.as_ptr().add(t0 * k);
    for b in 0..nb {
        let mut acc = [[_mm512_setzero_si512(); 2]; N];
        let wb = w.add(b * PAIRS * PANEL);
        for p in 0..PAIRS {
            let w0 = _mm512_loadu_si512(wb.add(p * PANEL) as *const __m512i);
            let w1 = _mm512_loadu_si512(wb.add(p * PANEL + 16) as *const __m512i);
            for (j, acc) in acc.iter_mut().enumerate() {
                // Values 2p and 2p + 1 of row j's block b, as one word.
                let pair = (x.add(j * k + b * BLOCK + 2 * p) as *const i32).read_unaligned();
                let xv = _mm512_set1_epi32(pair);
                acc[0] = _mm512_dpwssd_epi32(acc[0], w0, xv);
                acc[1] = _mm512_dpwssd_epi32(acc[1], w1, xv);
            }
        }
        let d = [
            _mm512_loadu_ps(panel.d.as_ptr().add(b * PANEL)),
            _mm512_loadu_ps(panel.d.as_ptr().add(b * PANEL + 16)),
        ];
        for (j, (f, acc)) in f.iter_mut().zip(&acc).enumerate() {
            let t = t0 + j;
            let s = _mm512_set1_ps(*a.d.get_unchecked(t * nb + b));
            for ((f, acc), d) in f.iter_mut().zip(acc).zip(d) {
                *f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*acc), _mm512_mul_ps(d, s), *f);
            }
            if mins {
                let sum = _mm512_set1_ps(*a.sums.get_unchecked(t * nb + b));
                for (h, f) in f.iter_mut().enumerate() {
                    let m = _mm512_loadu_ps(panel.m.as_ptr().add(b * PANEL + 16 * h));
                    *f = _mm512_fmadd_ps(m, sum, *f);
                }
            }
        }
    }
    for (o, f) in out.iter_mut().zip(&f) {
        _mm512_storeu_ps(o.as_mut_ptr(), f[0]);
        _mm512_storeu_ps(o.as_mut_ptr().add(16), f[1]);
    }
}
