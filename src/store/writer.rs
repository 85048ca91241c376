//! The writer (group commit), which starts the compaction thread (`compact`).
//!
//! The writer is a task on the runtime that serves the requests, not a thread of its own: a
//! hand-off to another thread and back cost more CPU than the sync itself (two sleeps and two
//! wake-ups per batch), and most of a fenced write's added latency at low load. Its blocking
//! write and `fdatasync` therefore hold up that runtime thread for the length of a sync; that
//! wait is the batching window. Every write that arrives meanwhile joins the next batch.
//!
//! Group commit: the writer takes every advance queued while the previous batch was syncing,
//! lets every task that is ready queue its own, appends them all, and issues one `fdatasync`
//! for the lot. Only after the sync does it raise the [`Table`] and answer. An advance of
//! several marks is one message and one entry of the batch, so its records always share one
//! commit marker: recovery applies them all or none.
//!
//! Failure is closed and final: after a failed write or sync the kernel may have dropped the
//! dirty pages, so a later sync that "succeeds" proves nothing (PostgreSQL's fsync lesson).
//! Every later advance fails until the process restarts and recovers from what is on disk.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use tokio::runtime::RuntimeFlavor;
use tokio::sync::{mpsc::UnboundedReceiver, oneshot};

use super::compact;
use super::file::{Answers, StoreOptions};
use super::format::Kind;
use super::log::Log;
use super::recovery::io_err;
use super::{MarkKind, StoreError, Table};

/// Most advances committed by one write and one sync (an advance of several marks counts once:
/// it is never split).
const MAX_BATCH: usize = 4096;
/// Most passes of the event loop a batch waits for more writes, while each pass brings some.
const GATHER_ROUNDS: usize = 8;
/// Longest answered writes wait to be logged as such when no advance comes to carry them.
const ANSWER_FLUSH: Duration = Duration::from_millis(200);

type Done = oneshot::Sender<Result<(), StoreError>>;

pub(super) enum Msg {
    Advance {
        key: String,
        token: u64,
        done: Done,
    },
    /// Several marks, in one batch.
    AdvanceAll {
        marks: Vec<(MarkKind, String)>,
        token: u64,
        done: Done,
    },
    /// The first answered write since the writer last took them: it must not wait forever.
    AnswersWaiting,
    Close(Done),
}

