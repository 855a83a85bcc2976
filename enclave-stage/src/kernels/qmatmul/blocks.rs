//! How a [`QMatrix`]'s weights are laid out: the block kinds ([`Blocks`],
//! with the 4-bit blocks' two kinds of scales, [`Scales4`]), the interleaved
//! order of a group's rows ([`block_index`]), the walk over 4-bit scales the
//! SIMD kernels share ([`walk_scales4`]) and the activation order they read
//! ([`deinterleave_blocks`]).

#[cfg(doc)]
use super::QMatrix;
use super::BLOCK;

/// Rows per interleaved group (the AVX2 kernel's four dot products).
pub(super) const GROUP: usize = 4;

/// The weights of a quantized matrix. Rows are padded with zero rows to a
/// multiple of [`GROUP`] and stored **interleaved**: group `g`'s block `b`
/// holds block `b` of its four rows one after another, so a dot product of
/// four rows reads one sequential stream (which the hardware prefetcher
/// follows; four strided streams measured at a third of the bandwidth).
/// Scales follow the same order: index `(g · nb + b) · 4 + row % 4`.
#[derive(Clone, Debug)]
pub(super) enum Blocks {
    /// `w = d · q`, q ∈ [-127, 127]: 32 bytes per block.
    Q8_0 { qs: Vec<i8>, d: Vec<f32> },
    /// `w = d · q + m`, q ∈ [0, 15], two per byte as ggml packs them: byte
    /// `j` of a block holds element `j` (low nibble) and `j + 16` (high);
    /// 16 bytes per block, and the block's `d` and `m` as [`Scales4`] hold
    /// them.
    Q4_1 { qs: Vec<u8>, scales: Scales4 },
    /// A K-quant's 6-bit blocks (Q6_K) as the file holds them: `w = d ·
    /// sc_h · (q − 32)`, q ∈ [0, 63]; per block the low four bits as Q4_1
    /// packs them (16 bytes), the high two bits packed for the AVX-512
    /// kernel (8 bytes: byte `i` holds those of elements `2i`, `2i + 16`,
    /// `2i + 1`, `2i + 17`, two bits each from the lowest) and two i8 scales
    /// `sc_h`, one per half of 16; per super-block of [`SUPER`] blocks the
    /// f32 `d` (interleaved as [`Scales4::Super`]'s). 26.5 bytes per 32
    /// values against Q8_0's 36.
    Q6 {
        ql: Vec<u8>,
        qh: Vec<u8>,
        sc: Vec<i8>,
        d: Vec<f32>,
    },
}

/// Blocks per K-quant super-block (256 values).
pub(super) const SUPER: usize = 8;

/// The `d` and `m` of each 4-bit block.
#[derive(Clone, Debug)]
pub(super) enum Scales4 {
    /// Per block, in f32 (Q4_0, Q4_1): 8 bytes per block.
    Block { d: Vec<f32>, m: Vec<f32> },
    /// As a K-quant holds them (Q4_K): per block a 6-bit scale `sc` and min
    /// `mn`, per super-block of [`SUPER`] blocks the f32 `d` and `dmin`
    /// (`d_b = d · sc`, `m_b = −dmin · mn`, both exact in f32): 2 bytes per
    /// block and 1 more amortized, against 8. Decoding reads every weight
    /// once per token and is bound by memory, so the bytes are the speed.
    /// Super-block scales are interleaved like blocks: index
    /// `(g · nb / 8 + s) · 4 + row % 4`.
    Super {
        sc: Vec<u8>,
        mn: Vec<u8>,
        d: Vec<f32>,
        dmin: Vec<f32>,
    },
}

impl Scales4 {
    /// `(d, m)` of the block at interleaved index `bi`.
    pub(super) fn dm(&self, bi: usize) -> (f32, f32) {
        match self {
            Scales4::Block { d, m } => (d[bi], m[bi]),
            Scales4::Super { sc, mn, d, dmin } => {
                let si = super_index(bi);
                (d[si] * sc[bi] as f32, -(dmin[si] * mn[bi] as f32))
            }
        }
    }

    /// Bytes held.
    pub(super) fn bytes(&self) -> usize {
        match self {
            Scales4::Block { d, m } => (d.len() + m.len()) * 4,
            Scales4::Super { sc, mn, d, dmin } => sc.len() + mn.len() + (d.len() + dmin.len()) * 4,
        }
    }
}

