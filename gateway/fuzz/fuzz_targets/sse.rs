//! libFuzzer entry point of [`fuzz::sse`].
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz::sse::run(data));
