//! Taking a write's turn: the subtree registry first (for a write that covers subtrees), then
//! the turn of every key it touches, one gate per key, FIFO, in one global order (sorted keys),
//! so that two writes never wait for each other.
//!
//! A subtree write takes, besides its own keys, the gate of every key under its subtrees that
//! has a write waiting or in flight; a write to single keys that finds a subtree write queued
//! or active above one of its keys gives its gates back and waits for the registry to change.
//! Between the two, writes whose sets overlap never run at the backend together, and a stream
//! of writes to keys cannot starve a subtree write queued behind them.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::gates::{Gates, KeyTurn};
use super::tree::{Coverage, Touch, node};
use super::{Fence, FenceError};

/// A subtree write's place in the registry, given back when dropped.
#[derive(Debug)]
pub(super) struct Registered {
    pub(super) fence: Arc<Fence>,
    pub(super) id: u64,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.fence.subtrees.remove(self.id);
    }
}

/// Everything a write holds once its turn has come.
pub(super) struct Taken {
    pub(super) key_turns: Vec<KeyTurn>,
    pub(super) registered: Option<Registered>,
}

impl Fence {
    /// Waits (FIFO, at most `wait`) until no earlier write that overlaps `touches` is in flight.
    pub(super) async fn take(self: &Arc<Self>, touches: &[Touch], wait: Duration) -> Result<Taken, FenceError> {
        let deadline = Instant::now() + wait;
        let timed_out = || FenceError::QueueTimeout {
            resource: touches.first().map(|t| t.key.clone()).unwrap_or_default(),
            waited: wait,
        };
        let mut subtrees: Vec<Box<str>> =
            touches.iter().filter(|t| t.coverage == Coverage::Subtree).map(|t| node(&t.key).into()).collect();
        let registered = match subtrees.is_empty() {
            true => None,
            false => {
                subtrees.sort_unstable();
                subtrees.dedup();
                let points =
                    touches.iter().filter(|t| t.coverage == Coverage::Key).map(|t| node(&t.key).into()).collect();
                let id = self.subtrees.enqueue(subtrees.clone(), points);
                let registered = Registered { fence: Arc::clone(self), id };
                loop {
                    let changed = self.subtrees.changed();
                    tokio::pin!(changed);
                    changed.as_mut().enable();
                    if self.subtrees.try_activate(id) {
                        break;
                    }
                    tokio::time::timeout_at(deadline, changed).await.map_err(|_| timed_out())?;
                }
                Some(registered)
            }
        };
        loop {
            let mut key_turns = match (touches, registered.is_some()) {
                // The common case, one key and no subtree: no list to build and sort.
                ([touch], false) => vec![self.gates.take(&touch.key, false, deadline, &timed_out).await?],
                _ => self.take_all(touches, &subtrees, deadline, &timed_out).await?,
            };
            if registered.is_some() || self.subtrees.is_empty() {
                return Ok(Taken { key_turns, registered });
            }
            let changed = self.subtrees.changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if !touches.iter().any(|t| self.subtrees.blocks(node(&t.key))) {
                return Ok(Taken { key_turns, registered });
            }
            // A subtree write above one of these keys came first: let it go ahead.
            self.gates.put_back(&mut key_turns);
            tokio::time::timeout_at(deadline, changed).await.map_err(|_| timed_out())?;
        }
    }

    /// Takes the turn of every key `touches` names and, under `subtrees`, of every key with a
    /// write waiting or in flight now, in sorted order; `timed_out` if `deadline` passes first.
    async fn take_all(
        &self,
        touches: &[Touch],
        subtrees: &[Box<str>],
        deadline: Instant,
        timed_out: &impl Fn() -> FenceError,
    ) -> Result<Vec<KeyTurn>, FenceError> {
        // Each key with `always`, whether its gate is made whatever the table's bytes: a key
        // under a subtree had a gate a moment ago, so only the touched keys can add resources.
        // The root's gate is one gate, and an operator's reset needs it however full the table.
        let root = |t: &Touch| t.key == "/" && t.coverage == Coverage::Subtree;
        let mut keys: Vec<(&str, bool)> = touches.iter().map(|t| (t.key.as_str(), root(t))).collect();
        // Under a subtree, every key with a write waiting or in flight now; one that comes
        // later sees the registry and steps back.
        let under: Vec<Box<str>> = match subtrees.is_empty() {
            true => Vec::new(),
            false => self.gates.keys_under(subtrees),
        };
        keys.extend(under.iter().map(|k| (&**k, true)));
        keys.sort_unstable();
        keys.dedup_by_key(|(key, _)| *key);
        // Gives back what it holds if this wait ends early: timed out, refused, or dropped by a
        // client that went away while it waited for a later key.
        let mut taking = Taking { gates: &self.gates, key_turns: Vec::with_capacity(keys.len()) };
        for (key, always) in keys {
            taking.key_turns.push(self.gates.take(key, always, deadline, timed_out).await?);
        }
        Ok(std::mem::take(&mut taking.key_turns))
    }
}

