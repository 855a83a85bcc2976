//! libFuzzer entry point of [`fuzz::host_channel`].
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| fuzz::host_channel::run(data));