/// Runs blocking file work from the writer task. A multi-threaded runtime is told, so that
/// its other tasks move to another worker; a single-threaded one waits, which is the point.
fn blocking<R>(work: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

pub(super) struct Writer {
    answers: Answers,
    /// When answered writes waiting in `answers` are written even if no advance comes.
    flush_by: Option<Instant>,
    log: Log,
    table: Arc<Table>,
    healthy: Arc<AtomicBool>,
    options: StoreOptions,
    failed: Option<String>,
    snapshot_bytes: Arc<AtomicU64>,
    /// Advances and answers of the batch being built, in arrival order.
    batch: Vec<Op>,
    /// Advance records in the batch, counted as they join.
    advances_in_batch: usize,
    /// New marks (keys and floors) among the batch's advances, for the `max_resources` bound.
    new_in_batch: usize,
    /// Whether `run` finished; if not, the task was dropped with its runtime (see `Drop`).
    finished: bool,
    /// The data directory's lock: released only once this writer can write no more.
    lock: Option<std::fs::File>,
}

enum Op {
    Advance { key: String, token: u64, done: Done },
    AdvanceAll { marks: Vec<(MarkKind, String)>, token: u64, done: Done },
    Answered { mark: MarkKind, key: String, token: u64 },
}

impl Writer {
    /// A writer for `log`, raising `table`; answered writes come in through `answers`.
    pub(super) fn new(
        log: Log,
        table: Arc<Table>,
        healthy: Arc<AtomicBool>,
        options: StoreOptions,
        answers: Answers,
        lock: std::fs::File,
    ) -> Writer {
        Writer {
            answers,
            flush_by: None,
            log,
            table,
            healthy,
            options,
            failed: None,
            snapshot_bytes: Arc::new(AtomicU64::new(0)),
            batch: Vec::with_capacity(MAX_BATCH),
            advances_in_batch: 0,
            new_in_batch: 0,
            finished: false,
            lock: Some(lock),
        }
    }

    /// Runs until the store is closed or dropped.
    pub(super) async fn run(mut self, mut rx: UnboundedReceiver<Msg>) {
        let (compact_tx, compact_rx) = mpsc::sync_channel::<u64>(1);
        let dir = self.log.path().parent().map(Path::to_owned).unwrap_or_default();
        let compactor = compact::spawn(dir, &self.table, &self.snapshot_bytes, self.lock.as_ref(), compact_rx);
        let mut closing = None;
        while closing.is_none() {
            // Answered writes ride along with the next batch; without one, they are written
            // on their own ANSWER_FLUSH after the first of them.
            let received = match self.flush_by {
                None => rx.recv().await.ok_or(false),
                Some(by) => match tokio::time::timeout_at(by.into(), rx.recv()).await {
                    Ok(msg) => msg.ok_or(false),
                    Err(_) => Err(true),
                },
            };
            match received {
                Ok(first) => {
                    closing = self.take(first);
                    if self.batch.is_empty() && closing.is_none() && self.flush_by.is_some() {
                        continue; // only a reminder of answers waiting: keep waiting for company
                    }
                }
                Err(true) => {} // answers waited ANSWER_FLUSH: write them now
                Err(false) => {
                    self.take_answers(); // dropped without close(): keep what is known
                    blocking(|| self.commit());
                    break;
                }
            }
            self.flush_by = None;
            // Let every task that is ready now (writes whose turn came, requests just read)
            // queue its advance, so that one sync serves them all.
            for _ in 0..GATHER_ROUNDS {
                tokio::task::yield_now().await;
                let before = self.batch.len();
                self.take_answers();
                while closing.is_none() && self.batch.len() < MAX_BATCH {
                    match rx.try_recv() {
                        Ok(msg) => closing = self.take(msg),
                        Err(_) => break,
                    }
                }
                if self.batch.len() == before || closing.is_some() || self.batch.len() >= MAX_BATCH {
                    break;
                }
            }
            blocking(|| {
                self.commit();
                self.maybe_rotate(&compact_tx);
            });
        }
        drop(compact_tx);
        let flushed = blocking(|| {
            if let Some(c) = compactor {
                let _ = c.join();
            }
            match &self.failed {
                Some(f) => Err(StoreError::Failed(f.clone())),
                None => self.log.flush().map_err(|e| io_err(&self.log.path(), e)),
            }
        });
        self.finished = true;
        drop(self.lock.take()); // the directory may belong to someone else from now on
        if let Some(done) = closing {
            let _ = done.send(flushed);
        }
    }

    /// Adds one message to the batch; returns the reply channel if it asks to close.
    fn take(&mut self, msg: Msg) -> Option<Done> {
        match msg {
            Msg::Advance { key, token, done } => {
                // The answer to the previous write of this resource was recorded before this
                // advance was sent; logged after it, an answer for an equal token (equal_token =
                // "accept", or an operator's advance) would clear this write's in-flight mark.
                self.take_answers();
                self.admit(key, token, done)
            }
            Msg::AdvanceAll { marks, token, done } => {
                self.take_answers();
                self.admit_all(marks, token, done)
            }
            Msg::AnswersWaiting => {
                self.flush_by.get_or_insert_with(|| Instant::now() + ANSWER_FLUSH);
            }
            Msg::Close(done) => {
                self.take_answers();
                return Some(done);
            }
        }
        None
    }

    /// Adds the answered writes recorded since the last batch.
    fn take_answers(&mut self) {
        let answers = std::mem::take(&mut *self.answers.lock().unwrap_or_else(|e| e.into_inner()));
        if self.failed.is_some() {
            return;
        }
        for (mark, key, token) in answers {
            self.log.append(Kind::answered(mark), &key, token);
            self.batch.push(Op::Answered { mark, key, token });
        }
    }

    /// Queues one advance for this batch, or refuses it at once.
    fn admit(&mut self, key: String, token: u64, done: Done) {
        if let Some(f) = &self.failed {
            let _ = done.send(Err(StoreError::Failed(f.clone())));
            return;
        }
        if self.table.get(&key).is_none() {
            // Counting every new key in the batch as distinct can only refuse early, never late.
            if self.marks() + self.new_in_batch >= self.options.max_resources {
                tracing::warn!(resource = %key, limit = self.options.max_resources,
                    "store.max_resources reached: refusing a write to a new resource");
                let _ = done.send(Err(StoreError::Full(self.options.max_resources)));
                return;
            }
            self.new_in_batch += 1;
        }
        self.log.append(Kind::Advance, &key, token);
        self.batch.push(Op::Advance { key, token, done });
        self.advances_in_batch += 1;
    }

    /// Keys and floors in the table, which `max_resources` bounds together.
    fn marks(&self) -> usize {
        self.table.len() + self.table.floors_len()
    }

    /// Queues an advance of several marks for this batch, whole, or refuses it whole at once.
    fn admit_all(&mut self, marks: Vec<(MarkKind, String)>, token: u64, done: Done) {
        if let Some(f) = &self.failed {
            let _ = done.send(Err(StoreError::Failed(f.clone())));
            return;
        }
        let new = marks
            .iter()
            .filter(|(mark, name)| match mark {
                MarkKind::Key => self.table.get(name).is_none(),
                MarkKind::Floor => self.table.floor(name).is_none(),
            })
            .count();
        if new > 0 && self.marks() + self.new_in_batch + new > self.options.max_resources {
            tracing::warn!(
                marks = marks.len(),
                new,
                limit = self.options.max_resources,
                "store.max_resources reached: refusing a write to new resources"
            );
            let _ = done.send(Err(StoreError::Full(self.options.max_resources)));
            return;
        }
        self.new_in_batch += new;
        for (mark, name) in &marks {
            self.log.append(Kind::advance(*mark), name, token);
        }
        self.advances_in_batch += marks.len();
        self.batch.push(Op::AdvanceAll { marks, token, done });
    }

    /// Writes the batch; syncs it if it holds an advance (a lost answer only costs a quarantine).
    fn commit(&mut self) {
        self.new_in_batch = 0;
        let advances = std::mem::take(&mut self.advances_in_batch);
        if self.batch.is_empty() {
            return;
        }
        let started = Instant::now();
        let written = if advances > 0 { self.log.commit() } else { self.log.write() };
        if let (Ok(()), Some(hook), true) = (&written, &self.options.on_commit, advances > 0) {
            hook(started.elapsed(), advances);
        }
        let outcome = written.map_err(|e| self.fail(e));
        for op in self.batch.drain(..) {
            match op {
                Op::Advance { key, token, done } => {
                    if outcome.is_ok() {
                        // Durable now: raise the table before anyone hears back.
                        self.table.advance(&key, token);
                    }
                    let _ = done.send(outcome.clone());
                }
                Op::AdvanceAll { marks, token, done } => {
                    if outcome.is_ok() {
                        for (mark, name) in &marks {
                            match mark {
                                MarkKind::Key => self.table.advance(name, token),
                                MarkKind::Floor => self.table.advance_floor(name, token),
                            }
                        }
                    }
                    let _ = done.send(outcome.clone());
                }
                Op::Answered { mark: MarkKind::Key, key, token } => self.table.answered(&key, token),
                Op::Answered { mark: MarkKind::Floor, key, token } => self.table.answered_floor(&key, token),
            }
        }
    }

    /// Fails the store for good: after a failed write or sync the kernel may have dropped
    /// dirty pages, so nothing written since the last good sync can be trusted to a later one.
    fn fail(&mut self, e: std::io::Error) -> StoreError {
        let reason = format!("{}: {e}", self.log.path().display());
        tracing::error!(error = %reason,
            "fence log write or fsync failed: refusing every fenced write until fencegate is restarted");
        self.failed = Some(reason.clone());
        self.healthy.store(false, Ordering::Relaxed);
        StoreError::Failed(reason)
    }

    /// Closes a full segment and asks for a snapshot, unless one is still being written.
    fn maybe_rotate(&mut self, compact: &mpsc::SyncSender<u64>) {
        let threshold = self.options.segment_bytes.max(self.snapshot_bytes.load(Ordering::Relaxed));
        if self.failed.is_some() || self.log.len() < threshold {
            return;
        }
        // Rotation syncs the segment it closes (Answered-only batches included), so its failures
        // are sync failures like any other: fail closed.
        match self.log.rotate() {
            Ok(seq) => {
                let _ = compact.try_send(seq);
            }
            Err(e) => {
                self.fail(e);
            }
        }
    }
}

/// A writer task dropped between batches, with the runtime it ran on, still writes what it was
/// given, unsynced, as a thread would have done on its way out. Logged answers spare their
/// resources a quarantine after a restart. Advances nobody was answered for (so never
/// forwarded) are logged too: they only raise `max_seen` and quarantine their resources.
impl Drop for Writer {
    fn drop(&mut self) {
        if self.finished || self.failed.is_some() {
            return;
        }
        self.take_answers();
        if !self.batch.is_empty()
            && let Err(e) = self.log.write()
        {
            tracing::warn!(error = %e, "could not log the last answered writes of a dropped store");
        }
    }
}
