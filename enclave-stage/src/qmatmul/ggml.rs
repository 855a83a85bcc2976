//! Reading a GGUF's weight blocks into [`QMatrix`]'s own: Q8_0 and Q4_1 as
//! stored, Q4_0 and Q4_K repacked into Q4_1 blocks with the same values.

use super::{Blocks, QMatrix, BLOCK};

/// Number of `size`-byte ggml blocks in `raw`, checked against `[rows, cols]`.
fn ggml_blocks(
    kind: &str,
    raw: &[u8],
    rows: usize,
    cols: usize,
    size: usize,
) -> Result<usize, String> {
    let n = rows * cols / BLOCK;
    if !cols.is_multiple_of(BLOCK) || raw.len() != n * size {
        return Err(format!(
            "{kind} data of {} bytes is not a [{rows}, {cols}] matrix",
            raw.len()
        ));
    }
    Ok(n)
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
    let n = ggml_blocks(kind, raw, rows, cols, size)?;
    let mut qs = Vec::with_capacity(n * 16);
    let mut d = Vec::with_capacity(n);
    let mut m = Vec::with_capacity(n);
    for b in raw.chunks_exact(size) {
        let (scale, min) = scale_min(b);
        d.push(scale);
        m.push(min);
        qs.extend_from_slice(&b[head..]);
    }
    Ok(QMatrix::interleave(rows, cols, Blocks::Q4_1 { qs, d, m }))
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
        let n = ggml_blocks("Q8_0", raw, rows, cols, SIZE)?;
        let mut qs = Vec::with_capacity(n * BLOCK);
        let mut d = Vec::with_capacity(n);
        for b in raw.chunks_exact(SIZE) {
            d.push(f16_bits(b[0], b[1]));
            qs.extend(b[2..].iter().map(|&v| v as i8));
        }
        Ok(Self::interleave(rows, cols, Blocks::Q8_0 { qs, d }))
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
    /// Q4_1 blocks each: sub-block `s` has `w = (d · scale_s) · q −
    /// dmin · min_s`, which is a Q4_1 block with `d = d · scale_s` (exact in
    /// f32: an f16 times a 6-bit integer) and `m = −dmin · min_s`; only the
    /// nibbles move (a super-block packs sub-blocks `2j` and `2j + 1` in the
    /// low and high nibbles of the same 32 bytes). The values are llama.cpp's
    /// `dequantize_row_q4_K`, operation for operation.
    pub fn from_ggml_q4_k(raw: &[u8], rows: usize, cols: usize) -> Result<Self, String> {
        const SIZE: usize = 144;
        const QK_K: usize = 256;
        if !cols.is_multiple_of(QK_K) || raw.len() != rows * cols / QK_K * SIZE {
            return Err(format!(
                "Q4_K data of {} bytes is not a [{rows}, {cols}] matrix",
                raw.len()
            ));
        }
        let n = rows * cols / BLOCK;
        let mut qs = Vec::with_capacity(n * 16);
        let mut d = Vec::with_capacity(n);
        let mut m = Vec::with_capacity(n);
        for b in raw.chunks_exact(SIZE) {
            let (sd, smin) = (f16_bits(b[0], b[1]), f16_bits(b[2], b[3]));
            let sc = &b[4..16];
            let nib = &b[16..];
            for s in 0..8 {
                let (scale, min) = k_scale_min(s, sc);
                d.push(sd * scale as f32);
                m.push(-(smin * min as f32));
                let bytes = &nib[(s / 2) * 32..(s / 2) * 32 + 32];
                let v = |l: usize| {
                    if s % 2 == 0 {
                        bytes[l] & 0x0f
                    } else {
                        bytes[l] >> 4
                    }
                };
                qs.extend((0..16).map(|j| v(j) | (v(j + 16) << 4)));
            }
        }
        Ok(Self::interleave(rows, cols, Blocks::Q4_1 { qs, d, m }))
    }
}
