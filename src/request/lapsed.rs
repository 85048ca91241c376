//! A write that reached the backend after its permission to be sent lapsed. A shared fence's
//! leader checks its permit before the head and each body chunk, but no check can follow the
//! send itself: a leader paused between its last check and the write syscall (SIGSTOP, a long
//! preemption, a frozen VM) sends on waking, perhaps after a newer holder's write
//! (docs/cluster.md: the window no proxy closes). fencegate cannot stop that send, but it can
//! see it afterwards: the write's end (the backend's answer, or an unknown outcome) comes after
//! the permit lapsed, long after the write's last check. It says so, with how long the write was
//! held between the two, so that an operator (and the fault tests) can tell a write that
//! crossed the window from one the fence let through wrongly.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use http::StatusCode;
use tokio::time::Instant;

use super::fenced::outcome;
use crate::fence::Outcome;
use crate::refusal::Refusal;
use crate::state::Metrics;
use crate::store::Permit;

/// A permit whose checks are watched: [`Watched::permit`] is handed to the send, and
/// [`Watched::ended`] looks at the permit once the write has ended.
pub(super) struct Watched {
    permit: Permit,
    origin: Instant,
    checks: Arc<Checks>,
}

/// What the send's checks found.
#[derive(Default)]
struct Checks {
    /// Microseconds from `origin` to the last check that let something go.
    last_pass: AtomicU64,
    /// Checks that let something go.
    passes: AtomicU64,
    /// Whether a check stopped the write: the self-fence withdrew it or cut it off, and the
    /// backend never had it whole.
    stopped: AtomicBool,
}

impl Watched {
    /// Watches `permit` from now: made once the write's advance is durable, just before its
    /// send.
    pub(super) fn new(permit: Permit) -> Self {
        Watched { permit, origin: Instant::now(), checks: Arc::default() }
    }

    /// The permit the send checks.
    pub(super) fn permit(&self) -> Permit {
        let (permit, checks, origin) = (Arc::clone(&self.permit), Arc::clone(&self.checks), self.origin);
        Arc::new(move || {
            let open = permit();
            match open {
                true => {
                    checks.last_pass.store(micros_since(origin), Ordering::Relaxed);
                    checks.passes.fetch_add(1, Ordering::Relaxed);
                }
                false => checks.stopped.store(true, Ordering::Relaxed),
            }
            open
        })
    }

    /// Once `path`'s write of `token` has ended with `result`: an answer (whose status
    /// `status_of` reads), a refusal that leaves its outcome unknown, or one that says it
    /// applied nothing. Whether it may have reached the backend after the permit lapsed, said
    /// in a warning and a count with how long the write was held since its last passed check
    /// (since it was let go, where none passed). A write a check stopped, or one the backend
    /// refused (4xx), applied nothing and is not named.
    pub(super) fn ended<T>(
        &self,
        metrics: &Metrics,
        path: &str,
        token: u64,
        result: &Result<T, Refusal>,
        status_of: impl FnOnce(&T) -> Option<StatusCode>,
    ) -> bool {
        let status = match result {
            Ok(answer) => match status_of(answer) {
                Some(status) => Some(status),
                None => return false,
            },
            Err(_) if outcome(result) == Outcome::Unknown => None,
            Err(_) => return false,
        };
        if self.checks.stopped.load(Ordering::Relaxed) || status.is_some_and(|s| s.is_client_error()) || (self.permit)()
        {
            return false;
        }
        let (last_pass, checks) =
            (self.checks.last_pass.load(Ordering::Relaxed), self.checks.passes.load(Ordering::Relaxed));
        let held_ms = micros_since(self.origin).saturating_sub(last_pass) / 1000;
        metrics.answered_after_lapse.inc();
        let status = status.map_or_else(|| "unknown".to_owned(), |s| s.as_u16().to_string());
        tracing::warn!(
            path = %path,
            token,
            held_ms,
            checks,
            status = %status,
            "the backend answered a write after this instance's permission to send it lapsed (or its outcome is \
             unknown): if the instance was paused between the write's last check and its send, the write may \
             have reached the backend after a newer holder's"
        );
        true
    }
}

fn micros_since(origin: Instant) -> u64 {
    u64::try_from(origin.elapsed().as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::UpstreamError;
    use std::time::Duration;

    /// An answer of `status`.
    fn answer(status: StatusCode) -> Result<StatusCode, Refusal> {
        Ok(status)
    }

    /// A write whose outcome is unknown: the backend did not answer in time.
    fn unknown() -> Result<StatusCode, Refusal> {
        Err(Refusal::Upstream(UpstreamError::Timeout(Duration::from_secs(30))))
    }

    fn status(answer: &StatusCode) -> Option<StatusCode> {
        Some(*answer)
    }

    fn watched() -> (Arc<AtomicBool>, Watched) {
        let open = Arc::new(AtomicBool::new(true));
        let watched = {
            let open = Arc::clone(&open);
            Watched::new(Arc::new(move || open.load(Ordering::SeqCst)))
        };
        (open, watched)
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_ended_after_the_lapse_is_counted_with_the_time_since_its_last_pass() {
        let (open, watched) = watched();
        let metrics = Metrics::default();
        let permit = watched.permit();
        tokio::time::advance(Duration::from_millis(40)).await;
        assert!(permit());
        assert!(!watched.ended(&metrics, "/a", 7, &answer(StatusCode::OK), status), "ended while the permit holds");
        tokio::time::advance(Duration::from_millis(9000)).await;
        open.store(false, Ordering::SeqCst);
        assert!(watched.ended(&metrics, "/a", 7, &answer(StatusCode::CREATED), status));
        assert!(watched.ended(&metrics, "/a", 7, &unknown(), status), "an unknown outcome may have landed as well");
        let refused = answer(StatusCode::PRECONDITION_FAILED);
        assert!(!watched.ended(&metrics, "/a", 7, &refused, status), "refused: applied nothing");
        assert_eq!(metrics.answered_after_lapse.get(), 2);
        let since = micros_since(watched.origin) - watched.checks.last_pass.load(Ordering::Relaxed);
        assert_eq!(since / 1000, 9000, "held from the last pass");
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_the_self_fence_stopped_is_not_named() {
        let (open, watched) = watched();
        let metrics = Metrics::default();
        let permit = watched.permit();
        assert!(permit());
        tokio::time::advance(Duration::from_millis(9000)).await;
        open.store(false, Ordering::SeqCst);
        assert!(!permit(), "the next chunk's check fails: the write is cut off");
        assert!(!watched.ended(&metrics, "/a", 7, &unknown(), status));
        assert_eq!(metrics.answered_after_lapse.get(), 0);
    }
}
