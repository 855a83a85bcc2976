//! libFuzzer entry point of [`fuzz::config`].
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz::config::run(data));
