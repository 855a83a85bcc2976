//! Block-quantized weight matrices and their products with f32 activations,
//! for the Llama stages (`WeightFormat::Q8_0` and `WeightFormat::Q4_1`).
//! Three block kinds are held: Q8_0, 4-bit (Q4_1's nibbles, with the scales
//! of Q4_0 and Q4_1 per block in f32 or Q4_K's 6-bit ones per block and f32
//! per super-block, [`Scales4`]) and 6-bit (Q6_K's). A GGUF's Q4_0, Q4_K
//! and Q6_K blocks are repacked with the same values
//! ([`QMatrix::from_ggml_q4_0`], [`QMatrix::from_ggml_q4_k`],
//! [`QMatrix::from_ggml_q6_k`]); keeping the file's own bits matters because
//! a decode step reads every weight once and is bound by memory. Reading a
//! GGUF's blocks is [`ggml`]'s; this module holds the blocks and multiplies
//! them.
//!
//! Why written here and not taken from Candle: Candle 0.11's quantized CPU
//! matmul computes one dot product at a time and rounds the activations to
//! int8 blocks (as llama.cpp does); its Q4_1 dot product is scalar (8-12
//! tokens/s on the reference machine), and the int8 rounding of the
//! activations alone moved 4-5 % of SmolLM2's greedy top-1 choices away
//! from the f32 weights' on our quality text (benchmark_results/quality.md).
//! Here the **weights** stay quantized in memory (what decoding is bound
//! by: every token reads all of them); the portable kernel widens them to
//! f32 and keeps the activations f32, and the AVX2 kernel rounds each
//! 32-value block of activations to **16-bit** integers (relative error
//! ≤ 2⁻¹⁶ of the block's largest value, some 500× finer than int8) so
//! that weights × activations run as integer multiply-adds
//! (`vpmaddwd`: 16 products per instruction, no float conversion per
//! weight). A product with a quantized matrix is then the f32 product with
//! the dequantized matrix up to that rounding and the summation order, so
//! the quality cost is the weights' own rounding
//! (benchmark_results/quality.md measures it).
//!
//! - [`QMatrix::matmul_t`] for a few activation rows (decode steps): four
//!   weight rows at a time share every load of an activation row; the
//!   output columns are split across Rayon's threads for large products.
//! - Many rows (prefills): on AVX-512 VNNI, an integer GEMM on the blocks'
//!   own integers ([`gemm`], [`QMatrix::matmul_t_prefill`]); elsewhere the
//!   caller dequantizes the matrix for that product
//!   ([`QMatrix::dequantize`]) and uses an f32 GEMM. Both re-use each
//!   weight across rows better than a dot-product kernel can.
//!
//! Kernels, chosen once at run time ([`Kernel::detect`]):
//! - **AVX-512 VNNI** (x86-64, [`avx512`]): the same i16 activations, 32
//!   products per `vpdpwssd` with the sum folded in, weights widened by
//!   shifts and masks (no shuffles), one 64-byte load per block of a group;
//! - **AVX2 + FMA** (x86-64): 16 int8 (Q8_0) or 16 nibbles (Q4_1) widened
//!   to i16 per instruction and multiplied with the i16 activations in pairs
//!   (`vpmaddwd`), the product of the two block scales applied once per 32
//!   values in f32;
//! - **portable** (every target): the same sums in plain Rust, also the
//!   reference the SIMD kernels are tested against.

use super::CpuFeatures;
use blocks::{block_index, super_index, Blocks, Scales4, GROUP};
use rayon::prelude::*;

mod avx2;
mod avx512;
mod blocks;
mod gemm;
mod ggml;

/// Values per quantization block (Q8_0 and Q4_1 alike).
pub const BLOCK: usize = 32;

/// Products smaller than this many multiply-adds run on the calling thread.
const PARALLEL_MIN_MACS: usize = 64 << 10;

/// Which kernel runs the dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust (any CPU).
    Portable,
    /// x86-64 AVX2 + FMA.
    Avx2,
    /// x86-64 AVX-512 F + BW + VNNI ([`avx512`]).
    Avx512,
}

