//! libFuzzer entry point of [`fuzz::evidence`].
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz::evidence::run(data));
