//! Whether a store could open a data directory now, asked without changing it: what
//! `fencegate check` reports before `run` would refuse.

use std::fs::{OpenOptions, TryLockError};
use std::path::Path;

use rustix::fs::{Access, access};

use super::StoreError;
use super::file::{KEYING_FILE, LOCK_FILE, write_err};
use super::init::{check_initialised, check_log_kept};
use super::recovery::io_err;

/// A data directory a store could open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usable {
    /// Nobody holds it.
    Free,
    /// A running fencegate holds it (as when a config is checked before a reload).
    InUse,
}

/// Checks, without writing anything, that a store configured with `keying` could open `dir`:
/// initialised, its log kept, made under the same key rules, writable, and whether someone holds it.
pub fn check_usable(dir: &Path, keying: &str) -> Result<Usable, StoreError> {
    check_initialised(dir)?;
    let keying_path = dir.join(KEYING_FILE);
    match std::fs::read_to_string(&keying_path) {
        Ok(recorded) if recorded != keying => {
            return Err(StoreError::KeyingChanged { dir: dir.to_owned(), recorded, configured: keying.to_owned() });
        }
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(&keying_path, e)),
    }
    // After the key rules, in the order a store's open checks them.
    check_log_kept(dir)?;
    // New segments and snapshots are made in the directory itself.
    access(dir, Access::WRITE_OK | Access::EXEC_OK).map_err(|e| write_err(dir, dir, e.into()))?;
    let lock_path = dir.join(LOCK_FILE);
    let file = match OpenOptions::new().write(true).open(&lock_path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Usable::Free),
        Err(e) => return Err(write_err(dir, &lock_path, e)),
    };
    match file.try_lock() {
        Ok(()) => Ok(Usable::Free),
        Err(TryLockError::WouldBlock) => Ok(Usable::InUse),
        Err(TryLockError::Error(e)) => Err(io_err(&lock_path, e)),
    }
}
