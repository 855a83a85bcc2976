//! libFuzzer entry point of [`fuzz::channel`].
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz::channel::run(data));
