//! Reading a GGUF's weight blocks into [`QMatrix`]'s own: Q8_0 and Q4_1 as
//! stored, Q4_0 and Q4_K repacked into 4-bit blocks with the same values
//! (Q4_K keeping its 6-bit scales), Q6_K into 6-bit blocks.

use super::blocks::{block_index, Blocks, Scales4, GROUP, SUPER};
use super::{QMatrix, RowMajor, BLOCK};

/// Number of `size`-byte ggml blocks of `per` values in `raw`, checked
/// against `[rows, cols]`; returned in 32-value blocks.
fn ggml_blocks(
    kind: &str,
    raw: &[u8],
    [rows, cols]: [usize; 2],
    per: usize,
    size: usize,
) -> Result<usize, String> {
    if !cols.is_multiple_of(per) || raw.len() != rows * cols / per * size {
        return Err(format!(
            "{kind} data of {} bytes is not a [{rows}, {cols}] matrix",
            raw.len()
        ));
    }
    Ok(rows * cols / BLOCK)
}

/// Scale and min of sub-block `j` of a K-quant super-block, from its 12
/// packed bytes (6 bits each; ggml's `get_scale_min_k4`).
fn k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

fn f16_bits(lo: u8, hi: u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

/// ggml blocks of 32 four-bit values after a `head` of `head` bytes, which
/// `scale_min` turns into the block's `(d, m)` (`w = d · q + m`); the
/// 16 bytes of nibbles are packed as Q4_1's (byte `j`: elements `j` and
/// `j + 16`).
fn four_bit(
    kind: &str,
    raw: &[u8],
    rows: usize,
    cols: usize,
    head: usize,
    scale_min: impl Fn(&[u8]) -> (f32, f32),
) -> Result<QMatrix, String> {
    let size = head + BLOCK / 2;
    let n = ggml_blocks(kind, raw, [rows, cols], BLOCK, size)?;
    let mut qs = Vec::with_capacity(n * 16);
    let mut d = Vec::with_capacity(n);
    let mut m = Vec::with_capacity(n);
    for b in raw.chunks_exact(size) {
        let (scale, min) = scale_min(b);
        d.push(scale);
        m.push(min);
        qs.extend_from_slice(&b[head..]);
    }
    Ok(QMatrix::interleave(rows, cols, RowMajor::Q4 { qs, d, m }))
}

impl QMatrix {
    /// Takes ggml `Q4_1` blocks as stored in a GGUF file (20 bytes each:
    /// f16 `d`, f16 `m`, 16 bytes of nibbles), `[rows, cols]`.
    pub fn from_ggml_q4_1(raw: &[u8], rows: usize, cols: usize) -> Result<Self, String> {
        four_bit("Q4_1", raw, rows, cols, 4, |b| {
            (f16_bits(b[0], b[1]), f16_bits(b[2], b[3]))
        })
    }

    /// Takes ggml `Q8_0` blocks as stored in a GGUF file (34 bytes each:
    /// f16 `d`, 32 int8), `[rows, cols]`.
    pub fn from_ggml_q8_0(raw: &[u8], rows: usize, cols: usize) -> Result<Self, String> {
        const SIZE: usize = 34;
        let n = ggml_blocks("Q8_0", raw, [rows, cols], BLOCK, SIZE)?;
        let mut qs = Vec::with_capacity(n * BLOCK);
        let mut d = Vec::with_capacity(n);
        for b in raw.chunks_exact(SIZE) {
            d.push(f16_bits(b[0], b[1]));
            qs.extend(b[2..].iter().map(|&v| v as i8));
        }
        Ok(Self::interleave(rows, cols, RowMajor::Q8_0 { qs, d }))
    }

    /// Takes ggml `Q4_0` blocks as stored in a GGUF file (18 bytes each:
    /// f16 `d`, 16 bytes of nibbles; `w = d · (q − 8)`), `[rows, cols]`,
    /// as Q4_1 blocks with `m = −8d`: the same nibbles, the same values.
    pub fn from_ggml_q4_0(raw: &[u8], rows: usize, cols: usize) -> Result<Self, String> {
        four_bit("Q4_0", raw, rows, cols, 2, |b| {
            let scale = f16_bits(b[0], b[1]);
            (scale, -8.0 * scale)
        })
    }

    /// Takes ggml `Q4_K` super-blocks as stored in a GGUF file (144 bytes
    /// per 256 values: f16 `d` and `dmin`, eight 6-bit scales and mins
    /// packed in 12 bytes, 128 bytes of nibbles), `[rows, cols]`, as eight
    /// 4-bit blocks each with the K-quant's own scales ([`Scales4::Super`]):
    /// sub-block `s` has `w = (d · scale_s) · q − dmin · min_s`, a Q4_1
    /// block with `d = d · scale_s` (exact in f32: an f16 times a 6-bit
    /// integer) and `m = −dmin · min_s`; the scales are unpacked to a byte
    /// each and only the nibbles move (a super-block packs sub-blocks `2j`
    /// and `2j + 1` in the low and high nibbles of the same 32 bytes). The
    /// values are llama.cpp's `dequantize_row_q4_K`, operation for operation.
    pub fn from_ggml_q4_k(raw: &[u8], rows: usize, cols: usize) -> Result<Self, String> {
        const SIZE: usize = 144;
        ggml_blocks("Q4_K", raw, [rows, cols], SUPER * BLOCK, SIZE)?;
        let place = Placement::new(rows, cols);
        let mut qs = vec![0u8; place.blocks * 16];
        let (mut sc, mut mn) = (vec![0u8; place.blocks], vec![0u8; place.blocks]);
        let (mut d, mut dmin) = (vec![0f32; place.supers], vec![0f32; place.supers]);
        for (i, b) in raw.chunks_exact(SIZE).enumerate() {
            let (r, s0) = place.super_block(i);
            let si = place.super_at(r, s0);
            d[si] = f16_bits(b[0], b[1]);
            dmin[si] = f16_bits(b[2], b[3]);
            let packed = &b[4..16];
            let nib = &b[16..];
            for s in 0..SUPER {
                let bi = place.block_at(r, s0 * SUPER + s);
                (sc[bi], mn[bi]) = k_scale_min(s, packed);
                let bytes = &nib[(s / 2) * 32..(s / 2) * 32 + 32];
                let v = |l: usize| {
                    if s % 2 == 0 {
                        bytes[l] & 0x0f
                    } else {
                        bytes[l] >> 4
                    }
                };
                for (j, q) in qs[bi * 16..bi * 16 + 16].iter_mut().enumerate() {
                    *q = v(j) | (v(j + 16) << 4);
                }
            }
        }
        let scales = Scales4::Super { sc, mn, d, dmin };
        Ok(place.matrix(Blocks::Q4_1 { qs, scales }))
    }

    /// Takes ggml `Q6_K` super-blocks as stored in a GGUF file (210 bytes
    /// per 256 values: 128 bytes of low four bits, 64 of high two bits,
    /// sixteen i8 scales, f16 `d`; `w = d · sc · (q − 32)` with a scale per
    /// 16 values), `[rows, cols]`, as eight Q6 blocks each with the same
    /// 6-bit values and scales, reordered as [`Blocks::Q6`] holds them; the
    /// bit layout read is llama.cpp's `dequantize_row_q6_K`.
    pub fn from_ggml_q6_k(raw: &[u8], rows: usize, cols: usize) -> Result<Self, String> {
        const SIZE: usize = 210;
        ggml_blocks("Q6_K", raw, [rows, cols], SUPER * BLOCK, SIZE)?;
        let place = Placement::new(rows, cols);
        let (mut ql, mut qh) = (vec![0u8; place.blocks * 16], vec![0u8; place.blocks * 8]);
        let (mut sc, mut d) = (vec![0i8; place.blocks * 2], vec![0f32; place.supers]);
        for (i, b) in raw.chunks_exact(SIZE).enumerate() {
            let (r, s0) = place.super_block(i);
            let (lo, hi, scales) = (&b[..128], &b[128..192], &b[192..208]);
            d[place.super_at(r, s0)] = f16_bits(b[208], b[209]);
            // The 256 six-bit values in order: each half of 128 takes 64
            // bytes of low bits and 32 of high bits, in four runs of 32.
            let mut q = [0u8; SUPER * BLOCK];
            for h in 0..2 {
                let (lo, hi) = (&lo[h * 64..h * 64 + 64], &hi[h * 32..h * 32 + 32]);
                for l in 0..32 {
                    let y = &mut q[h * 128..h * 128 + 128];
                    y[l] = (lo[l] & 0x0f) | (hi[l] & 3) << 4;
                    y[l + 32] = (lo[l + 32] & 0x0f) | ((hi[l] >> 2) & 3) << 4;
                    y[l + 64] = (lo[l] >> 4) | ((hi[l] >> 4) & 3) << 4;
                    y[l + 96] = (lo[l + 32] >> 4) | ((hi[l] >> 6) & 3) << 4;
                }
            }
            for (blk, v) in q.chunks_exact(BLOCK).enumerate() {
                let bi = place.block_at(r, s0 * SUPER + blk);
                for (j, o) in ql[bi * 16..bi * 16 + 16].iter_mut().enumerate() {
                    *o = (v[j] & 0x0f) | (v[j + 16] & 0x0f) << 4;
                }
                let h = |e: usize| v[e] >> 4;
                for (k, o) in qh[bi * 8..bi * 8 + 8].iter_mut().enumerate() {
                    *o = h(2 * k) | h(2 * k + 16) << 2 | h(2 * k + 1) << 4 | h(2 * k + 17) << 6;
                }
                sc[bi * 2] = scales[2 * blk] as i8;
                sc[bi * 2 + 1] = scales[2 * blk + 1] as i8;
            }
        }
        Ok(place.matrix(Blocks::Q6 { ql, qh, sc, d }))
    }
}

/// Where a K-quant's blocks go in [`QMatrix`]'s interleaved order, so they
/// are written there as they are read: a large matrix (a 1B model's output
/// head, 80 MB of Q6_K) is then held once beside the file's bytes, not
/// twice more in file order and reordered.
struct Placement {
    rows: usize,
    cols: usize,
    /// 32-value blocks per row.
    nb: usize,
    /// Blocks, padding rows included.
    blocks: usize,
    /// Super-blocks, padding rows included.
    supers: usize,
}

impl Placement {
    fn new(rows: usize, cols: usize) -> Self {
        let (nb, padded) = (cols / BLOCK, rows.next_multiple_of(GROUP));
        Self {
            rows,
            cols,
            nb,
            blocks: padded * nb,
            supers: padded * nb / SUPER,
        }
    }

    /// Row and super-block (in the row) of the file's `i`-th super-block.
    fn super_block(&self, i: usize) -> (usize, usize) {
        (i / (self.nb / SUPER), i % (self.nb / SUPER))
    }

    /// Interleaved index of row `r`'s block `b`.
    fn block_at(&self, r: usize, b: usize) -> usize {
        block_index(self.nb, r, b)
    }

    /// Interleaved index of row `r`'s super-block `s`.
    fn super_at(&self, r: usize, s: usize) -> usize {
        block_index(self.nb / SUPER, r, s)
    }

    fn matrix(&self, blocks: Blocks) -> QMatrix {
        QMatrix {
            padded: self.rows.next_multiple_of(GROUP),
            rows: self.rows,
            cols: self.cols,
            blocks,
        }
    }
}
