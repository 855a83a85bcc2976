//! The AVX2 + FMA kernel: 16 int8 (Q8_0) or 16 nibbles (Q4_1) widened to
//! i16 per instruction and multiplied with the i16 activations in pairs
//! (`vpmaddwd`), the product of the two block scales applied once per 32
//! values in f32. Four weight rows at a time share every load of the
//! activations.

use super::blocks::{Blocks, GROUP, SUPER};
use super::{QMatrix, XRow, BLOCK};

impl QMatrix {
    /// Dot products of weight rows `r..r+4` (`r` a multiple of [`GROUP`];
    /// padding rows give 0) with one activation row.
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA ([`super::Kernel::detect`]).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot4_avx2(&self, r: usize, x: &XRow<'_>) -> [f32; 4] {
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
            Blocks::Q6 { ql, qh, sc, d } => {
                // Two rows per 256-bit vector (one per 128-bit lane), so two
                // passes per group; the bits are unpacked as the AVX-512
                // kernel does (see there), with `vpmaddwd` for `vpdpwssd`.
                let (low, top, c32) = (
                    _mm256_set1_epi16(0x0f),
                    _mm256_set1_epi16(0x30),
                    _mm256_set1_epi16(32),
                );
                let lo = ql[g0 * 16..(g0 + nb * GROUP) * 16].as_ptr();
                let hi = qh[g0 * 8..(g0 + nb * GROUP) * 8].as_ptr();
                let scs = &sc[g0 * 2..(g0 + nb * GROUP) * 2];
                let ds = &d[g0 / SUPER..(g0 + nb * GROUP) / SUPER];
                let six = |nib: __m256i, high: __m256i| {
                    _mm256_sub_epi16(_mm256_or_si256(nib, _mm256_and_si256(high, top)), c32)
                };
                // Lane 0 takes row `a`'s value, lane 1 row `b`'s.
                let two = |a: i16, b: i16| _mm256_setr_m128i(_mm_set1_epi16(a), _mm_set1_epi16(b));
                let mut pairs_acc = [_mm256_setzero_ps(); 2];
                for b in 0..nb {
                    let px = xp.add(b * BLOCK);
                    let quarter = |o: usize| {
                        _mm256_broadcastsi128_si256(_mm_loadu_si128(px.add(o) as *const __m128i))
                    };
                    let (q0, q8, q16, q24) = (quarter(0), quarter(8), quarter(16), quarter(24));
                    let xd = x.qd[b];
                    let dsb = &ds[b / SUPER * GROUP..b / SUPER * GROUP + GROUP];
                    let scb = &scs[b * GROUP * 2..b * GROUP * 2 + GROUP * 2];
                    for (p, a) in pairs_acc.iter_mut().enumerate() {
                        let z =
                            _mm256_loadu_si256(lo.add(b * GROUP * 16 + p * 32) as *const __m256i);
                        let h = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                            hi.add(b * GROUP * 8 + p * 16) as *const __m128i,
                        ));
                        let e0 = six(_mm256_and_si256(z, low), _mm256_slli_epi16(h, 4));
                        let e16 = six(
                            _mm256_and_si256(_mm256_srli_epi16(z, 4), low),
                            _mm256_slli_epi16(h, 2),
                        );
                        let o1 = six(_mm256_and_si256(_mm256_srli_epi16(z, 8), low), h);
                        let o17 = six(_mm256_srli_epi16(z, 12), _mm256_srli_epi16(h, 2));
                        let (r0, r1) = (2 * p, 2 * p + 1);
                        let s0 = two(scb[r0 * 2] as i16, scb[r1 * 2] as i16);
                        let s1 = two(scb[r0 * 2 + 1] as i16, scb[r1 * 2 + 1] as i16);
                        let prod = _mm256_add_epi32(
                            _mm256_add_epi32(
                                pairs(_mm256_mullo_epi16(e0, s0), q0),
                                pairs(_mm256_mullo_epi16(o1, s0), q16),
                            ),
                            _mm256_add_epi32(
                                pairs(_mm256_mullo_epi16(e16, s1), q8),
                                pairs(_mm256_mullo_epi16(o17, s1), q24),
                            ),
                        );
                        let scale =
                            _mm256_setr_m128(_mm_set1_ps(dsb[r0] * xd), _mm_set1_ps(dsb[r1] * xd));
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), scale, *a);
                    }
                }
                let lane = |v: __m256, upper: bool| {
                    let h = if upper {
                        _mm256_extractf128_ps(v, 1)
                    } else {
                        _mm256_castps256_ps128(v)
                    };
                    hsum(_mm256_castps128_ps256(h))
                };
                let (p0, p1) = (pairs_acc[0], pairs_acc[1]);
                [
                    lane(p0, false),
                    lane(p0, true),
                    lane(p1, false),
                    lane(p1, true),
                ]
            }
            Blocks::Q4_1 { qs, scales } => {
                assert!(x.sums.len() == nb);
                let low = _mm_set1_epi8(0x0f);
                let w = qs[g0 * 16..(g0 + nb * GROUP) * 16].as_ptr();
                let block = |b: usize, d4: __m128, acc: &mut [__m256; 4]| {
                    // Elements 0..16 pair with the low nibbles, 16..32 with the high.
                    let x0 = _mm256_loadu_si256(xp.add(b * BLOCK) as *const __m256i);
                    let x1 = _mm256_loadu_si256(xp.add(b * BLOCK + 16) as *const __m256i);
                    let wb = w.add(b * GROUP * 16);
                    if b + AHEAD < nb {
                        _mm_prefetch::<_MM_HINT_T0>(wb.add(AHEAD * GROUP * 16) as *const i8);
                    }
                    let mut wd = [0f32; 4];
                    _mm_storeu_ps(wd.as_mut_ptr(), _mm_mul_ps(d4, _mm_set1_ps(x.qd[b])));
                    for (j, a) in acc.iter_mut().enumerate() {
                        let q = _mm_loadu_si128(wb.add(j * 16) as *const __m128i);
                        let lo = _mm256_cvtepu8_epi16(_mm_and_si128(q, low));
                        let hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), low));
                        let s = _mm256_add_epi32(pairs(lo, x0), pairs(hi, x1));
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(wd[j]), *a);
                    }
                };
                let mins =
                    super::blocks::walk_scales4(scales, g0, x.sums, |b, d4| block(b, d4, &mut acc));
                let mut m4 = [0f32; 4];
                _mm_storeu_ps(m4.as_mut_ptr(), mins);
                [0, 1, 2, 3].map(|j| hsum(acc[j]) + m4[j])
            }
        }
    }
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
