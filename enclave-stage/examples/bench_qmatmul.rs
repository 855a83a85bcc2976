//! One decode step's matrix-vector products on each quantized kernel this
//! CPU runs, side by side: a 1B-class Llama layer's shapes (hidden 2048,
//! FFN 8192) in Q4_1, Q4_K, Q6_K and Q8_0 blocks, one activation row, on the Rayon pool
//! as a stage runs them. Each product takes the next of enough copies of
//! the matrix to fill 512 MB, so the weights come from memory as in a
//! decode step and not from the last-level cache. Prints the median time
//! per product and the weight bytes read per second, to see whether a
//! kernel is bound by arithmetic or by memory, and how fast each matrix is
//! dequantized for a prefill's f32 GEMM
//! (`cargo run --release --example bench_qmatmul`).

use candle_core::quantized::GgmlDType;
use enclave_stage::kernels::qmatmul::{Kernel, QMatrix};
use std::time::Instant;

/// ggml Q4_1 blocks with pseudo-random nibbles and scales.
fn q4_1_raw(rows: usize, cols: usize, seed: &mut u64) -> Vec<u8> {
    let mut next = || {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    };
    let mut raw = Vec::with_capacity(rows * cols / 32 * 20);
    for _ in 0..rows * cols / 32 {
        let d = half::f16::from_f32(0.01 + (next() % 100) as f32 * 1e-4);
        let m = half::f16::from_f32(-0.08);
        raw.extend_from_slice(&d.to_bits().to_le_bytes());
        raw.extend_from_slice(&m.to_bits().to_le_bytes());
        raw.extend((0..16).map(|_| next() as u8));
    }
    raw
}

fn main() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let shapes = [(2048usize, 2048usize), (8192, 2048), (2048, 8192)];
    println!("threads: {}", rayon::current_num_threads());
    for (rows, cols) in shapes {
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 2003) as f32 - 1001.0) / 1001.0)
            .collect();
        let t = candle_core::Tensor::from_vec(w.clone(), (rows, cols), &candle_core::Device::Cpu)
            .unwrap();
        let q4k = candle_core::quantized::QTensor::quantize(&t, GgmlDType::Q4K).unwrap();
        let q6k = candle_core::quantized::QTensor::quantize(&t, GgmlDType::Q6K).unwrap();
        let mats = [
            (
                "Q4_1",
                QMatrix::from_ggml_q4_1(&q4_1_raw(rows, cols, &mut seed), rows, cols).unwrap(),
            ),
            (
                "Q4_K",
                QMatrix::from_ggml_q4_k(&q4k.data().unwrap(), rows, cols).unwrap(),
            ),
            (
                "Q6_K",
                QMatrix::from_ggml_q6_k(&q6k.data().unwrap(), rows, cols).unwrap(),
            ),
            ("Q8_0", QMatrix::q8_0(&w, rows, cols)),
        ];
        for (name, m) in &mats {
            let copies = vec![m.clone(); (512 << 20) / m.bytes() + 1];
            for kernel in Kernel::available() {
                let mut out = vec![0f32; rows];
                let mut times = Vec::new();
                for i in 0..copies.len().max(60) {
                    let t = Instant::now();
                    copies[i % copies.len()].matmul_t(&x, &mut out, kernel);
                    times.push(t.elapsed().as_secs_f64());
                }
                times.sort_by(f64::total_cmp);
                let med = times[times.len() / 2];
                println!(
                    "{name} [{rows}, {cols}] {:>10}: {:8.1} µs  {:6.2} GB/s",
                    kernel.name(),
                    med * 1e6,
                    m.bytes() as f64 / med / 1e9
                );
            }
            // A prefill dequantizes each matrix once per product, in bands
            // of rows of 4 MiB of f32 (as `Weight::forward` does).
            let band = (4 << 20) / (cols * 4);
            let mut times = Vec::new();
            for copy in copies.iter().take(20) {
                let t = Instant::now();
                for r0 in (0..rows).step_by(band) {
                    std::hint::black_box(copy.dequantize_rows(r0..rows.min(r0 + band)));
                }
                times.push(t.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            let med = times[times.len() / 2];
            println!(
                "{name} [{rows}, {cols}] dequantize: {:8.1} µs  {:6.2} G values/s",
                med * 1e6,
                (rows * cols) as f64 / med / 1e9
            );
        }
    }
}
