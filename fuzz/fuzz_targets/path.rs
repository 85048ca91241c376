#![no_main]
//! `cargo fuzz run path`: see `fencegate::fuzzing::path` for the properties checked.

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencegate::fuzzing::path(data));