impl Kernel {
    /// The fastest kernel this CPU supports.
    pub fn detect() -> Self {
        let cpu = CpuFeatures::get();
        if cpu.avx512_vnni {
            Kernel::Avx512
        } else if cpu.avx2_fma {
            Kernel::Avx2
        } else {
            Kernel::Portable
        }
    }

    /// Every kernel this CPU can run, the portable one first.
    pub fn available() -> Vec<Self> {
        let cpu = CpuFeatures::get();
        let mut all = vec![Kernel::Portable];
        if cpu.avx2_fma {
            all.push(Kernel::Avx2);
        }
        if cpu.avx512_vnni {
            all.push(Kernel::Avx512);
        }
        all
    }

    /// Its name, for logs.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Portable => "portable",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512 => "avx512vnni",
        }
    }
}

/// A weight matrix `[rows, cols]` in 32-value blocks, applied as `x · Wᵀ`.
#[derive(Clone, Debug)]
pub struct QMatrix {
    /// Rows including the zero padding (a multiple of [`GROUP`]).
    padded: usize,
    rows: usize,
    cols: usize,
    blocks: Blocks,
}

fn quantize_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * inv).round() as i8;
    }
    d
}

/// Q8_0 blocks of `w` (`cols` per row): int8 values and one scale per block.
fn quantize_q8_0(w: &[f32]) -> (Vec<i8>, Vec<f32>) {
    let mut qs = vec![0i8; w.len()];
    let d = w
        .chunks_exact(BLOCK)
        .zip(qs.chunks_exact_mut(BLOCK))
        .map(|(x, q)| quantize_block(x, q))
        .collect();
    (qs, d)
}

/// Per-block sums of activation rows (the Q4_1 min term needs them).
fn block_sums(x: &[f32]) -> Vec<f32> {
    x.chunks_exact(BLOCK).map(|b| b.iter().sum()).collect()
}

/// Activation rows rounded per 32-value block to i16 (`x ≈ q · scale`),
/// for the AVX2 kernel's integer products.
fn quantize_i16(x: &[f32]) -> (Vec<i16>, Vec<f32>) {
    let mut q = vec![0i16; x.len()];
    let scales = x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .map(|(x, q)| {
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 32767.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            for (q, v) in q.iter_mut().zip(x) {
                *q = (v * inv).round() as i16;
            }
            d
        })
        .collect();
    (q, scales)
}

impl QMatrix {
    /// Quantizes `w` (`[rows, cols]`, row-major) to Q8_0: per block of 32,
    /// `d = max|w| / 127`, `q = round(w / d)`.
    pub fn q8_0(w: &[f32], rows: usize, cols: usize) -> Self {
        assert_eq!(w.len(), rows * cols, "weight shape");
        assert!(
            cols.is_multiple_of(BLOCK),
            "columns must be a multiple of {BLOCK}"
        );
        let (qs, d) = quantize_q8_0(w);
        Self::interleave(rows, cols, RowMajor::Q8_0 { qs, d })
    }

    /// Quantizes a matrix to Q8_0 as [`QMatrix::q8_0`] does, taking its
    /// rows a band at a time from `band(range)` (row-major f32 of those
    /// rows), so a large matrix stored in another type never exists whole
    /// in f32: the 49,152-row output head of a 1B model is 400 MB of f32.
    pub fn q8_0_by_bands(
        rows: usize,
        cols: usize,
        band_rows: usize,
        mut band: impl FnMut(std::ops::Range<usize>) -> Result<Vec<f32>, String>,
    ) -> Result<Self, String> {
        if !cols.is_multiple_of(BLOCK) {
            return Err(format!("{cols} columns are not whole blocks of {BLOCK}"));
        }
        let mut qs = Vec::with_capacity(rows * cols);
        let mut d = Vec::with_capacity(rows * cols / BLOCK);
        for r0 in (0..rows).step_by(band_rows.max(1)) {
            let r1 = rows.min(r0 + band_rows.max(1));
            let w = band(r0..r1)?;
            if w.len() != (r1 - r0) * cols {
                return Err(format!("rows {r0}..{r1} came back as {} values", w.len()));
            }
            let (q, s) = quantize_q8_0(&w);
            qs.extend_from_slice(&q);
            d.extend_from_slice(&s);
        }
        Ok(Self::interleave(rows, cols, RowMajor::Q8_0 { qs, d }))
    }

