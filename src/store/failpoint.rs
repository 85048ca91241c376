//! Fail points for the tests that stop a process at a chosen moment.

/// A fail point the cluster's tests stall a process at (the `failpoints` feature): in the
/// store's takeover, and in upstream's sends; with
/// the action `return(MS)` it logs that it was reached (the test stops the process on that
/// line), waits `MS` milliseconds, and logs how long it was held up. Nothing without the
/// feature.
pub(crate) fn failpoint(name: &'static str) {
    #[cfg(feature = "failpoints")]
    fail::fail_point!(name, |arg: Option<String>| {
        let ms = arg.and_then(|a| a.parse().ok()).unwrap_or(0);
        tracing::warn!(failpoint = name, "failpoint reached");
        let started = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(ms));
        let stalled_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        tracing::warn!(failpoint = name, stalled_ms, "failpoint passed");
    });
    #[cfg(not(feature = "failpoints"))]
    let _ = name;
}
