//! Weight matrices in one of the [`WeightFormat`]s, applied as `x · Wᵀ`.

use crate::kernels::qmatmul::{Kernel, QMatrix};
use candle_core::quantized::{gguf_file, GgmlDType, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use candle_nn::Linear;
use proto::frames::WeightFormat;
use std::fs::File;

/// Products with at least this many activation rows use a GEMM (on
/// AVX-512 VNNI the integer one on the blocks as held, elsewhere the f32
/// one on the weights dequantized for the product); fewer use the
/// quantized dot products, which read a quarter (Q8_0) or a sixth (Q4_1)
/// of the f32 weight bytes.
///
/// The integer GEMM is sooner from about 24 rows (1B-class Q4_K_M shape,
/// 2-core Zen 4, `bench_decode`: 16 tokens 330 ms with the dot products
/// against 350, 32 tokens 635 against 450), but the switch stays here for
/// both: the paths round activations differently (±32767 and ±16383 per
/// block) and sum in other orders, so a row's result depends on the path
/// its packed batch takes, and at 24 rows concurrent short prompts crossed
/// it often enough to change greedy tokens between runs
/// (`completions_e2e`'s one-against-two-stage check).
pub(super) const DEQUANTIZE_MIN_ROWS: usize = 48;

/// Products with fewer activation rows than this (and at least
/// [`DEQUANTIZE_MIN_ROWS`]) put the dequantized weight tile on the left of
/// the GEMM, `(W · xᵀ)ᵀ`. Measured on the 1B-class Q4_K_M shape (2-core
/// AVX2, `bench_decode`, interleaved): a 64-token prefill 17 % sooner
/// (`x · Wᵀ` spent 22 % of a 48-token prefill's samples in the GEMM's
/// packing), 128 tokens within noise, so larger prefills keep `x · Wᵀ`.
const WEIGHT_LEFT_MAX_ROWS: usize = 128;

/// The most f32 weight bytes one dequantized tile takes: a matrix larger
/// than this (the 49,152-row output head: 108 MiB in f32) is dequantized and
/// multiplied a band of rows at a time, so a stage's memory stays within its
/// quantized weights plus a few MiB.
const DEQUANTIZE_TILE_BYTES: usize = 4 << 20;

/// A weight matrix `[out, in]` applied as `x · Wᵀ`: f32 (Candle's GEMM), or
/// quantized blocks ([`crate::kernels::qmatmul`]).
pub(super) enum Weight {
    Dense(Linear),
    Quant(QMatrix, Kernel),
}

impl Weight {
    /// Loads GGUF tensor `name` in `format`:
    /// - `f32`: dequantized;
    /// - `q4_1`: the file's own blocks where a kernel takes them, without
    ///   changing a value (Q4_1 and Q8_0 as they are; Q4_0 and Q4_K as
    ///   4-bit blocks, Q4_K keeping its 6-bit scales; Q6_K as 6-bit
    ///   blocks), and every other type (F32, F16, BF16, Q5_K) re-quantized
    ///   to Q8_0, so a Q4_K_M file keeps the bits it was given;
    /// - `q8_0`: Q8_0 as stored, everything else re-quantized to Q8_0.
    ///
    /// A tensor type outside [`SERVED_TYPES`] is refused, named.
    pub(super) fn load(
        ct: &gguf_file::Content,
        file: &mut File,
        name: &str,
        format: WeightFormat,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let q = ct.tensor(file, name, device)?;
        Self::from_tensor(name, q, format, device)
    }

    /// Loads GGUF tensor `name` as `N` matrices of consecutive rows,
    /// `rows[j]` rows each (Phi-3's fused q/k/v and gate/up matrices), each
    /// held as [`Weight::load`] holds a whole tensor, with the file's values.
    pub(super) fn load_split<const N: usize>(
        ct: &gguf_file::Content,
        file: &mut File,
        name: &str,
        rows: &[usize; N],
        format: WeightFormat,
        device: &Device,
    ) -> candle_core::Result<[Self; N]> {
        let q = ct.tensor(file, name, device)?;
        check_served(name, q.dtype())?;
        let (total, cols) = q.shape().dims2()?;
        if rows.iter().sum::<usize>() != total {
            candle_core::bail!(
                "{name} has {total} rows, not {}",
                rows.iter().sum::<usize>()
            );
        }
        let raw = q.data()?;
        let mut start = 0;
        let mut parts = Vec::with_capacity(N);
        for &n in rows {
            let part = row_band(&raw, q.dtype(), total, cols, start..start + n, device)?;
            parts.push(Self::from_tensor(name, part, format, device)?);
            start += n;
        }
        parts
            .try_into()
            .map_err(|_| candle_core::Error::Msg(format!("{name}: {N} parts expected")))
    }

    /// [`Weight::load`] of a tensor already read.
    fn from_tensor(
        name: &str,
        q: QTensor,
        format: WeightFormat,
        device: &Device,
    ) -> candle_core::Result<Self> {
        check_served(name, q.dtype())?;
        let (rows, cols) = q.shape().dims2()?;
        // Re-quantized to Q8_0 a band of rows at a time (a transient f32
        // buffer of at most DEQUANTIZE_TILE_BYTES), as the prefill tiles are.
        let requantize = |q: &candle_core::quantized::QTensor| -> candle_core::Result<Self> {
            let raw = q.data()?;
            let band_rows = (DEQUANTIZE_TILE_BYTES / (cols * 4)).max(1);
            let m = QMatrix::q8_0_by_bands(rows, cols, band_rows, |r: std::ops::Range<usize>| {
                let band = row_band(&raw, q.dtype(), rows, cols, r, device)
                    .and_then(|t| t.dequantize(device))
                    .and_then(|t| t.flatten_all()?.to_vec1::<f32>());
                band.map_err(|e| e.to_string())
            })
            .map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
            Ok(Weight::Quant(m, Kernel::detect()))
        };
        let stored = |m: Result<QMatrix, String>| -> candle_core::Result<Self> {
            let m = m.map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
            Ok(Weight::Quant(m, Kernel::detect()))
        };
        match (format, q.dtype()) {
            (WeightFormat::F32, _) => Ok(Weight::Dense(Linear::new(q.dequantize(device)?, None))),
            (WeightFormat::Q4_1, GgmlDType::Q4_1) => {
                stored(QMatrix::from_ggml_q4_1(&q.data()?, rows, cols))
            }
            (WeightFormat::Q4_1, GgmlDType::Q4_0) => {
                stored(QMatrix::from_ggml_q4_0(&q.data()?, rows, cols))
            }
            (WeightFormat::Q4_1, GgmlDType::Q4K) => {
                stored(QMatrix::from_ggml_q4_k(&q.data()?, rows, cols))
            }
            (WeightFormat::Q4_1, GgmlDType::Q6K) => {
                stored(QMatrix::from_ggml_q6_k(&q.data()?, rows, cols))
            }
            (WeightFormat::Q4_1 | WeightFormat::Q8_0, GgmlDType::Q8_0) => {
                stored(QMatrix::from_ggml_q8_0(&q.data()?, rows, cols))
            }
            (WeightFormat::Q4_1 | WeightFormat::Q8_0, _) => requantize(&q),
            (WeightFormat::Bf16, _) => candle_core::bail!(
                "bf16 is an embedding weight format (generation: f32, q8_0 or q4_1)"
            ),
        }
    }

    pub(super) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Weight::Dense(l) => l.forward(x),
            Weight::Quant(q, kernel) => {
                let (rows, cols) = q.shape();
                let (t, k) = x.dims2()?;
                if k != cols {
                    candle_core::bail!("activation width {k}, weight has {cols} columns");
                }
                #[cfg(target_arch = "x86_64")]
                if t >= DEQUANTIZE_MIN_ROWS && *kernel == Kernel::Avx512 {
                    // A prefill on AVX-512 VNNI: the integer GEMM on the
                    // blocks as held (`qmatmul::gemm`), activations rounded
                    // to 16-bit blocks as in a decode step.
                    let xs = x.flatten_all()?.to_vec1::<f32>()?;
                    let mut out = vec![0f32; t * rows];
                    // SAFETY: `Kernel::Avx512` is only chosen when the CPU
                    // has AVX-512 F, BW and VNNI.
                    unsafe { q.matmul_t_prefill(&xs, &mut out) };
                    return Tensor::from_vec(out, (t, rows), x.device());
                }
                if t >= DEQUANTIZE_MIN_ROWS {
                    // A prefill (or a large decode batch) elsewhere: the matrix is
                    // dequantized for this product only, a band of rows at a
                    // time (a transient f32 buffer of at most
                    // DEQUANTIZE_TILE_BYTES), and goes through Candle's f32
                    // GEMM, which re-uses each weight across many rows.
                    // The activations are f32 on both paths, so the result is
                    // the same product up to summation order.
                    let band = (DEQUANTIZE_TILE_BYTES / (cols * 4)).max(1);
                    let tiles = (0..rows)
                        .step_by(band)
                        .map(|r0| {
                            let r1 = rows.min(r0 + band);
                            let w = Tensor::from_vec(
                                q.dequantize_rows(r0..r1),
                                (r1 - r0, cols),
                                x.device(),
                            )?;
                            if t < WEIGHT_LEFT_MAX_ROWS {
                                w.matmul(&x.t()?)?.t()?.contiguous()
                            } else {
                                x.matmul(&w.t()?)
                            }
                        })
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    return if tiles.len() == 1 {
                        Ok(tiles.into_iter().next().expect("one tile"))
                    } else {
                        Tensor::cat(&tiles, 1)
                    };
                }
                let mut out = decode_products(&[q], *kernel, x)?;
                Ok(out.remove(0))
            }
        }
    }

    /// `x · Wⱼᵀ` for each of `ws`, which share their input (a layer's q, k
    /// and v; its gate and up): quantized matrices of a decode step go
    /// through one [`QMatrix::matmul_t_many`], which rounds the activations
    /// once and hands the group to the thread pool once; anything else is
    /// one [`Weight::forward`] each.
    pub(super) fn forward_many(ws: &[&Weight], x: &Tensor) -> candle_core::Result<Vec<Tensor>> {
        let (t, k) = x.dims2()?;
        let quant: Option<Vec<(&QMatrix, Kernel)>> = ws
            .iter()
            .map(|w| match w {
                Weight::Quant(q, kernel) => Some((q, *kernel)),
                Weight::Dense(_) => None,
            })
            .collect();
        let kernel = quant.as_ref().and_then(|q| q.first()).map(|(_, k)| *k);
        match (quant, kernel) {
            (Some(qs), Some(kernel))
                if t < DEQUANTIZE_MIN_ROWS
                    && qs.iter().all(|(q, kk)| q.shape().1 == k && *kk == kernel) =>
            {
                let mats: Vec<&QMatrix> = qs.iter().map(|(q, _)| *q).collect();
                decode_products(&mats, kernel, x)
            }
            _ => ws.iter().map(|w| w.forward(x)).collect(),
        }
    }

    /// Rows `ids` as f32 `[ids, cols]` (the token-embedding lookup).
    pub(super) fn rows(&self, ids: &[u32], device: &Device) -> candle_core::Result<Tensor> {
        match self {
            Weight::Dense(l) => {
                let idx = Tensor::new(ids, device)?;
                l.weight().index_select(&idx, 0)
            }
            Weight::Quant(q, _) => {
                let cols = q.shape().1;
                let mut out = vec![0f32; ids.len() * cols];
                for (row, &id) in out.chunks_exact_mut(cols).zip(ids) {
                    q.dequantize_row(id as usize, row);
                }
                Tensor::from_vec(out, (ids.len(), cols), device)
            }
        }
    }

    /// Bytes the weights take in memory.
    pub(super) fn bytes(&self) -> usize {
        match self {
            Weight::Dense(l) => l.weight().elem_count() * 4,
            Weight::Quant(q, _) => q.bytes(),
        }
    }
}

