//! Block-quantized weight matrices and their products with f32 activations,
//! for the Llama stages (`WeightFormat::Q8_0` and `WeightFormat::Q4_1`).
//! Two block kinds are held: Q8_0 and Q4_1. A GGUF's Q4_0 and Q4_K blocks
//! are repacked into Q4_1 blocks with the same values
//! ([`QMatrix::from_ggml_q4_0`], [`QMatrix::from_ggml_q4_k`]), so the one
//! 4-bit kernel serves all three. Reading a GGUF's blocks is [`ggml`]'s;
//! this module holds the blocks and multiplies them.
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
//! - Many rows (prefills): the caller dequantizes the matrix for that
//!   product ([`QMatrix::dequantize`]) and uses an f32 GEMM, which re-uses
//!   each weight across rows better than a dot-product kernel can.
//!
//! Kernels, chosen once at run time ([`Kernel::detect`]):
//! - **AVX2 + FMA** (x86-64): 16 int8 (Q8_0) or 16 nibbles (Q4_1) widened
//!   to i16 per instruction and multiplied with the i16 activations in pairs
//!   (`vpmaddwd`), the product of the two block scales applied once per 32
//!   values in f32;
//! - **portable** (every target): the same sums in plain Rust, also the
//!   reference the AVX2 kernel is tested against.
//!
//! An AVX-512 variant (16 lanes) is not written yet: CPUs with AVX-512
//! (the reference machine's AMD EPYC among them) use the AVX2 kernel. The
//! embedding stages' bf16 products (`embedding::bf16_matmul`) do use it.

use rayon::prelude::*;

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
}

impl Kernel {
    /// The fastest kernel this CPU supports.
    pub fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }

    /// Its name, for logs.
    pub fn name(self) -> &'static str {
        match self {
            Kernel::Portable => "portable",
            Kernel::Avx2 => "avx2",
        }
    }
}

/// Rows per interleaved group (the AVX2 kernel's four dot products).
const GROUP: usize = 4;

