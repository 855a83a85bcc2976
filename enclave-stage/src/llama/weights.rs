//! Weight matrices in one of the [`WeightFormat`]s, applied as `x · Wᵀ`.

use super::*;

/// Products with at least this many activation rows dequantize the weights
/// and use the f32 GEMM; fewer use the quantized dot products, which read a
/// quarter (Q8_0) or a sixth (Q4_1) of the f32 weight bytes.
pub(super) const DEQUANTIZE_MIN_ROWS: usize = 48;

/// A weight matrix `[out, in]` applied as `x · Wᵀ`: f32 (Candle's GEMM), or
/// quantized blocks ([`crate::qmatmul`]).
pub(super) enum Weight {
    Dense(Linear),
    Quant(QMatrix, Kernel),
}

impl Weight {
    /// Loads GGUF tensor `name` in `format`: Q4_1 blocks are taken as
    /// stored; anything else is dequantized first (and, for Q8_0, quantized
    /// again).
    pub(super) fn load(
        ct: &gguf_file::Content,
        file: &mut File,
        name: &str,
        format: WeightFormat,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let q = ct.tensor(file, name, device)?;
        let (rows, cols) = q.shape().dims2()?;
        Ok(match format {
            WeightFormat::F32 => Weight::Dense(Linear::new(q.dequantize(device)?, None)),
            WeightFormat::Q4_1 => {
                let m = match q.dtype() {
                    GgmlDType::Q4_1 => QMatrix::from_ggml_q4_1(&q.data()?, rows, cols),
                    GgmlDType::Q8_0 => QMatrix::from_ggml_q8_0(&q.data()?, rows, cols),
                    other => Err(format!(
                        "stored as {other:?}; q4_1 serves the GGUF's Q4_1 and Q8_0 blocks as they are"
                    )),
                }
                .map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
                Weight::Quant(m, Kernel::detect())
            }
            WeightFormat::Q8_0 if q.dtype() == GgmlDType::Q8_0 => {
                let m = QMatrix::from_ggml_q8_0(&q.data()?, rows, cols)
                    .map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
                Weight::Quant(m, Kernel::detect())
            }
            WeightFormat::Q8_0 => {
                let f = q.dequantize(device)?.flatten_all()?.to_vec1::<f32>()?;
                Weight::Quant(QMatrix::q8_0(&f, rows, cols), Kernel::detect())
            }
        })
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
                if t >= DEQUANTIZE_MIN_ROWS {
                    // A prefill (or a large decode batch): the matrix is
                    // dequantized for this product only (a transient f32
                    // buffer of at most a few MiB) and goes through Candle's
                    // f32 GEMM, which re-uses each weight across many rows.
                    // The activations are f32 on both paths, so the result is
                    // the same product up to summation order.
                    let w = Tensor::from_vec(q.dequantize(), (rows, cols), x.device())?;
                    return x.matmul(&w.t()?);
                }
                let xs = x.flatten_all()?.to_vec1::<f32>()?;
                let mut out = vec![0f32; t * rows];
                q.matmul_t(&xs, &mut out, *kernel);
                Tensor::from_vec(out, (t, rows), x.device())
            }
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

/// Reads one tensor from the GGUF and dequantizes it to f32.
pub(super) fn load_f32(
    ct: &gguf_file::Content,
    file: &mut File,
    name: &str,
    device: &Device,
) -> candle_core::Result<Tensor> {
    ct.tensor(file, name, device)?.dequantize(device)
}