/// Walks the 4-bit blocks of the group whose first block is at interleaved
/// index `g0`: calls `block(b, d4)` with the four rows' `d` of each block
/// `b` in order, and returns the four rows' min terms `Σ_b m_b · sums[b]`
/// (`sums`: the activation row's exact f32 block sums), with the scales
/// read as they are held. Shared by the SIMD kernels.
///
/// # Safety
/// The CPU must have SSE4.1 and FMA, and the caller must be compiled for
/// them: the function has no `target_feature` of its own but is always
/// inlined into its callers (kernels that enable a superset), so that the
/// per-block `block` closure is inlined into the caller's loop too. As a
/// separate function (which `target_feature` makes it, `inline(always)`
/// being refused there) LLVM inlined it or not depending on how the crate
/// was split into codegen units: an unrelated change to the crate once
/// left it out of line and the decode kernel ~30 % slower (issue 47's A/B).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn walk_scales4(
    scales: &Scales4,
    g0: usize,
    sums: &[f32],
    mut block: impl FnMut(usize, std::arch::x86_64::__m128),
) -> std::arch::x86_64::__m128 {
    use std::arch::x86_64::*;
    let nb = sums.len();
    let mut mins = _mm_setzero_ps();
    match scales {
        Scales4::Block { d, m } => {
            let (d, m) = (&d[g0..g0 + nb * GROUP], &m[g0..g0 + nb * GROUP]);
            for (b, &sum) in sums.iter().enumerate() {
                let m4 = _mm_loadu_ps(m.as_ptr().add(b * GROUP));
                mins = _mm_fmadd_ps(m4, _mm_set1_ps(sum), mins);
                block(b, _mm_loadu_ps(d.as_ptr().add(b * GROUP)));
            }
        }
        Scales4::Super { sc, mn, d, dmin } => {
            // `g0 = g · nb · 4`, so the group's super-blocks start at `g0 / 8`.
            let (ns, s0) = (nb / SUPER, g0 / SUPER);
            let (d, dmin) = (&d[s0..s0 + ns * GROUP], &dmin[s0..s0 + ns * GROUP]);
            let (sc, mn) = (&sc[g0..g0 + nb * GROUP], &mn[g0..g0 + nb * GROUP]);
            // The four rows' 6-bit values of block `b`, as f32.
            let four = |v: &[u8], b: usize| {
                let p = v.as_ptr().add(b * GROUP) as *const i32;
                _mm_cvtepi32_ps(_mm_cvtepu8_epi32(_mm_cvtsi32_si128(p.read_unaligned())))
            };
            for s in 0..ns {
                let sd = _mm_loadu_ps(d.as_ptr().add(s * GROUP));
                // Σ mn · Σ x over the super-block's blocks; `m = −dmin · mn`
                // then makes the term subtracted.
                let mut t = _mm_setzero_ps();
                for (b, &sum) in sums.iter().enumerate().skip(s * SUPER).take(SUPER) {
                    t = _mm_fmadd_ps(four(mn, b), _mm_set1_ps(sum), t);
                    block(b, _mm_mul_ps(sd, four(sc, b)));
                }
                mins = _mm_fnmadd_ps(_mm_loadu_ps(dmin.as_ptr().add(s * GROUP)), t, mins);
            }
        }
    }
    mins
}

/// Interleaved index of row `r`'s block `b` (of `nb` a row): group
/// `r / 4`'s blocks `b`, row `r % 4` within. Super-blocks use it with `nb`
/// super-blocks a row.
pub(super) fn block_index(nb: usize, r: usize, b: usize) -> usize {
    ((r / GROUP) * nb + b) * GROUP + r % GROUP
}

/// Interleaved index of the super-block holding the block at interleaved
/// index `bi`: `bi = (g · nb + b) · 4 + j` and `nb` is a multiple of 8, so
/// it is `(bi / 4 / 8) · 4 + j`.
pub(super) fn super_index(bi: usize) -> usize {
    bi / GROUP / SUPER * GROUP + bi % GROUP
}

/// The i16 activation blocks reordered as the AVX-512 kernel (and the AVX2 kernel's Q6 blocks) read them: in each
/// block of 32, the even elements in order, then the odd ones.
pub(super) fn deinterleave_blocks(q: &mut [i16]) {
    for b in q.chunks_exact_mut(BLOCK) {
        let mut t = [0i16; BLOCK];
        for i in 0..BLOCK / 2 {
            t[i] = b[2 * i];
            t[BLOCK / 2 + i] = b[2 * i + 1];
        }
        b.copy_from_slice(&t);
    }
}
