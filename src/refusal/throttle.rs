//! Rate-limited logging of refused requests.
//!
//! Every refused write is evidence of a split brain somewhere upstream, so it is logged, naming
//! resource, token, `max_seen` and client. But a zombie retrying in a loop must not flood the
//! log: per resource (or, for refusals without one, per reason), at most one line per
//! interval is written, and the next line written says how many were suppressed meanwhile.

use std::time::Duration;

use dashmap::DashMap;
use http::Method;
use tokio::time::Instant;

use super::Refusal;
use crate::fence::FenceError;
use crate::store::StoreError;
use crate::upstream::{Peer, UpstreamError};

/// Beyond this many keys, windows that have expired are swept before adding another.
const SWEEP_AT: usize = 10_000;

#[derive(Debug)]
struct Window {
    opened: Instant,
    suppressed: u64,
}

/// Decides which refusals get a log line.
#[derive(Debug, Default)]
pub struct RefusalThrottle {
    windows: DashMap<Box<str>, Window>,
}

impl RefusalThrottle {
    /// A throttle that has admitted nothing yet.
    pub fn new() -> Self {
        RefusalThrottle { windows: DashMap::new() }
    }

    /// `Some(n)` if a refusal for `key` should be logged now, at most one line per `interval`,
    /// `n` being how many were suppressed since the last line for it; `None` to suppress it.
    pub fn admit(&self, key: &str, interval: Duration) -> Option<u64> {
        let now = Instant::now();
        if let Some(mut w) = self.windows.get_mut(key) {
            if now.duration_since(w.opened) < interval {
                w.suppressed += 1;
                return None;
            }
            let suppressed = std::mem::take(&mut w.suppressed);
            w.opened = now;
            return Some(suppressed);
        }
        if self.windows.len() >= SWEEP_AT {
            self.windows.retain(|_, w| now.duration_since(w.opened) < interval || w.suppressed > 0);
        }
        self.windows.insert(key.into(), Window { opened: now, suppressed: 0 });
        Some(0)
    }
}

/// Logs a refusal, at most one line per resource (or reason) and `interval`.
pub(crate) fn log(
    throttle: &RefusalThrottle,
    interval: Duration,
    refusal: &Refusal,
    method: &Method,
    path: &str,
    client: &Peer,
) {
    let key = refusal.resource().unwrap_or_else(|| refusal.code());
    let Some(suppressed) = throttle.admit(key, interval) else { return };
    match refusal {
        Refusal::Fence(FenceError::Stale { resource, token, max_seen, floor }) => {
            let floor = floor.as_deref();
            tracing::warn!(%resource, token, max_seen, floor, %client, %method, %path, suppressed, "refused stale token");
        }
        Refusal::Fence(FenceError::Jump { resource, token, base, max_jump, .. }) => {
            tracing::warn!(%resource, token, from = base, max_jump, %client, %method, %path, suppressed, "refused a token that jumps too far");
        }
        Refusal::SignatureRejected { resource, reason } => {
            tracing::warn!(%resource, reason = reason.reason(), kid = reason.kid(), error = %refusal, %client, %method, %path,
                suppressed, "refused a token whose signature does not prove it");
        }
        Refusal::Store(StoreError::Full(_) | StoreError::FullBytes(_)) | Refusal::Fence(FenceError::Full { .. }) => {
            tracing::warn!(error = %refusal, %client, %method, %path, suppressed, "refused a write to a new resource");
        }
        Refusal::Store(_)
        | Refusal::Fence(FenceError::TaskFailed(_))
        | Refusal::Upstream(UpstreamError::Unreachable(_) | UpstreamError::Failed(_) | UpstreamError::Timeout(_)) => {
            tracing::error!(error = %refusal, %client, %method, %path, suppressed, "request failed");
        }
        Refusal::Upstream(UpstreamError::Busy(_)) => {
            tracing::warn!(error = %refusal, %client, %method, %path, suppressed, "every backend connection is in use");
        }
        _ => {
            tracing::info!(code = refusal.code(), error = %refusal, %client, %method, %path, suppressed, "refused request")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn one_line_per_key_per_interval_and_the_next_line_counts_the_rest() {
        let log = RefusalThrottle::new();
        let i = Duration::from_millis(50);
        assert_eq!(log.admit("/a", i), Some(0));
        for _ in 0..5 {
            assert_eq!(log.admit("/a", i), None);
        }
        assert_eq!(log.admit("/b", i), Some(0), "keys are limited independently");
        tokio::time::advance(Duration::from_millis(49)).await;
        assert_eq!(log.admit("/a", i), None, "within the interval");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(log.admit("/a", i), Some(6), "the interval is over: the line counts the rest");
        assert_eq!(log.admit("/a", i), None);
    }
}
