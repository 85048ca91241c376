//! `max_seen` on disk and the real binary around it: the data directory, the commands,
//! `kill -9` at random moments and a disk that fails for real, a full disk and no file
//! descriptors left, stalled syncs, and faults of the disk itself (`disk_faults`). One test
//! binary, with the harness in `common`.
//!
//! `FG_CRASH_ROUNDS` sets the rounds of the random-kill tests in `crash` (see that module).

#[path = "../common/mod.rs"]
mod common;

mod binary;
mod crash;
mod data_dir;
mod disk_faults;
mod exhaustion;
mod stalls;
