//! Fuzz targets: every parser that takes bytes from outside its process, one
//! function per target, each taking the fuzzer's bytes.
//!
//! libFuzzer runs them through `fuzz_targets/` (`scripts/fuzz.sh`, which
//! builds with `cargo fuzz` on the stable toolchain, without a sanitizer);
//! `tests/replay.rs` runs every committed corpus file through the same
//! functions in the ordinary test suite, so a fixed crash stays fixed.
//! A target panics only when the code under test misbehaves: a panic inside
//! a parser, or a broken property (a tampered sealed body that opens, a
//! message whose re-encoding differs).

pub mod channel;
#[cfg(feature = "stage")]
pub mod config;
pub mod evidence;
pub mod frames;
#[cfg(feature = "stage")]
pub mod host_channel;
pub mod openai;
pub mod receipt;
pub mod sealing;
pub mod seeds;
pub mod sse;

/// A target: runs one input.
pub type Target = fn(&[u8]);

/// Every target by name (the `fuzz_targets/` binaries and corpus folders).
pub fn targets() -> Vec<(&'static str, Target)> {
    let mut all: Vec<(&'static str, Target)> = vec![
        ("channel", channel::run),
        ("evidence", evidence::run),
        ("frames", frames::run),
        ("openai", openai::run),
        ("receipt", receipt::run),
        ("sealing", sealing::run),
        ("sse", sse::run),
    ];
    #[cfg(feature = "stage")]
    all.extend([
        ("config", config::run as Target),
        ("host_channel", host_channel::run as Target),
    ]);
    all.sort_by_key(|(name, _)| *name);
    all
}

/// Splits off the first byte, which targets with several parsers use to
/// choose one (so one corpus covers related formats).
pub(crate) fn selector(data: &[u8]) -> Option<(u8, &[u8])> {
    data.split_first().map(|(&s, rest)| (s, rest))
}

/// A seeded generator: a fuzz input must replay the same way every time.
pub(crate) fn rng() -> rand_chacha::ChaCha20Rng {
    rand::SeedableRng::seed_from_u64(0x5eed)
}
