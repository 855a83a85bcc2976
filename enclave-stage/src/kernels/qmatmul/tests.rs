//! The kernels against the dequantized product, the ggml block readers
//! against Candle's port of ggml, and the quantization error.

use super::blocks::SUPER;
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

/// Reads ggml blocks of one type into a matrix.
type FromGgml = fn(&[u8], usize, usize) -> Result<QMatrix, String>;

/// Each block type the matrices take from a GGUF, with its reader.
fn ggml_cases() -> [(candle_core::quantized::GgmlDType, FromGgml); 5] {
    use candle_core::quantized::GgmlDType;
    [
        (GgmlDType::Q4_0, QMatrix::from_ggml_q4_0),
        (GgmlDType::Q4_1, QMatrix::from_ggml_q4_1),
        (GgmlDType::Q8_0, QMatrix::from_ggml_q8_0),
        (GgmlDType::Q4K, QMatrix::from_ggml_q4_k),
        (GgmlDType::Q6K, QMatrix::from_ggml_q6_k),
    ]
}

/// Q4_0, Q4_1, Q8_0, Q4_K and Q6_K blocks, quantized by Candle's port of
/// ggml and taken as stored, dequantize to exactly Candle's (= ggml's)
/// values.
#[test]
fn ggml_blocks_dequantize_as_ggml_does() {
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};
    let (rows, cols) = (6, 512);
    let w = random(rows * cols, 11);
    let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
    for (dtype, from) in ggml_cases() {
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
        for kernel in Kernel::available() {
            m.matmul_t(&x, &mut out, kernel);
            for (a, b) in out.iter().zip(reference(&m, &x)) {
                assert!(
                    (a - b).abs() < 1e-2 * b.abs().max(1.0),
                    "{dtype:?} {kernel:?}: {a} vs {b}"
                );
            }
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

/// K-quant super-blocks as ggml writes them (Candle's port), from `w`.
fn ggml_k(
    w: &[f32],
    rows: usize,
    cols: usize,
    dtype: candle_core::quantized::GgmlDType,
) -> Vec<u8> {
    use candle_core::quantized::QTensor;
    let t =
        candle_core::Tensor::from_vec(w.to_vec(), (rows, cols), &candle_core::Device::Cpu).unwrap();
    QTensor::quantize(&t, dtype)
        .unwrap()
        .data()
        .unwrap()
        .to_vec()
}

/// The matrix in every block kind `cols` allows (Q4_K needs whole
/// super-blocks of 256).
fn matrices(w: &[f32], rows: usize, cols: usize) -> Vec<QMatrix> {
    let mut all = vec![
        QMatrix::q8_0(w, rows, cols),
        QMatrix::from_ggml_q4_1(&ggml_q4_1(w), rows, cols).unwrap(),
    ];
    if cols.is_multiple_of(SUPER * BLOCK) {
        use candle_core::quantized::GgmlDType::{Q4K, Q6K};
        all.push(QMatrix::from_ggml_q4_k(&ggml_k(w, rows, cols, Q4K), rows, cols).unwrap());
        all.push(QMatrix::from_ggml_q6_k(&ggml_k(w, rows, cols, Q6K), rows, cols).unwrap());
    }
    all
}

#[test]
fn kernels_match_the_dequantized_product() {
    let kernels = Kernel::available();
    // Row counts that leave 1-3 rows after the groups of four; one and
    // many activation rows (decode, prefill).
    for (rows, cols, m) in [
        (7, 64, 1),
        (70, 96, 3),
        (576, 576, 17),
        (33, 1536, 2),
        (9, 512, 1),
    ] {
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
            for &kernel in &kernels {
                let mut got = vec![0f32; m * rows];
                w.matmul_t(&x, &mut got, kernel);
                for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                    let rounding = match kernel {
                        Kernel::Avx2 | Kernel::Avx512 => bound(i / rows, i % rows),
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

/// Products of several matrices sharing one input, of every block kind
/// mixed and of different heights, equal each matrix's own product bit for
/// bit: serially (a decode step's small group) and across the pool.
#[test]
fn grouped_products_equal_each_product() {
    let cols = 512;
    for (heights, m) in [(&[3usize, 5, 2][..], 1), (&[600, 130, 257, 64][..], 2)] {
        let mats: Vec<QMatrix> = heights
            .iter()
            .enumerate()
            .flat_map(|(i, &rows)| matrices(&random(rows * cols, 40 + i as u64), rows, cols))
            .collect();
        let refs: Vec<&QMatrix> = mats.iter().collect();
        let x = random(m * cols, 41);
        for kernel in Kernel::available() {
            let mut outs: Vec<Vec<f32>> = mats.iter().map(|w| vec![0f32; m * w.rows]).collect();
            let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(Vec::as_mut_slice).collect();
            QMatrix::matmul_t_many(&refs, &x, &mut slices, kernel);
            for (w, got) in mats.iter().zip(&outs) {
                let mut want = vec![0f32; m * w.rows];
                w.matmul_t(&x, &mut want, kernel);
                assert_eq!(
                    got,
                    &want,
                    "{kernel:?} {} bytes, {}x{cols}",
                    w.bytes(),
                    w.rows
                );
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

/// The prefill GEMM (AVX-512 VNNI) against the dequantized product for
/// every block kind, with rows that fill no whole panel and activation
/// rows that fill no whole tile.
#[cfg(target_arch = "x86_64")]
#[test]
fn prefill_gemm_equals_the_dequantized_product() {
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};
    if Kernel::detect() != Kernel::Avx512 {
        eprintln!("SKIPPED: this CPU has no AVX-512 VNNI");
        return;
    }
    let (rows, cols, m) = (37, 512, 7);
    let w = random(rows * cols, 31);
    let t = Tensor::from_vec(w.clone(), (rows, cols), &Device::Cpu).unwrap();
    // Blocks of very different sizes, as a model's activations have.
    let mut x = random(m * cols, 32);
    for (i, v) in x.iter_mut().enumerate() {
        *v *= [0.01f32, 1.0, 40.0][(i / BLOCK) % 3];
    }
    for (dtype, from) in ggml_cases() {
        let q = QTensor::quantize(&t, dtype).unwrap();
        let mat = from(&q.data().unwrap(), rows, cols).unwrap();
        let mut out = vec![f32::NAN; m * rows];
        // SAFETY: the CPU has AVX-512 VNNI (checked above).
        unsafe { mat.matmul_t_prefill(&x, &mut out) };
        let want = reference(&mat, &x);
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        for (i, (a, b)) in out.iter().zip(&want).enumerate() {
            assert!((a - b).abs() <= 1e-4 * scale, "{dtype:?} [{i}]: {a} vs {b}");
        }
    }
    // Q6_K's widest integers, (0 − 32) · −128 = 4096 in every block, times
    // activations that all round to the largest value: 32 products a
    // block reach 2³¹ − 2¹⁷ and must not wrap.
    let mut raw = Vec::new();
    for _ in 0..rows * cols / 256 {
        raw.extend_from_slice(&[0u8; 128 + 64]);
        raw.extend_from_slice(&[(-128i8) as u8; 16]);
        raw.extend_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
    }
    let mat = QMatrix::from_ggml_q6_k(&raw, rows, cols).unwrap();
    let x = vec![1.0f32; m * cols];
    let mut out = vec![0f32; m * rows];
    // SAFETY: as above.
    unsafe { mat.matmul_t_prefill(&x, &mut out) };
    let want = 4096.0 * cols as f32;
    assert!(
        out.iter().all(|&v| (v - want).abs() <= 1e-5 * want),
        "{:?}",
        &out[..4]
    );
    // Blocks so small that 1 / scale is infinite still round within the
    // bound (else the sums wrap and the result turns negative).
    let tiny = vec![1e-36f32; m * cols];
    // SAFETY: as above.
    unsafe { mat.matmul_t_prefill(&tiny, &mut out) };
    let want = 4096.0 * cols as f32 * 1e-36;
    assert!(
        out.iter().all(|&v| (v - want).abs() <= 1e-3 * want),
        "{:?} against {want}",
        &out[..4]
    );
}
