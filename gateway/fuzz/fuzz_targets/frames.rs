//! libFuzzer entry point of [`fuzz::frames`].
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz::frames::run(data));