/// Key turns taken so far by a wait for several.
struct Taking<'a> {
    gates: &'a Gates,
    key_turns: Vec<KeyTurn>,
}

impl Drop for Taking<'_> {
    fn drop(&mut self) {
        self.gates.put_back(&mut self.key_turns);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;
    use crate::fence::turn::tests::{Failed, fence};
    use crate::fence::{EqualToken, Outcome};

    const WAIT: Duration = Duration::from_secs(10);

    fn touches(list: &[(&str, Coverage)]) -> Vec<Touch> {
        list.iter().map(|(k, coverage)| Touch { key: (*k).into(), coverage: *coverage }).collect()
    }

    fn put(k: &str) -> Vec<Touch> {
        touches(&[(k, Coverage::Key)])
    }

    fn delete(k: &str) -> Vec<Touch> {
        touches(&[(k, Coverage::Subtree)])
    }

    fn answered(_: &Result<(), Failed>) -> Outcome {
        Outcome::Answered
    }

    /// Runs a write of `token` over `touches` that records its start and end in `log`, and
    /// holds the backend until `release` is sent (or at once without one).
    async fn write(
        fence: &Arc<Fence>,
        touches: Vec<Touch>,
        token: u64,
        log: &Arc<Mutex<Vec<String>>>,
        release: Option<tokio::sync::oneshot::Receiver<()>>,
    ) -> Result<(), Failed> {
        let turn = fence.acquire(touches, WAIT).await?;
        let log = Arc::clone(log);
        let forward = async move {
            log.lock().unwrap().push(format!("start {token}"));
            if let Some(release) = release {
                let _ = release.await;
            }
            log.lock().unwrap().push(format!("end {token}"));
            Ok(())
        };
        turn.finish(token, EqualToken::Reject, Duration::from_secs(60), forward, answered).await
    }

    async fn until(what: &str, mut done: impl FnMut() -> bool) {
        for _ in 0..10_000 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("never: {what}");
    }

    #[tokio::test]
    async fn a_subtree_write_waits_for_the_writes_under_it_and_new_ones_wait_for_it() {
        let (f, _dir) = fence();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (release_put, held) = tokio::sync::oneshot::channel();
        let first = tokio::spawn({
            let (f, log) = (Arc::clone(&f), Arc::clone(&log));
            async move { write(&f, put("/d/f"), 10, &log, Some(held)).await }
        });
        until("the first PUT is at the backend", || log.lock().unwrap().len() == 1).await;
        let deleting = tokio::spawn({
            let (f, log) = (Arc::clone(&f), Arc::clone(&log));
            async move { write(&f, delete("/d/"), 20, &log, None).await }
        });
        until("the DELETE is queued", || !f.subtrees.is_empty()).await;
        let late = tokio::spawn({
            let (f, log) = (Arc::clone(&f), Arc::clone(&log));
            async move { write(&f, put("/d/g"), 30, &log, None).await }
        });
        let other = write(&f, put("/e"), 5, &log, None).await;
        assert!(other.is_ok(), "a write outside the subtree does not wait");
        release_put.send(()).unwrap();
        first.await.unwrap().unwrap();
        deleting.await.unwrap().unwrap();
        late.await.unwrap().unwrap();
        let log = log.lock().unwrap().clone();
        let at = |e: &str| log.iter().position(|l| l == e).unwrap();
        assert!(at("end 10") < at("start 20"), "the DELETE waited for the PUT under it: {log:?}");
        assert!(at("end 20") < at("start 30"), "the later PUT waited for the DELETE: {log:?}");
        assert_eq!(f.active_gates(), 0);
        assert!(f.subtrees.is_empty());
    }

    #[tokio::test]
    async fn a_subtree_floor_refuses_stale_writes_anywhere_under_it() {
        let (f, _dir) = fence();
        let log = Arc::new(Mutex::new(Vec::new()));
        write(&f, put("/d/f"), 1000, &log, None).await.unwrap();
        let stale = write(&f, delete("/d/"), 5, &log, None).await;
        assert!(matches!(stale, Err(Failed::Fence(FenceError::Stale { max_seen: 1000, .. }))), "{stale:?}");
        write(&f, delete("/d/"), 2000, &log, None).await.unwrap();
        for key in ["/d", "/d/", "/d/f", "/d/new/deep"] {
            let below = write(&f, put(key), 1500, &log, None).await;
            assert!(matches!(below, Err(Failed::Fence(FenceError::Stale { max_seen: 2000, .. }))), "{key}: {below:?}");
        }
        write(&f, put("/d/new"), 2001, &log, None).await.unwrap();
        write(&f, put("/dx"), 1, &log, None).await.unwrap();
        let above = write(&f, delete("/"), 2000, &log, None).await;
        assert!(matches!(above, Err(Failed::Fence(FenceError::Stale { max_seen: 2001, .. }))), "{above:?}");
    }

    #[tokio::test]
    async fn crossing_moves_finish_without_deadlock() {
        let (f, _dir) = fence();
        let log = Arc::new(Mutex::new(Vec::new()));
        let moves: Vec<_> = (0..40u64)
            .map(|i| {
                let (f, log) = (Arc::clone(&f), Arc::clone(&log));
                let pair = if i % 2 == 0 { ["/a", "/b"] } else { ["/b", "/a"] };
                let list = touches(&[(pair[0], Coverage::Subtree), (pair[1], Coverage::Subtree)]);
                let keys = touches(&[(pair[0], Coverage::Key), (pair[1], Coverage::Key)]);
                tokio::spawn(async move {
                    let as_subtrees = write(&f, list, 100 + 2 * i, &log, None).await;
                    let as_keys = write(&f, keys, 101 + 2 * i, &log, None).await;
                    (as_subtrees, as_keys)
                })
            })
            .collect();
        for m in moves {
            let (a, b) = tokio::time::timeout(WAIT, m).await.expect("no deadlock").unwrap();
            for r in [a, b] {
                assert!(matches!(r, Ok(()) | Err(Failed::Fence(FenceError::Stale { .. }))), "{r:?}");
            }
        }
        let log = log.lock().unwrap();
        for pair in log.chunks(2) {
            assert_eq!(pair[0].replace("start", "end"), pair[1], "overlapping writes never interleave: {log:?}");
        }
    }

    #[tokio::test]
    async fn a_wait_for_several_keys_dropped_midway_gives_back_what_it_took() {
        use std::pin::pin;
        use std::task::{Context, Waker};
        let (f, _dir) = fence();
        let _busy = f.acquire(put("/z"), WAIT).await.unwrap();
        for i in 0..20 {
            // A MOVE onto a busy key, whose client goes away while it waits.
            let moving = touches(&[(&format!("/a{i}"), Coverage::Key), ("/z", Coverage::Key)]);
            let mut waiting = pin!(f.acquire(moving, WAIT));
            assert!(waiting.as_mut().poll(&mut Context::from_waker(Waker::noop())).is_pending());
        }
        assert_eq!(f.active_gates(), 1, "only the busy key's gate is left");
    }

    #[tokio::test]
    async fn a_subtree_write_with_an_unknown_outcome_quarantines_its_subtree() {
        let (f, _dir) = fence();
        let turn = f.acquire(delete("/d"), WAIT).await.unwrap();
        let lost = async { Err::<(), _>(Failed::Backend) };
        let unknown = |_: &Result<(), Failed>| Outcome::Unknown;
        assert!(turn.finish(50, EqualToken::Reject, Duration::from_secs(60), lost, unknown).await.is_err());
        let mut under = f.acquire(put("/d/x"), WAIT).await.unwrap();
        assert!(matches!(under.check(99, EqualToken::Reject), Err(FenceError::Quarantined { .. })));
        drop(under);
        let mut beside = f.acquire(put("/e"), WAIT).await.unwrap();
        assert!(beside.check(99, EqualToken::Reject).is_ok());
    }
}
