#![no_main]
//! `cargo fuzz run recovery`: see `fencegate::fuzzing::recovery` for the properties checked.

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencegate::fuzzing::recovery(data));