    /// Pads row-major blocks to whole groups and interleaves them (the
    /// K-quants are placed as read, `ggml::Placement`).
    fn interleave(rows: usize, cols: usize, row_major: RowMajor) -> Self {
        let nb = cols / BLOCK;
        let padded = rows.next_multiple_of(GROUP);
        // Copies `per` values per block to row `r`'s block `b`'s position in
        // the interleaved order.
        fn spread<T: Copy + Default>(
            src: &[T],
            per: usize,
            rows: usize,
            padded: usize,
            nb: usize,
        ) -> Vec<T> {
            let mut out = vec![T::default(); padded * nb * per];
            for r in 0..rows {
                for b in 0..nb {
                    let (from, to) = ((r * nb + b) * per, block_index(nb, r, b) * per);
                    out[to..to + per].copy_from_slice(&src[from..from + per]);
                }
            }
            out
        }
        let blocks = match row_major {
            RowMajor::Q8_0 { qs, d } => Blocks::Q8_0 {
                qs: spread(&qs, BLOCK, rows, padded, nb),
                d: spread(&d, 1, rows, padded, nb),
            },
            RowMajor::Q4 { qs, d, m } => Blocks::Q4_1 {
                qs: spread(&qs, BLOCK / 2, rows, padded, nb),
                scales: Scales4::Block {
                    d: spread(&d, 1, rows, padded, nb),
                    m: spread(&m, 1, rows, padded, nb),
                },
            },
        };
        Self {
            padded,
            rows,
            cols,
            blocks,
        }
    }

    /// Index of row `r`'s block `b` (in blocks; scales use it directly).
    fn at(&self, r: usize, b: usize) -> usize {
        block_index(self.cols / BLOCK, r, b)
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Bytes the blocks take in memory.
    pub fn bytes(&self) -> usize {
        match &self.blocks {
            Blocks::Q8_0 { qs, d } => qs.len() + d.len() * 4,
            Blocks::Q4_1 { qs, scales } => qs.len() + scales.bytes(),
            Blocks::Q6 { ql, qh, sc, d } => ql.len() + qh.len() + sc.len() + d.len() * 4,
        }
    }

    /// Row `r`, dequantized into `out` (`cols` values), a block of 32 at a
    /// time into fixed-size arrays (no per-value index arithmetic, so the
    /// loops vectorize: a prefill dequantizes every matrix once).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        let blocks = out[..self.cols].chunks_exact_mut(BLOCK);
        for (b, o) in blocks.enumerate() {
            let o: &mut [f32; BLOCK] = o.try_into().expect("a block");
            match &self.blocks {
                // ggml's own order for Q6_K: `(d · sc) · (q − 32)`.
                Blocks::Q6 { .. } => *o = self.q6_values(self.at(r, b)),
                // `d · q` (+ `m`): exact, as ggml computes them.
                _ => {
                    let (v, d, m) = self.block_ints(r, b);
                    for (o, &v) in o.iter_mut().zip(&v) {
                        *o = v as f32 * d + m;
                    }
                }
            }
        }
    }

    /// The whole matrix dequantized (`[rows, cols]`, row-major).
    pub fn dequantize(&self) -> Vec<f32> {
        self.dequantize_rows(0..self.rows)
    }

