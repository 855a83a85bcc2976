//! The matrix products Candle lacks, written for this CPU: block-quantized
//! weights times f32 activations ([`qmatmul`], the generation stages) and
//! bf16 weights ([`bf16_matmul`], the embedding stages), with the one
//! detection of the CPU features their kernels need ([`CpuFeatures`]).

pub mod bf16_matmul;
pub mod qmatmul;

use candle_core::{CpuStorage, Layout, Result};
use std::sync::OnceLock;

/// The f32 values of a contiguous Candle custom-op input (`what` names it
/// in the error); the bf16 products and the BERT layer's fused ops take
/// their inputs through it.
pub(crate) fn contiguous<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let data = s.as_slice::<f32>()?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{what}: input must be contiguous"),
    }
}

/// What this CPU offers the kernels, detected once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuFeatures {
    /// x86-64 AVX2 and FMA.
    pub avx2_fma: bool,
    /// x86-64 AVX-512 F, BW and VNNI (`vpdpwssd`).
    pub avx512_vnni: bool,
    /// x86-64 AVX-512 F and BF16 (`vdpbf16ps`).
    pub avx512_bf16: bool,
}

impl CpuFeatures {
    /// This CPU's features.
    pub fn get() -> Self {
        static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
        *FEATURES.get_or_init(Self::detect)
    }

    #[cfg(target_arch = "x86_64")]
    fn detect() -> Self {
        use std::arch::is_x86_feature_detected as has;
        Self {
            avx2_fma: has!("avx2") && has!("fma"),
            avx512_vnni: has!("avx512f") && has!("avx512bw") && has!("avx512vnni"),
            avx512_bf16: has!("avx512f") && has!("avx512bf16"),
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn detect() -> Self {
        Self {
            avx2_fma: false,
            avx512_vnni: false,
            avx512_bf16: false,
        }
    }
}