/// Rows `band` of a `[rows, cols]` GGUF tensor's raw bytes `raw` as a
/// tensor of its own (a band to re-quantize, a part of a fused matrix).
/// Rows are independent in every GGUF type (a block never spans two rows).
/// The bytes are borrowed: no copy, and a slice of `raw` is aligned for
/// its type even when empty.
fn row_band(
    raw: &[u8],
    dtype: GgmlDType,
    rows: usize,
    cols: usize,
    band: std::ops::Range<usize>,
    device: &Device,
) -> candle_core::Result<QTensor> {
    let row_bytes = raw.len() / rows.max(1);
    let bytes = &raw[band.start * row_bytes..band.end * row_bytes];
    let storage = QStorage::from_data(std::borrow::Cow::Borrowed(bytes), device, dtype)?;
    QTensor::new(storage, (band.len(), cols))
}

/// `x · Wⱼᵀ` for a few activation rows `x` (a decode step) with the
/// quantized dot products, one [`QMatrix::matmul_t_many`] for the group.
fn decode_products(
    mats: &[&QMatrix],
    kernel: Kernel,
    x: &Tensor,
) -> candle_core::Result<Vec<Tensor>> {
    let t = x.dims2()?.0;
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let mut outs: Vec<Vec<f32>> = mats.iter().map(|q| vec![0f32; t * q.shape().0]).collect();
    let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
    QMatrix::matmul_t_many(mats, &xs, &mut slices, kernel);
    outs.into_iter()
        .zip(mats)
        .map(|(o, q)| Tensor::from_vec(o, (t, q.shape().0), x.device()))
        .collect()
}

