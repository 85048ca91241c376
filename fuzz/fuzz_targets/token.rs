#![no_main]
//! `cargo fuzz run token`: see `fencegate::fuzzing::token` for the properties checked.

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencegate::fuzzing::token(data));
