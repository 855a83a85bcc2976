//! libFuzzer entry point of [`fuzz::sealing`].
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz::sealing::run(data));