    /// Rows `range` dequantized (`[range.len(), cols]`, row-major), a band
    /// of rows per thread of the pool (a prefill dequantizes every matrix
    /// once per product: 10 % of a 512-token prefill when done on one thread).
    pub fn dequantize_rows(&self, range: std::ops::Range<usize>) -> Vec<f32> {
        let cols = self.cols;
        let mut out = vec![0f32; range.len() * cols];
        let band = range
            .len()
            .div_ceil(rayon::current_num_threads().max(1))
            .max(1);
        out.par_chunks_mut(band * cols)
            .enumerate()
            .for_each(|(i, rows)| {
                let first = range.start + i * band;
                for (j, row) in rows.chunks_exact_mut(cols).enumerate() {
                    self.dequantize_row(first + j, row);
                }
            });
        out
    }

    /// `out = x · Wᵀ` for `x` = `[m, cols]` f32 rows; `out` is `[m, rows]`.
    pub fn matmul_t(&self, x: &[f32], out: &mut [f32], kernel: Kernel) {
        Self::matmul_t_many(&[self], x, &mut [out], kernel);
    }

    /// `outs[j] = x · Wⱼᵀ` for matrices `mats` of one width that share their
    /// input (a layer's q, k and v; its gate and up): the activations are
    /// rounded for the kernels once, and the products run as one parallel
    /// loop, so a decode step pays one hand-off to the thread pool for the
    /// group instead of one per matrix.
    pub fn matmul_t_many(mats: &[&QMatrix], x: &[f32], outs: &mut [&mut [f32]], kernel: Kernel) {
        assert_eq!(mats.len(), outs.len(), "one output per matrix");
        let Some(first) = mats.first() else { return };
        let k = first.cols;
        assert!(x.len().is_multiple_of(k), "activation width");
        let m = x.len() / k;
        for (w, out) in mats.iter().zip(outs.iter()) {
            assert_eq!(w.cols, k, "matrices of one width");
            assert_eq!(out.len(), m * w.rows, "output shape");
        }
        let q6 = |w: &&QMatrix| matches!(w.blocks, Blocks::Q6 { .. });
        let sums = if mats.iter().any(|w| matches!(w.blocks, Blocks::Q4_1 { .. })) {
            block_sums(x)
        } else {
            Vec::new()
        };
        // The AVX-512 kernel, and the AVX2 kernel's Q6 blocks, read the
        // activations even elements first ([`blocks::deinterleave_blocks`]);
        // the AVX2 kernel's other blocks, in their own order.
        let (natural, even_first, xd) = match kernel {
            Kernel::Avx2 | Kernel::Avx512 => {
                let (q, d) = quantize_i16(x);
                let wants_even_first = kernel == Kernel::Avx512 || mats.iter().any(q6);
                let wants_natural = kernel == Kernel::Avx2 && !mats.iter().all(q6);
                // A copy only where a group needs both orders (AVX2 with
                // Q6 and other blocks); the AVX-512 kernel reads one.
                let (natural, mut even_first) = match (wants_natural, wants_even_first) {
                    (true, true) => (q.clone(), q),
                    (true, false) => (q, Vec::new()),
                    (false, _) => (Vec::new(), q),
                };
                if wants_even_first {
                    blocks::deinterleave_blocks(&mut even_first);
                }
                (natural, even_first, d)
            }
            Kernel::Portable => (Vec::new(), Vec::new(), Vec::new()),
        };
        let acts = |w: &QMatrix| Acts {
            x,
            sums: &sums,
            q: if kernel == Kernel::Avx512 || matches!(w.blocks, Blocks::Q6 { .. }) {
                &even_first
            } else {
                &natural
            },
            qd: &xd,
        };
        let threads = rayon::current_num_threads().max(1);
        let macs: usize = mats.iter().map(|w| m * w.rows * k).sum();
        // Handing work to the pool costs tens of microseconds (a wake-up);
        // a decode step's small matrices are done sooner on this thread.
        if threads == 1 || macs < PARALLEL_MIN_MACS {
            for (w, out) in mats.iter().zip(outs.iter_mut()) {
                w.rows_times(0..w.rows, &acts(w), out, w.rows, kernel);
            }
            return;
        }
        // Each matrix's output columns (weight rows) in one chunk per
        // thread, listed chunk by chunk so that every thread's share of the
        // list holds a part of each matrix (a decode step's products are too
        // small to balance finer).
        let outs: Vec<(SendPtr, usize)> = outs
            .iter_mut()
            .map(|o| (SendPtr(o.as_mut_ptr()), o.len()))
            .collect();
        let tasks: Vec<(usize, std::ops::Range<usize>)> = (0..threads)
            .flat_map(|c| {
                mats.iter().enumerate().filter_map(move |(j, w)| {
                    let chunk = w.rows.div_ceil(threads).next_multiple_of(GROUP);
                    let rows = c * chunk..((c + 1) * chunk).min(w.rows);
                    (!rows.is_empty()).then_some((j, rows))
                })
            })
            .collect();
        tasks.into_par_iter().with_max_len(1).for_each(|(j, rows)| {
            // Each task fills a buffer of its own ([m, rows]) and copies it
            // into its columns through the raw pointer, so no two tasks
            // hold a reference to the same output.
            let (ptr, len) = outs[j];
            let n = mats[j].rows;
            let width = rows.len();
            let mut part = vec![0f32; m * width];
            mats[j].rows_times(rows.clone(), &acts(mats[j]), &mut part, width, kernel);
            for (i, row) in part.chunks_exact(width).enumerate() {
                let at = i * n + rows.start;
                assert!(at + width <= len, "output columns in bounds");
                // SAFETY: `at + width <= len`, the output's length, and no
                // other task writes columns `rows` of matrix `j` (each
                // matrix's rows are split into disjoint ranges); the outputs
                // outlive the parallel loop.
                unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), ptr.get().add(at), width) };
            }
        });
    }

    /// Columns `rows` for every activation row of `x` into `out`, whose
    /// rows are `stride` values apart and start at column `rows.start`'s
    /// value (`rows` starts at a multiple of [`GROUP`]).
    fn rows_times(
        &self,
        rows: std::ops::Range<usize>,
        a: &Acts<'_>,
        out: &mut [f32],
        stride: usize,
        kernel: Kernel,
    ) {
        let (k, nb) = (self.cols, self.cols / BLOCK);
        let m = a.x.len() / k;
        for r in rows.clone().step_by(GROUP) {
            let valid = (rows.end - r).min(GROUP);
            for i in 0..m {
                let xr = XRow {
                    x: &a.x[i * k..(i + 1) * k],
                    sums: a.sums.get(i * nb..(i + 1) * nb).unwrap_or(&[]),
                    q: a.q.get(i * k..(i + 1) * k).unwrap_or(&[]),
                    qd: a.qd.get(i * nb..(i + 1) * nb).unwrap_or(&[]),
                };
                let d4 = self.dot4(r, &xr, kernel);
                let at = i * stride + r - rows.start;
                out[at..at + valid].copy_from_slice(&d4[..valid]);
            }
        }
    }

    /// Dot products of weight rows `r..r+4` (`r` a multiple of [`GROUP`];
    /// padding rows give 0) with one activation row.
    fn dot4(&self, r: usize, x: &XRow<'_>, kernel: Kernel) -> [f32; 4] {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Kernel::Avx2` is only chosen when the CPU has AVX2
            // and FMA; the slices are checked inside.
            Kernel::Avx2 => unsafe { self.dot4_avx2(r, x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Kernel::Avx512` is only chosen when the CPU has
            // AVX-512 F, BW and VNNI; the slices are checked inside.
            Kernel::Avx512 => unsafe { self.dot4_avx512(r, x) },
            _ => [0, 1, 2, 3].map(|j| self.dot1(r + j, x)),
        }
    }

    /// Portable dot product of weight row `r` with one activation row.
    fn dot1(&self, r: usize, x: &XRow<'_>) -> f32 {
        let mut acc = 0f32;
        for b in 0..self.cols / BLOCK {
            let bi = self.at(r, b);
            let xs = &x.x[b * BLOCK..(b + 1) * BLOCK];
            match &self.blocks {
                Blocks::Q8_0 { qs, d } => {
                    let s: f32 = qs[bi * BLOCK..(bi + 1) * BLOCK]
                        .iter()
                        .zip(xs)
                        .map(|(&a, &c)| a as f32 * c)
                        .sum();
                    acc += s * d[bi];
                }
                Blocks::Q4_1 { qs, scales } => {
                    let (d, m) = scales.dm(bi);
                    let bytes = &qs[bi * 16..bi * 16 + 16];
                    let mut s = 0f32;
                    for j in 0..16 {
                        s += (bytes[j] & 0x0f) as f32 * xs[j] + (bytes[j] >> 4) as f32 * xs[j + 16];
                    }
                    acc += s * d + m * x.sums[b];
                }
                Blocks::Q6 { .. } => {
                    let v = self.q6_values(bi);
                    acc += v.iter().zip(xs).map(|(a, b)| a * b).sum::<f32>();
                }
            }
        }
        acc
    }

    /// The 32 values of the Q6 block at interleaved index `bi`, computed as
    /// ggml's `dequantize_row_q6_K` does (`(d · sc) · (q − 32)` in f32).
    fn q6_values(&self, bi: usize) -> [f32; BLOCK] {
        let (q, sc, d) = self.q6_codes(bi);
        let scale = [d * sc[0] as f32, d * sc[1] as f32];
        let mut out = [0f32; BLOCK];
        for (e, (o, &q)) in out.iter_mut().zip(&q).enumerate() {
            *o = scale[e / 16] * (q as i32 - 32) as f32;
        }
        out
    }

    /// The Q6 block at interleaved index `bi` as held: its 32 six-bit codes
    /// `q`, its two half-block scales `sc` and its super-block's `d`.
    fn q6_codes(&self, bi: usize) -> ([u8; BLOCK], [i8; 2], f32) {
        let Blocks::Q6 { ql, qh, sc, d } = &self.blocks else {
            unreachable!("a Q6 block")
        };
        let d = d[super_index(bi)];
        let lo: &[u8; 16] = ql[bi * 16..][..16].try_into().expect("a block");
        let hi: &[u8; 8] = qh[bi * 8..][..8].try_into().expect("a block");
        // Byte `k` of `hi` holds two bits each of elements 2k, 2k+16,
        // 2k+1 and 2k+17, from the lowest.
        let mut q = [0u8; BLOCK];
        for (k, &h) in hi.iter().enumerate() {
            let (e, f) = (2 * k, 2 * k + 1);
            q[e] = (lo[e] & 0x0f) | ((h & 3) << 4);
            q[e + 16] = (lo[e] >> 4) | (((h >> 2) & 3) << 4);
            q[f] = (lo[f] & 0x0f) | (((h >> 4) & 3) << 4);
            q[f + 16] = (lo[f] >> 4) | ((h >> 6) << 4);
        }
        (q, [sc[bi * 2], sc[bi * 2 + 1]], d)
    }
}

/// Blocks in row-major order, as quantized or read, before
/// [`QMatrix::interleave`] lays them out ([`Blocks`]' Q8_0 and per-block
/// 4-bit kinds).
enum RowMajor {
    /// Q8_0 values and scales.
    Q8_0 { qs: Vec<i8>, d: Vec<f32> },
    /// 4-bit blocks (Q4_0, Q4_1) with their f32 `d` and `m`.
    Q4 {
        qs: Vec<u8>,
        d: Vec<f32>,
        m: Vec<f32>,
    },
}

/// A product's activation rows in the forms the kernels read.
struct Acts<'a> {
    x: &'a [f32],
    sums: &'a [f32],
    q: &'a [i16],
    qd: &'a [f32],
}

/// One activation row: f32 (portable kernel), (Q4_1) its per-block sums,
/// and (AVX2 kernel) its i16 blocks with their scales.
struct XRow<'a> {
    x: &'a [f32],
    sums: &'a [f32],
    q: &'a [i16],
    qd: &'a [f32],
}

/// A raw output pointer the parallel loop may share (each task writes
/// disjoint elements).
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: see `QMatrix::matmul_t_many`: tasks write disjoint elements.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests;
