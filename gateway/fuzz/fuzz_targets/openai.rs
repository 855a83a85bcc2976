//! libFuzzer entry point of [`fuzz::openai`].
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz::openai::run(data));
