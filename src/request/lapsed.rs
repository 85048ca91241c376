//! A write answered after its permission to be sent lapsed. A shared fence's leader checks its
//! permit before the head and each body chunk, but no check can follow the send itself: a
//! leader paused between its last check and the write syscall (SIGSTOP, a long preemption, a
//! frozen VM) sends on waking, perhaps after a newer holder's write (docs/cluster.md: the
//! window no proxy closes). fencegate cannot stop that send, but it can see it afterwards: the
//! answer comes after the permit lapsed, long after the write's last check. It says so, with
//! how long the write was held between the two, so that an operator (and the fault tests)
//! can tell a write that crossed the window from one the fence let through wrongly.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;

use crate::state::Metrics;
use crate::store::Permit;

/// A permit whose passes are timed: [`Watched::permit`] is handed to the send, and
/// [`Watched::answered`] looks at the permit once the backend has answered.
pub(super) struct Watched {
    permit: Permit,
    origin: Instant,
    /// Microseconds from `origin` to the last check that let something go.
    last_pass: Arc<AtomicU64>,
}

impl Watched {
    pub(super) fn new(permit: Permit) -> Self {
        Watched { permit, origin: Instant::now(), last_pass: Arc::new(AtomicU64::new(0)) }
    }

    /// The permit the send checks: each pass is timed.
    pub(super) fn permit(&self) -> Permit {
        let (permit, last_pass, origin) = (Arc::clone(&self.permit), Arc::clone(&self.last_pass), self.origin);
        Arc::new(move || {
            let open = permit();
            if open {
                last_pass.store(micros_since(origin), Ordering::Relaxed);
            }
            open
        })
    }

    /// Once the backend answered `path`'s write of `token`: whether the permit had
    /// lapsed by then, said in a warning and a count with how long the write was held since
    /// its last check.
    pub(super) fn answered(&self, metrics: &Metrics, path: &str, token: u64) -> bool {
        if (self.permit)() {
            return false;
        }
        let held_ms = micros_since(self.origin).saturating_sub(self.last_pass.load(Ordering::Relaxed)) / 1000;
        metrics.answered_after_lapse.inc();
        tracing::warn!(
            path = %path,
            token,
            held_ms,
            "the backend answered a write after this instance's permission to send it lapsed: if the \
             instance was paused between the write's last check and its send, the write may have \
             reached the backend after a newer holder's"
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
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn an_answer_after_the_lapse_is_counted_with_the_time_since_the_last_pass() {
        let open = Arc::new(AtomicBool::new(true));
        let watched = {
            let open = Arc::clone(&open);
            Watched::new(Arc::new(move || open.load(Ordering::SeqCst)))
        };
        let metrics = Metrics::default();
        let permit = watched.permit();
        assert!(permit());
        assert!(!watched.answered(&metrics, "/a", 7), "answered while the permit holds: nothing to say");
        tokio::time::advance(Duration::from_millis(9000)).await;
        open.store(false, Ordering::SeqCst);
        assert!(!permit(), "a check after the lapse fails, and is not a pass");
        assert!(watched.answered(&metrics, "/a", 7));
        assert_eq!(metrics.answered_after_lapse.get(), 1);
        let since = micros_since(watched.origin) - watched.last_pass.load(Ordering::Relaxed);
        assert_eq!(since / 1000, 9000, "held from the last pass, not from the failed check");
    }
}
