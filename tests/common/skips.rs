//! Tests that skip because the machine lacks something (a service, root, python3): each says
//! so on stderr, which libtest captures and shows only for failed tests, so a skipped test
//! would look like a passed one. [`skip`] also records it, and when the test binary exits one
//! line on the real stderr lists every test it skipped and why, after libtest's summary.
//!
//! How the line gets out: a function registered once with the C library's `atexit`. libtest
//! ends the process with `exit()` (through `std::process::exit` when a test failed, or by
//! returning from `main`), which runs it on the main thread, whose output libtest does not
//! capture. A `Drop` of a static would not do: Rust never drops statics. The function does
//! not unwind (an `extern "C"` function that panicked would abort) and takes the list with
//! `try_lock`, so a test thread that still holds it at exit cannot hang the process.
//!
//! With `FG_REQUIRE_SERVICES=1` (set by `.ci/run`, where everything is installed and the
//! tests run as root) a test that would skip for a missing service or root fails instead: see
//! [`required`].
#![allow(dead_code)]

use std::io::Write;
use std::sync::{Mutex, Once, TryLockError};

/// Set to `1` where nothing may be skipped (CI): a missing service, or a missing root, fails
/// the test.
pub const REQUIRE: &str = "FG_REQUIRE_SERVICES";

/// Every skip so far: the test's name and why.
static SKIPPED: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());
static AT_EXIT: Once = Once::new();

/// Whether skipping is forbidden here ([`REQUIRE`]).
pub fn required() -> bool {
    std::env::var(REQUIRE).is_ok_and(|v| v == "1")
}

/// Records that the running test skips, and why; the caller then returns from the test.
/// Callers that must not skip under [`REQUIRE`]`=1` check [`required`] first.
pub fn skip(reason: &str) {
    // libtest runs each test on a thread named after it.
    let test = std::thread::current().name().unwrap_or("a test").to_owned();
    eprintln!("{test}: SKIPPED: {reason}");
    SKIPPED.lock().unwrap_or_else(|e| e.into_inner()).push((test, reason.to_owned()));
    AT_EXIT.call_once(|| {
        // SAFETY: `report` is a plain function that lives as long as the process, takes no
        // arguments and never unwinds, which is all `atexit` asks of it.
        let registered = unsafe { libc::atexit(report) };
        if registered != 0 {
            eprintln!("cannot register the list of skipped tests to print at exit");
        }
    });
}

/// Prints the skipped tests on one line of the process's stderr; runs at exit.
extern "C" fn report() {
    let skipped = match SKIPPED.try_lock() {
        Ok(skipped) => skipped,
        Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        Err(TryLockError::WouldBlock) => {
            let _ = std::io::stderr().write_all(b"SKIPPED: some tests (the list was busy at exit)\n");
            return;
        }
    };
    if skipped.is_empty() {
        return;
    }
    let list: Vec<String> = skipped.iter().map(|(test, why)| format!("{test} ({why})")).collect();
    let line = format!("SKIPPED {} test(s), counted as passed above: {}\n", skipped.len(), list.join("; "));
    let _ = std::io::stderr().write_all(line.as_bytes());
}
