//! libFuzzer entry point of [`fuzz::receipt`].
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz::receipt::run(data));
