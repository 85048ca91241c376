//! Waiting for a state to appear instead of sleeping for a guessed time.

use std::panic::Location;
use std::time::{Duration, Instant};

/// How long an awaited state gets to appear: far more than a healthy run needs, even on a
/// loaded CI machine, so that only a state that never comes fails a test.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Between two looks at the state.
const INTERVAL: Duration = Duration::from_millis(10);

/// Waits until `condition` holds; panics naming `what`, and the line that waited, if it does
/// not within [`DEADLINE`].
#[track_caller]
pub fn poll_until(what: &str, mut condition: impl FnMut() -> bool) -> impl Future<Output = ()> {
    wait(Location::caller(), what, async move || condition())
}

/// Like [`poll_until`], for a condition that has to be awaited (a request, a connection).
#[track_caller]
pub fn eventually(what: &str, condition: impl AsyncFnMut() -> bool) -> impl Future<Output = ()> {
    wait(Location::caller(), what, condition)
}

/// Sends a write with `send` until its resource's quarantine lets it through; returns the
/// first answer that is not `503 resource_quarantined`.
pub async fn past_quarantine(mut send: impl AsyncFnMut() -> super::Resp) -> super::Resp {
    let mut answer = None;
    eventually("the quarantine ends", async || {
        let r = send().await;
        let through = r.fencegate_error() != Some("resource_quarantined");
        answer = Some(r);
        through
    })
    .await;
    answer.expect("a write went through")
}

/// Not an `async fn` above: those cannot report their caller.
async fn wait(caller: &Location<'_>, what: &str, mut condition: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !condition().await {
        assert!(start.elapsed() < DEADLINE, "{caller}: not within {DEADLINE:?}: {what}");
        tokio::time::sleep(INTERVAL).await;
    }
}

/// The value `slot` holds once one is set; panics after [`DEADLINE`] with `missing` ("no
/// request held"), or once every sender is gone.
pub async fn filled<T: Clone>(slot: &mut tokio::sync::watch::Receiver<Option<T>>, missing: &str) -> T {
    let held = tokio::time::timeout(DEADLINE, slot.wait_for(Option::is_some))
        .await
        .unwrap_or_else(|_| panic!("{missing} within {DEADLINE:?}"))
        .expect("the relay dropped the hold (it stopped)");
    held.clone().expect("waited for it")
}
