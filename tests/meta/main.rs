//! Checks of the repository rather than of a running proxy: the layout's dependency rules
//! read from `src/`, the documentation's links and config keys, the deployment files, and
//! the fuzz corpus replayed. One test binary, without the harness.

#[path = "../common/skips.rs"]
mod skips;

mod deploy;
mod docs;
mod fuzz_corpus;
mod layout;