/// The weights of a quantized matrix. Rows are padded with zero rows to a
/// multiple of [`GROUP`] and stored **interleaved**: group `g`'s block `b`
/// holds block `b` of its four rows one after another, so a dot product of
/// four rows reads one sequential stream (which the hardware prefetcher
/// follows; four strided streams measured at a third of the bandwidth).
/// Scales follow the same order: index `(g · nb + b) · 4 + row % 4`.
#[derive(Clone, Debug)]
enum Blocks {
    /// `w = d · q`, q ∈ [-127, 127]: 32 bytes per block.
    Q8_0 { qs: Vec<i8>, d: Vec<f32> },
    /// `w = d · q + m`, q ∈ [0, 15], two per byte as ggml packs them: byte
    /// `j` of a block holds element `j` (low nibble) and `j + 16` (high);
    /// 16 bytes per block.
    Q4_1 {
        qs: Vec<u8>,
        d: Vec<f32>,
        m: Vec<f32>,
    },
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
        Self::interleave(rows, cols, Blocks::Q8_0 { qs, d })
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
        Ok(Self::interleave(rows, cols, Blocks::Q8_0 { qs, d }))
    }

    /// Pads row-major blocks to whole groups and interleaves them.
    fn interleave(rows: usize, cols: usize, row_major: Blocks) -> Self {
        let nb = cols / BLOCK;
        let padded = rows.next_multiple_of(GROUP);
        // Position of row `r`'s block `b` in the interleaved order.
        let at = |r: usize, b: usize| ((r / GROUP) * nb + b) * GROUP + r % GROUP;
        fn spread<T: Copy + Default>(
            src: &[T],
            per: usize,
            rows: usize,
            padded: usize,
            nb: usize,
            at: &dyn Fn(usize, usize) -> usize,
        ) -> Vec<T> {
            let mut out = vec![T::default(); padded * nb * per];
            for r in 0..rows {
                for b in 0..nb {
                    let (from, to) = ((r * nb + b) * per, at(r, b) * per);
                    out[to..to + per].copy_from_slice(&src[from..from + per]);
                }
            }
            out
        }
        let blocks = match row_major {
            Blocks::Q8_0 { qs, d } => Blocks::Q8_0 {
                qs: spread(&qs, BLOCK, rows, padded, nb, &at),
                d: spread(&d, 1, rows, padded, nb, &at),
            },
            Blocks::Q4_1 { qs, d, m } => Blocks::Q4_1 {
                qs: spread(&qs, BLOCK / 2, rows, padded, nb, &at),
                d: spread(&d, 1, rows, padded, nb, &at),
                m: spread(&m, 1, rows, padded, nb, &at),
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
        let nb = self.cols / BLOCK;
        ((r / GROUP) * nb + b) * GROUP + r % GROUP
    }

    /// `[rows, cols]`.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Bytes the blocks take in memory.
    pub fn bytes(&self) -> usize {
        match &self.blocks {
            Blocks::Q8_0 { qs, d } => qs.len() + d.len() * 4,
            Blocks::Q4_1 { qs, d, m } => qs.len() + (d.len() + m.len()) * 4,
        }
    }

    /// Row `r`, dequantized into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "row {r} of {}", self.rows);
        for b in 0..self.cols / BLOCK {
            let bi = self.at(r, b);
            let o = &mut out[b * BLOCK..(b + 1) * BLOCK];
            match &self.blocks {
                Blocks::Q8_0 { qs, d } => {
                    for (o, &q) in o.iter_mut().zip(&qs[bi * BLOCK..(bi + 1) * BLOCK]) {
                        *o = q as f32 * d[bi];
                    }
                }
                Blocks::Q4_1 { qs, d, m } => {
                    let bytes = &qs[bi * 16..bi * 16 + 16];
                    for j in 0..16 {
                        o[j] = (bytes[j] & 0x0f) as f32 * d[bi] + m[bi];
                        o[j + 16] = (bytes[j] >> 4) as f32 * d[bi] + m[bi];
                    }
                }
            }
        }
    }

    /// The whole matrix dequantized (`[rows, cols]`, row-major).
    pub fn dequantize(&self) -> Vec<f32> {
        self.dequantize_rows(0..self.rows)
    }

    /// Rows `range` dequantized (`[range.len(), cols]`, row-major).
    pub fn dequantize_rows(&self, range: std::ops::Range<usize>) -> Vec<f32> {
        let mut out = vec![0f32; range.len() * self.cols];
        for (r, row) in range.zip(out.chunks_exact_mut(self.cols)) {
            self.dequantize_row(r, row);
        }
        out
    }

    /// `out = x · Wᵀ` for `x` = `[m, cols]` f32 rows; `out` is `[m, rows]`.
    pub fn matmul_t(&self, x: &[f32], out: &mut [f32], kernel: Kernel) {
        let (n, k) = (self.rows, self.cols);
        assert!(x.len().is_multiple_of(k), "activation width");
        let m = x.len() / k;
        assert_eq!(out.len(), m * n, "output shape");
        let sums = match self.blocks {
            Blocks::Q4_1 { .. } => block_sums(x),
            Blocks::Q8_0 { .. } => Vec::new(),
        };
        let (xq, xd) = match kernel {
            Kernel::Avx2 => quantize_i16(x),
            Kernel::Portable => (Vec::new(), Vec::new()),
        };
        let acts = Acts {
            x,
            sums: &sums,
            q: &xq,
            qd: &xd,
        };
        let threads = rayon::current_num_threads().max(1);
        // Handing work to the pool costs tens of microseconds (a wake-up);
        // a decode step's small matrices are done sooner on this thread.
        if threads == 1 || m * n * k < PARALLEL_MIN_MACS {
            self.rows_times(0..n, &acts, out, kernel);
            return;
        }
        // Output columns (weight rows) in chunks of 4: one chunk per thread
        // (a decode step's products are too small to balance finer).
        let chunk = n.div_ceil(threads).next_multiple_of(GROUP);
        let out_ptr = SendPtr(out.as_mut_ptr());
        (0..n.div_ceil(chunk)).into_par_iter().for_each(|c| {
            let rows = c * chunk..((c + 1) * chunk).min(n);
            // SAFETY: every chunk writes only the columns `rows` of each
            // output row, so no two tasks touch the same element, and `out`
            // outlives the parallel loop.
            let out = unsafe { std::slice::from_raw_parts_mut(out_ptr.get(), m * n) };
            self.rows_times(rows, &acts, out, kernel);
        });
    }

    /// Columns `rows` of `out` for every activation row of `x` (`rows`
    /// starts at a multiple of [`GROUP`]).
    fn rows_times(
        &self,
        rows: std::ops::Range<usize>,
        a: &Acts<'_>,
        out: &mut [f32],
        kernel: Kernel,
    ) {
        let (n, k, nb) = (self.rows, self.cols, self.cols / BLOCK);
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
                out[i * n + r..i * n + r + valid].copy_from_slice(&d4[..valid]);
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
                Blocks::Q4_1 { qs, d, m } => {
                    let bytes = &qs[bi * 16..bi * 16 + 16];
                    let mut s = 0f32;
                    for j in 0..16 {
                        s += (bytes[j] & 0x0f) as f32 * xs[j] + (bytes[j] >> 4) as f32 * xs[j + 16];
                    }
                    acc += s * d[bi] + m[bi] * x.sums[b];
                }
            }
        }
        acc
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot4_avx2(&self, r: usize, x: &XRow<'_>) -> [f32; 4] {
        use std::arch::x86_64::*;
        let (k, nb) = (self.cols, self.cols / BLOCK);
        assert!(r.is_multiple_of(GROUP) && r + GROUP <= self.padded);
        assert!(x.q.len() == k && x.qd.len() == nb);
        let xp = x.q.as_ptr();
        // Group `g`'s blocks and scales are contiguous from here.
        let g0 = (r / GROUP) * nb * GROUP;
        let mut acc = [_mm256_setzero_ps(); 4];
        // How far ahead to ask for weights: 8 groups of blocks.
        const AHEAD: usize = 8;
        // 16 weights (i16) times 16 activations (i16), summed in pairs: 8 i32.
        let pairs = |w: __m256i, xv: __m256i| _mm256_madd_epi16(w, xv);
        match &self.blocks {
            Blocks::Q8_0 { qs, d } => {
                let w = qs[g0 * BLOCK..(g0 + nb * GROUP) * BLOCK].as_ptr();
                let wd = &d[g0..g0 + nb * GROUP];
                for b in 0..nb {
                    let x0 = _mm256_loadu_si256(xp.add(b * BLOCK) as *const __m256i);
                    let x1 = _mm256_loadu_si256(xp.add(b * BLOCK + 16) as *const __m256i);
                    let xd = x.qd[b];
                    let wb = w.add(b * GROUP * BLOCK);
                    if b + AHEAD < nb {
                        let ahead = wb.add(AHEAD * GROUP * BLOCK);
                        _mm_prefetch::<_MM_HINT_T0>(ahead);
                        _mm_prefetch::<_MM_HINT_T0>(ahead.add(64));
                    }
                    for (j, a) in acc.iter_mut().enumerate() {
                        let wp = wb.add(j * BLOCK);
                        let w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(wp as *const __m128i));
                        let w1 =
                            _mm256_cvtepi8_epi16(_mm_loadu_si128(wp.add(16) as *const __m128i));
                        let s = _mm256_add_epi32(pairs(w0, x0), pairs(w1, x1));
                        let scale = _mm256_set1_ps(wd[b * GROUP + j] * xd);
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, *a);
                    }
                }
                [0, 1, 2, 3].map(|j| hsum(acc[j]))
            }
            Blocks::Q4_1 { qs, d, m } => {
                assert!(x.sums.len() == nb);
                let low = _mm_set1_epi8(0x0f);
                let w = qs[g0 * 16..(g0 + nb * GROUP) * 16].as_ptr();
                let (wd, wm) = (&d[g0..g0 + nb * GROUP], &m[g0..g0 + nb * GROUP]);
                let mut mins = [0f32; 4];
                for b in 0..nb {
                    // Elements 0..16 pair with the low nibbles, 16..32 with the high.
                    let x0 = _mm256_loadu_si256(xp.add(b * BLOCK) as *const __m256i);
                    let x1 = _mm256_loadu_si256(xp.add(b * BLOCK + 16) as *const __m256i);
                    let xd = x.qd[b];
                    let wb = w.add(b * GROUP * 16);
                    if b + AHEAD < nb {
                        _mm_prefetch::<_MM_HINT_T0>(wb.add(AHEAD * GROUP * 16) as *const i8);
                    }
                    for (j, a) in acc.iter_mut().enumerate() {
                        let q = _mm_loadu_si128(wb.add(j * 16) as *const __m128i);
                        let lo = _mm256_cvtepu8_epi16(_mm_and_si128(q, low));
                        let hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), low));
                        let s = _mm256_add_epi32(pairs(lo, x0), pairs(hi, x1));
                        let scale = _mm256_set1_ps(wd[b * GROUP + j] * xd);
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, *a);
                        // The min term: m · Σ x over the block (exact f32 sums).
                        mins[j] += wm[b * GROUP + j] * x.sums[b];
                    }
                }
                [0, 1, 2, 3].map(|j| hsum(acc[j]) + mins[j])
            }
        }
    }
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// A raw output pointer the parallel loop may share (each task writes
/// disjoint elements).
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: see `QMatrix::matmul_t`: tasks write disjoint elements.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
    }

    /// `x · Wᵀ` in f64 over the dequantized weights.
    fn reference(w: &QMatrix, x: &[f32]) -> Vec<f32> {
        let (n, k) = w.shape();
        let wd = w.dequantize();
        let xd = x;
        let m = x.len() / k;
        let mut out = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|t| xd[i * k + t] as f64 * wd[j * k + t] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    /// Quantizing a band of rows at a time gives the whole matrix's blocks.
    #[test]
    fn q8_0_by_bands_equals_the_whole() {
        let (rows, cols) = (13, 64);
        let w = random(rows * cols, 21);
        let whole = QMatrix::q8_0(&w, rows, cols);
        let banded = QMatrix::q8_0_by_bands(rows, cols, 5, |r| {
            Ok(w[r.start * cols..r.end * cols].to_vec())
        })
        .unwrap();
        assert_eq!(banded.dequantize(), whole.dequantize());
        assert_eq!(banded.bytes(), whole.bytes());
        assert!(QMatrix::q8_0_by_bands(rows, cols, 5, |_| Ok(vec![0.0; 3])).is_err());
    }

    /// Q4_0 and Q4_K blocks, quantized by Candle's port of ggml and taken
    /// as stored, dequantize to exactly Candle's (= ggml's) values.
    #[test]
    fn q4_0_and_q4_k_blocks_dequantize_as_ggml_does() {
        use candle_core::quantized::{GgmlDType, QTensor};
        use candle_core::{Device, Tensor};
        let (rows, cols) = (6, 512);
        let w = random(rows * cols, 11);
        let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
        type From = fn(&[u8], usize, usize) -> Result<QMatrix, String>;
        let cases: [(GgmlDType, From); 2] = [
            (GgmlDType::Q4_0, QMatrix::from_ggml_q4_0),
            (GgmlDType::Q4K, QMatrix::from_ggml_q4_k),
        ];
        for (dtype, from) in cases {
            let q = QTensor::quantize(&t, dtype).unwrap();
            let want = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let m = from(&q.data().unwrap(), rows, cols).unwrap();
            assert_eq!(m.dequantize(), want, "{dtype:?}");
            let x = random(2 * cols, 12);
            let mut out = vec![0f32; 2 * rows];
            m.matmul_t(&x, &mut out, Kernel::detect());
            for (a, b) in out.iter().zip(reference(&m, &x)) {
                assert!(
                    (a - b).abs() < 1e-2 * b.abs().max(1.0),
                    "{dtype:?}: {a} vs {b}"
                );
            }
            assert!(from(&q.data().unwrap()[1..], rows, cols).is_err());
        }
    }

    /// Q4_1 blocks as ggml writes them, from `w`.
    fn ggml_q4_1(w: &[f32]) -> Vec<u8> {
        let mut raw = Vec::new();
        for b in w.chunks_exact(BLOCK) {
            let min = b.iter().cloned().fold(f32::INFINITY, f32::min);
            let max = b.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let d = (max - min) / 15.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            raw.extend_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
            raw.extend_from_slice(&half::f16::from_f32(min).to_bits().to_le_bytes());
            for j in 0..16 {
                let q0 = (((b[j] - min) * id).round() as u8).min(15);
                let q1 = (((b[j + 16] - min) * id).round() as u8).min(15);
                raw.push(q0 | (q1 << 4));
            }
        }
        raw
    }

    fn matrices(w: &[f32], rows: usize, cols: usize) -> Vec<QMatrix> {
        vec![
            QMatrix::q8_0(w, rows, cols),
            QMatrix::from_ggml_q4_1(&ggml_q4_1(w), rows, cols).unwrap(),
        ]
    }

    #[test]
    fn kernels_match_the_dequantized_product() {
        let kernels = [Kernel::Portable, Kernel::detect()];
        // Row counts that leave 1-3 rows after the groups of four; one and
        // many activation rows (decode, prefill).
        for (rows, cols, m) in [(7, 64, 1), (70, 96, 3), (576, 576, 17), (33, 1536, 2)] {
            for w in matrices(&random(rows * cols, 7), rows, cols) {
                let x = random(m * cols, rows as u64);
                let want = reference(&w, &x);
                // The AVX2 kernel rounds activations to i16 blocks: each
                // output may move by at most Σ |w| · (block scale / 2).
                let (_, xd) = quantize_i16(&x);
                let wd = w.dequantize();
                let bound = |i: usize, j: usize| -> f32 {
                    (0..cols)
                        .map(|t| wd[j * cols + t].abs() * xd[(i * cols + t) / BLOCK] * 0.5)
                        .sum()
                };
                for kernel in kernels {
                    let mut got = vec![0f32; m * rows];
                    w.matmul_t(&x, &mut got, kernel);
                    for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                        let rounding = match kernel {
                            Kernel::Avx2 => bound(i / rows, i % rows),
                            Kernel::Portable => 0.0,
                        };
                        assert!(
                            (g - r).abs() <= 1e-4 * (1.0 + r.abs()) + rounding,
                            "{kernel:?} {rows}x{cols} m={m} at {i}: {g} vs {r}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn quantization_error_is_small_against_f32() {
        let (rows, cols) = (64, 576);
        let w = random(rows * cols, 3);
        let x = random(4 * cols, 4);
        let exact: Vec<f32> = (0..4 * rows)
            .map(|o| {
                let (i, j) = (o / rows, o % rows);
                (0..cols).map(|t| x[i * cols + t] * w[j * cols + t]).sum()
            })
            .collect();
        let scale = exact.iter().map(|v| v.abs()).fold(0f32, f32::max);
        for (q, tol) in matrices(&w, rows, cols).iter().zip([0.02f32, 0.1]) {
            let mut got = vec![0f32; 4 * rows];
            q.matmul_t(&x, &mut got, Kernel::detect());
            let err = got
                .iter()
                .zip(&exact)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(err <= tol * scale, "max error {err} vs scale {scale}");
        }
    }

    #[test]
    fn q4_1_blocks_round_trip_and_bad_sizes_are_refused() {
        let w = random(4 * 64, 9);
        let raw = ggml_q4_1(&w);
        let q = QMatrix::from_ggml_q4_1(&raw, 4, 64).unwrap();
        assert_eq!(q.bytes(), 4 * 64 / 2 + 2 * 8 * 4);
        let back = q.dequantize();
        for (a, b) in back.iter().zip(&w) {
            assert!((a - b).abs() < 0.1, "{a} vs {b}");
        }
        assert!(QMatrix::from_ggml_q4_1(&raw[1..], 4, 64).is_err());
        // ggml Q8_0 blocks (f16 scale + 32 int8) read back as written.
        let mut q8 = Vec::new();
        for b in w.chunks_exact(BLOCK) {
            let mut q = [0i8; BLOCK];
            let d = quantize_block(b, &mut q);
            q8.extend_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
            q8.extend(q.iter().map(|&v| v as u8));
        }
        let q = QMatrix::from_ggml_q8_0(&q8, 4, 64).unwrap();
        for (a, b) in q.dequantize().iter().zip(&w) {
            assert!((a - b).abs() < 0.01, "{a} vs {b}");
        }
        assert!(QMatrix::from_ggml_q8_0(&q8, 3, 64).is_err());
        assert!(QMatrix::from_ggml_q4_1(&raw, 4, 48).is_err());
        // Q8_0 of zeros: scale 0, no NaN.
        let z = QMatrix::q8_0(&[0.0; 64], 1, 64);
        let mut out = [1f32];
        z.matmul_t(&random(64, 1), &mut out, Kernel::detect());
        assert_eq!(out, [0.0]);
    }
}