/// The GGUF tensor types a generation stage loads.
pub(super) const SERVED_TYPES: [GgmlDType; 9] = [
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::Q8_0,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// Refuses a tensor type outside [`SERVED_TYPES`], naming it.
fn check_served(name: &str, dtype: GgmlDType) -> candle_core::Result<()> {
    if SERVED_TYPES.contains(&dtype) {
        return Ok(());
    }
    let names: Vec<String> = SERVED_TYPES.iter().map(|t| format!("{t:?}")).collect();
    candle_core::bail!(
        "{name} is stored as {dtype:?}, a tensor type this stage does not load (supported: {})",
        names.join(", ")
    )
}

/// Reads one tensor from the GGUF and dequantizes it to f32.
pub(super) fn load_f32(
    ct: &gguf_file::Content,
    file: &mut File,
    name: &str,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let q = ct.tensor(file, name, device)?;
    check_served(name, q.dtype())?;
    q.dequantize(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A matrix larger than one dequantized tile (two bands and a part)
    /// gives the product with the whole dequantized matrix, with the tile
    /// on either side of the GEMM (fewer rows than
    /// [`WEIGHT_LEFT_MAX_ROWS`], and that many); so does this CPU's own
    /// path (on AVX-512 VNNI the integer GEMM).
    #[test]
    fn banded_product_equals_the_whole_dequantized_product() {
        let (rows, cols) = (2 * DEQUANTIZE_TILE_BYTES / (64 * 4) + 7, 64);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 700.0)
            .collect();
        let q = QMatrix::q8_0(&w, rows, cols);
        let dense = Tensor::from_vec(q.dequantize(), (rows, cols), &Device::Cpu).unwrap();
        let weights = [Kernel::Portable, Kernel::detect()].map(|k| Weight::Quant(q.clone(), k));
        for (weight, t) in weights
            .iter()
            .flat_map(|w| [(w, DEQUANTIZE_MIN_ROWS), (w, WEIGHT_LEFT_MAX_ROWS)])
        {
            let x: Vec<f32> = (0..t * cols)
                .map(|i| ((i % 13) as f32 - 6.0) / 5.0)
                .collect();
            let x = Tensor::from_vec(x, (t, cols), &Device::Cpu).unwrap();
            let got = weight.forward(&x).unwrap();
            let want = x.matmul(&dense.t().unwrap()).unwrap();
            assert_eq!(got.dims(), &[t, rows]);
            let diff = (got - want).and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>());
            let diff = diff.unwrap();
            assert!(diff < 1e-3, "{t} rows: largest difference {diff}");
        }
    }
}
