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
pub mod config;
pub mod evidence;
pub mod frames;
pub mod host_channel;
pub mod openai;
pub mod receipt;
pub mod sealing;
pub mod seeds;
pub mod sse;

/// A target: runs one input.
pub type Target = fn(&[u8]);

/// Every target by name (the `fuzz_targets/` binaries and corpus folders).
pub const TARGETS: &[(&str, Target)] = &[
    ("channel", channel::run),
    ("config", config::run),
    ("evidence", evidence::run),
    ("frames", frames::run),
    ("host_channel", host_channel::run),
    ("openai", openai::run),
    ("receipt", receipt::run),
    ("sealing", sealing::run),
    ("sse", sse::run),
];

/// Splits off the first byte, which targets with several parsers use to
/// choose one (so one corpus covers related formats).
pub(crate) fn selector(data: &[u8]) -> Option<(u8, &[u8])> {
    data.split_first().map(|(&s, rest)| (s, rest))
}

/// A seeded generator: a fuzz input must replay the same way every time.
pub(crate) fn rng() -> rand_chacha::ChaCha20Rng {
    rand::SeedableRng::seed_from_u64(0x5eed)
}
