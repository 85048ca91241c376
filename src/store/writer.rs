//! The writer (group commit) and the compaction thread it starts.
//!
//! The writer is a task on the runtime that serves the requests, not a thread of its own: a
//! hand-off to another thread and back cost more CPU than the sync itself (two sleeps and two
//! wake-ups per batch), and most of a fenced write's added latency at low load. Its blocking
//! write and `fdatasync` therefore hold up that runtime thread for the length of a sync; that
//! wait is the batching window. Every write that arrives meanwhile joins the next batch.
//!
//! Group commit: the writer takes every advance queued while the previous batch was syncing,
//! lets every task that is ready queue its own, appends them all, and issues one `fdatasync`
//! for the lot. Only after the sync does it raise the [`Table`] and answer.
//!
//! Failure is closed and final: after a failed write or sync the kernel may have dropped the
//! dirty pages, so a later sync that "succeeds" proves nothing (PostgreSQL's fsync lesson).
//! Every later advance fails until the process restarts and recovers from what is on disk.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::runtime::RuntimeFlavor;
use tokio::sync::{mpsc::UnboundedReceiver, oneshot};

use super::file::StoreOptions;
use super::format::Kind;
use super::log::{self, Log};
use super::recovery::io_err;
use super::{StoreError, Table};

/// Most advances committed by one write and one sync.
const MAX_BATCH: usize = 4096;
/// Most passes of the event loop a batch waits for more writes, while each pass brings some.
const GATHER_ROUNDS: usize = 8;
/// Longest answered writes wait to be logged as such when no advance comes to carry them.
const ANSWER_FLUSH: Duration = Duration::from_millis(200);

pub(super) enum Msg {
    Advance {
        key: String,
        token: u64,
        done: oneshot::Sender<Result<(), StoreError>>,
    },
    /// The first answered write since the writer last took them: it must not wait forever.
    AnswersWaiting,
    Close(oneshot::Sender<Result<(), StoreError>>),
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
    answers: Arc<std::sync::Mutex<Vec<(String, u64)>>>,
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
    /// Advances in the batch, counted as they join.
    advances_in_batch: usize,
    /// New keys among the batch's advances, for the `max_resources` bound.
    new_in_batch: usize,
    /// Whether `run` finished; if not, the task was dropped with its runtime (see `Drop`).
    finished: bool,
    /// The data directory's lock: released only once this writer can write no more.
    lock: Option<std::fs::File>,
}

enum Op {
    Advance { key: String, token: u64, done: oneshot::Sender<Result<(), StoreError>> },
    Answered { key: String, token: u64 },
}

impl Writer {
    /// A writer for `log`, raising `table`; answered writes come in through `answers`.
    pub(super) fn new(
        log: Log,
        table: Arc<Table>,
        healthy: Arc<AtomicBool>,
        options: StoreOptions,
        answers: Arc<Mutex<Vec<(String, u64)>>>,
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
        let compactor = self.spawn_compactor(compact_rx);
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
    fn take(&mut self, msg: Msg) -> Option<oneshot::Sender<Result<(), StoreError>>> {
        match msg {
            Msg::Advance { key, token, done } => {
                // The answer to the previous write of this resource was recorded before this
                // advance was sent; logged after it, an answer for an equal token (equal_token =
                // "accept", or an operator's advance) would clear this write's in-flight mark.
                self.take_answers();
                self.admit(key, token, done)
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
        for (key, token) in answers {
            self.log.append(Kind::Answered, &key, token);
            self.batch.push(Op::Answered { key, token });
        }
    }

    /// Queues one advance for this batch, or refuses it at once.
    fn admit(&mut self, key: String, token: u64, done: oneshot::Sender<Result<(), StoreError>>) {
        if let Some(f) = &self.failed {
            let _ = done.send(Err(StoreError::Failed(f.clone())));
            return;
        }
        if self.table.get(&key).is_none() {
            // Counting every new key in the batch as distinct can only refuse early, never late.
            if self.table.len() + self.new_in_batch >= self.options.max_resources {
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
                Op::Answered { key, token } => self.table.answered(&key, token),
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

    fn spawn_compactor(&self, rx: mpsc::Receiver<u64>) -> Option<JoinHandle<()>> {
        let table = Arc::clone(&self.table);
        let size = Arc::clone(&self.snapshot_bytes);
        let dir: PathBuf = self.log.path().parent().map(Path::to_owned).unwrap_or_default();
        // The compactor writes and deletes files in the directory, so it holds the lock too (a
        // duplicate of the same open file description): a writer dropped with its runtime
        // must not hand the directory over while a snapshot is still being written.
        let lock = match self.lock.as_ref().map(std::fs::File::try_clone) {
            Some(Ok(lock)) => lock,
            _ => {
                tracing::error!("cannot share the directory lock with the compaction thread: no compaction");
                return None;
            }
        };
        let spawned = std::thread::Builder::new().name("fencegate-compact".into()).spawn(move || {
            let _lock = lock;
            while let Ok(seq) = rx.recv() {
                let started = Instant::now();
                let written = log::write_snapshot(&dir, seq, &table).and_then(|bytes| {
                    size.store(bytes, Ordering::Relaxed);
                    log::remove_covered(&dir, seq).map(|removed| (bytes, removed))
                });
                match written {
                    Ok((bytes, removed)) => tracing::info!(seq, bytes, removed, elapsed = ?started.elapsed(),
                        "snapshot written; covered log segments removed"),
                    // The segments are still there, so nothing is lost; the next rotation retries.
                    Err(e) => tracing::error!(seq, error = %e, "snapshot failed; keeping the log segments"),
                }
            }
        });
        spawned.map_err(|e| tracing::error!(error = %e, "cannot start the compaction thread")).ok()
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
