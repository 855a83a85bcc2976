//! The AVX-512 VNNI kernel: the same i16 activations as the AVX2 kernel,
//! 32 products per instruction with the sum folded in (`vpdpwssd`), and the
//! weights widened to i16 by shifts and masks instead of shuffles.
//!
//! A 64-byte load holds one block of each of a group's four rows (Q4_1:
//! 16 bytes a row) or of two rows (Q8_0: 32 bytes a row). Read as 16-bit
//! words, word `i` of a row holds its bytes `2i` and `2i + 1`, so masks and
//! shifts give four vectors (Q4_1: elements `2i`, `2i + 16`, `2i + 1`,
//! `2i + 17`) or two (Q8_0: elements `2i`, `2i + 1`, sign-extended by an
//! arithmetic shift) whose words line up with the activations stored
//! **deinterleaved**, even elements then odd ([`super::blocks::deinterleave_blocks`]). No
//! shuffle port work per weight, where widening with `vpmovzxbw` costs one
//! shuffle per 16 weights and was the AVX2 kernel's bottleneck with twice
//! the instructions per product.

use super::blocks::{Blocks, GROUP, SUPER};
use super::{QMatrix, XRow, BLOCK};

impl QMatrix {
    /// Dot products of weight rows `r..r+4` with one activation row whose
    /// i16 blocks are deinterleaved ([`super::blocks::deinterleave_blocks`]).
    ///
    /// # Safety
    /// The CPU must have AVX-512 F, BW and VNNI ([`super::Kernel::detect`]).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn dot4_avx512(&self, r: usize, x: &XRow<'_>) -> [f32; 4] {
        use std::arch::x86_64::*;
        let (k, nb) = (self.cols, self.cols / BLOCK);
        assert!(r.is_multiple_of(GROUP) && r + GROUP <= self.padded);
        assert!(x.q.len() == k && x.qd.len() == nb);
        let xp = x.q.as_ptr();
        // Group `g`'s blocks and scales are contiguous from here.
        let g0 = (r / GROUP) * nb * GROUP;
        let zero = _mm512_setzero_si512();
        // Two float accumulators, alternate blocks: the fused multiply-add's
        // latency is then not the loop's.
        let mut acc = [_mm512_setzero_ps(); 2];
        // How far ahead to ask for weights, in 64-byte lines.
        const AHEAD: usize = 16;
        let lanes: [f32; 16] = match &self.blocks {
            Blocks::Q4_1 { qs, scales } => {
                assert!(x.sums.len() == nb);
                // Lane `l` of a product belongs to row `l / 4`.
                let spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
                let low = _mm512_set1_epi16(0x0f);
                let w = qs[g0 * 16..(g0 + nb * GROUP) * 16].as_ptr();
                // Block `b` of the four rows, whose `d` are `d4`, into `acc`.
                let block = |b: usize, d4: __m128, acc: &mut [__m512; 2]| {
                    let wb = w.add(b * GROUP * 16);
                    if b + AHEAD < nb {
                        _mm_prefetch::<_MM_HINT_T0>(wb.add(AHEAD * GROUP * 16) as *const i8);
                    }
                    let z = _mm512_loadu_si512(wb as *const __m512i);
                    // The block's even activations, then its odd: a quarter
                    // (8 values) repeated for each of the four rows.
                    let px = xp.add(b * BLOCK);
                    let quarter =
                        |o: usize| _mm512_broadcast_i32x4(_mm_loadu_si128(px.add(o) as *const _));
                    let e0 = _mm512_and_si512(z, low);
                    let e16 = _mm512_and_si512(_mm512_srli_epi16::<4>(z), low);
                    let o1 = _mm512_and_si512(_mm512_srli_epi16::<8>(z), low);
                    let o17 = _mm512_srli_epi16::<12>(z);
                    let s0 = _mm512_dpwssd_epi32(
                        _mm512_dpwssd_epi32(zero, e0, quarter(0)),
                        e16,
                        quarter(8),
                    );
                    let s1 = _mm512_dpwssd_epi32(
                        _mm512_dpwssd_epi32(zero, o1, quarter(16)),
                        o17,
                        quarter(24),
                    );
                    let d4 = _mm_mul_ps(d4, _mm_set1_ps(x.qd[b]));
                    let scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(d4));
                    let s = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                    acc[b & 1] = _mm512_fmadd_ps(s, scale, acc[b & 1]);
                };
                let mins =
                    super::blocks::walk_scales4(scales, g0, x.sums, |b, d4| block(b, d4, &mut acc));
                let mut out = [0f32; 16];
                _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(acc[0], acc[1]));
                let mut m4 = [0f32; 4];
                _mm_storeu_ps(m4.as_mut_ptr(), mins);
                // Fold each row's four lanes into its first, with its min term.
                for j in 0..GROUP {
                    out[4 * j] = out[4 * j..4 * j + 4].iter().sum::<f32>() + m4[j];
                }
                out
            }
            Blocks::Q6 { ql, qh, sc, d } => {
                // Lane `l` of a product belongs to row `l / 4`; word `w`
                // of a row's weights takes the scale of its half: row
                // `w / 8`'s first (even elements 0..16 and odd 1..16) or
                // second.
                let spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
                static HALF: [[i16; 32]; 2] = {
                    let mut t = [[0i16; 32]; 2];
                    let mut w = 0;
                    while w < 32 {
                        t[0][w] = (w / 8 * 2) as i16;
                        t[1][w] = (w / 8 * 2 + 1) as i16;
                        w += 1;
                    }
                    t
                };
                let half0 = _mm512_loadu_si512(HALF[0].as_ptr() as *const __m512i);
                let half1 = _mm512_loadu_si512(HALF[1].as_ptr() as *const __m512i);
                let (low, top, c32) = (
                    _mm512_set1_epi16(0x0f),
                    _mm512_set1_epi16(0x30),
                    _mm512_set1_epi16(32),
                );
                let lo = ql[g0 * 16..(g0 + nb * GROUP) * 16].as_ptr();
                let hi = qh[g0 * 8..(g0 + nb * GROUP) * 8].as_ptr();
                let scs = sc[g0 * 2..(g0 + nb * GROUP) * 2].as_ptr();
                // `g0 = g · nb · 4`, so the group's super-blocks start at `g0 / 8`.
                let ds = &d[g0 / SUPER..(g0 + nb * GROUP) / SUPER];
                for b in 0..nb {
                    let wb = lo.add(b * GROUP * 16);
                    if b + AHEAD < nb {
                        _mm_prefetch::<_MM_HINT_T0>(wb.add(AHEAD * GROUP * 16) as *const i8);
                        _mm_prefetch::<_MM_HINT_T0>(hi.add((b + AHEAD) * GROUP * 8) as *const i8);
                    }
                    let z = _mm512_loadu_si512(wb as *const __m512i);
                    // Each row's 8 bytes of high bits, one per 16-bit word.
                    let h =
                        _mm512_cvtepu8_epi16(_mm256_loadu_si256(hi.add(b * GROUP * 8) as *const _));
                    // Six-bit values, then centred: the four rows' even
                    // elements 0..16 and 16..32, odd 1..16 and 17..32.
                    let six = |nib: __m512i, high: __m512i| {
                        _mm512_sub_epi16(_mm512_or_si512(nib, _mm512_and_si512(high, top)), c32)
                    };
                    let e0 = six(_mm512_and_si512(z, low), _mm512_slli_epi16::<4>(h));
                    let e16 = six(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(z), low),
                        _mm512_slli_epi16::<2>(h),
                    );
                    let o1 = six(_mm512_and_si512(_mm512_srli_epi16::<8>(z), low), h);
                    let o17 = six(_mm512_srli_epi16::<12>(z), _mm512_srli_epi16::<2>(h));
                    // The halves' i8 scales, multiplied in: |(q − 32) · sc|
                    // ≤ 4096, so eight products with i16 activations stay
                    // within an i32 lane.
                    let sc8 = _mm512_castsi128_si512(_mm_cvtepi8_epi16(_mm_loadl_epi64(
                        scs.add(b * GROUP * 2) as *const __m128i,
                    )));
                    let (s0, s1) = (
                        _mm512_permutexvar_epi16(half0, sc8),
                        _mm512_permutexvar_epi16(half1, sc8),
                    );
                    let px = xp.add(b * BLOCK);
                    let quarter =
                        |o: usize| _mm512_broadcast_i32x4(_mm_loadu_si128(px.add(o) as *const _));
                    let first = _mm512_dpwssd_epi32(
                        _mm512_dpwssd_epi32(zero, _mm512_mullo_epi16(e0, s0), quarter(0)),
                        _mm512_mullo_epi16(o1, s0),
                        quarter(16),
                    );
                    let second = _mm512_dpwssd_epi32(
                        _mm512_dpwssd_epi32(zero, _mm512_mullo_epi16(e16, s1), quarter(8)),
                        _mm512_mullo_epi16(o17, s1),
                        quarter(24),
                    );
                    let d4 = _mm_mul_ps(
                        _mm_loadu_ps(ds.as_ptr().add(b / SUPER * GROUP)),
                        _mm_set1_ps(x.qd[b]),
                    );
                    let scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(d4));
                    let s = _mm512_cvtepi32_ps(_mm512_add_epi32(first, second));
                    acc[b & 1] = _mm512_fmadd_ps(s, scale, acc[b & 1]);
                }
                let mut out = [0f32; 16];
                _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(acc[0], acc[1]));
                for j in 0..GROUP {
                    out[4 * j] = out[4 * j..4 * j + 4].iter().sum::<f32>();
                }
                out
            }
            Blocks::Q8_0 { qs, d } => {
                // Lane `l` of a row pair's product belongs to row `l / 8`.
                let pair = [
                    _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                    _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2),
                ];
                let w = qs[g0 * BLOCK..(g0 + nb * GROUP) * BLOCK].as_ptr();
                let wd = &d[g0..g0 + nb * GROUP];
                for b in 0..nb {
                    let wb = w.add(b * GROUP * BLOCK);
                    if b + AHEAD / 2 < nb {
                        let ahead = wb.add(AHEAD / 2 * GROUP * BLOCK);
                        _mm_prefetch::<_MM_HINT_T0>(ahead);
                        _mm_prefetch::<_MM_HINT_T0>(ahead.add(64));
                    }
                    // The block's even activations, then its odd: a half
                    // (16 values) repeated for each of the two rows.
                    let px = xp.add(b * BLOCK);
                    let even = _mm512_broadcast_i64x4(_mm256_loadu_si256(px as *const _));
                    let odd = _mm512_broadcast_i64x4(_mm256_loadu_si256(px.add(16) as *const _));
                    let d4 = _mm_mul_ps(
                        _mm_loadu_ps(wd.as_ptr().add(b * GROUP)),
                        _mm_set1_ps(x.qd[b]),
                    );
                    for (h, idx) in pair.iter().enumerate() {
                        let z = _mm512_loadu_si512(wb.add(h * 64) as *const __m512i);
                        let e = _mm512_srai_epi16::<8>(_mm512_slli_epi16::<8>(z));
                        let o = _mm512_srai_epi16::<8>(z);
                        let s = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(zero, e, even), o, odd);
                        let scale = _mm512_permutexvar_ps(*idx, _mm512_castps128_ps512(d4));
                        acc[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[h]);
                    }
                }
                let mut out = [0f32; 16];
                let mut hi = [0f32; 16];
                _mm512_storeu_ps(out.as_mut_ptr(), acc[0]);
                _mm512_storeu_ps(hi.as_mut_ptr(), acc[1]);
                let (r0, r1): (f32, f32) = (out[..8].iter().sum(), out[8..].iter().sum());
                let (r2, r3): (f32, f32) = (hi[..8].iter().sum(), hi[8..].iter().sum());
                out[0] = r0;
                out[4] = r1;
                out[8] = r2;
                out[12] = r3;
                out
            }
        };
        [lanes[0], lanes[4], lanes[8], lanes[12]]
    }
}
