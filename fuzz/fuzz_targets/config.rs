#![no_main]
//! `cargo fuzz run config`: see `fencegate::fuzzing::config` for the properties checked.

libfuzzer_sys::fuzz_target!(|data: &[u8]| fencegate::fuzzing::config(data));
