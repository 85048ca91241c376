//! [`FileWriter`]: the file store's writer (group commit), on a thread of its own, which starts
//! the compaction thread (`compact`); what it does when the disk lets it down is `faults`'.
//!
//! The writer's blocking writes and `fdatasync`s never run on a thread that serves requests:
//! a disk that stalls (a slow sync, dirty-page throttling of a `write`) then delays only the
//! fenced writes waiting for their advance, never pass-through requests or the admin API.
//! Requests send it their advances over a channel and wait for the answer; the sync under way
//! is the batching window: every advance that arrives meanwhile joins the next batch.
//!
//! Group commit: the writer takes every advance queued while the previous batch was syncing,
//! appends them all, and issues one `fdatasync` for the lot. Only after the sync does it raise
//! the [`Table`] and answer. An advance of several marks is one message and one entry of the
//! batch, so its records always share one commit marker: recovery applies them all or none.
//!
//! A failed write or sync is final: the kernel may have dropped the dirty pages, so a later
//! sync that "succeeds" proves nothing (PostgreSQL's fsync lesson). Every later advance fails
//! until the process restarts and recovers from what is on disk. A disk that gives no room is
//! not a failure: the batch is refused unwritten ([`StoreError::NoSpace`]; an I/O error in the
//! write that makes the room, [`StoreError::RoomFailed`]) and the next one tries again.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use super::compact;
mod faults;
use super::file::{Answers, StoreOptions};
use super::log::{Log, LogError};
use super::mark_batch::Room;
use super::recovery::io_err;
use super::relay::{Answer, Done, Relay};
use super::scheduling::Scheduler;
use super::status::{Status, stall_point};
use super::{Change, Mark, MarkBatch, MarkKind, StoreError, Table};

/// Most changes committed by one write and one sync: a `MarkBatch` of several marks (an advance,
/// or the answers of one write) counts once, since it is never split.
const MAX_BATCH: usize = 4096;
/// Longest answered writes wait to be logged as such when no advance comes to carry them; also
/// how long after committing advances (not resets, which are never answered) the writer waits,
/// with no reminder, for their answers.
pub(super) const ANSWER_FLUSH: Duration = Duration::from_millis(200);

pub(super) enum Msg {
    /// An advance or a reset, checked ([`MarkBatch::check`]): one entry of one group.
    Commit {
        batch: MarkBatch,
        done: Done,
    },
    /// An answered write came while the writer slept with no deadline for answers: it must not
    /// wait forever.
    AnswersWaiting,
    Close(Done),
}

pub(super) struct FileWriter {
    answers: Answers,
    /// When answered writes waiting in `answers` are written even if no advance comes.
    flush_by: Option<Instant>,
    log: Log,
    table: Arc<Table>,
    status: Arc<Status>,
    options: StoreOptions,
    failed: Option<String>,
    snapshot_bytes: Arc<AtomicU64>,
    /// Changes and answers of the group being built, in arrival order.
    batch: Vec<Op>,
    /// Advance records in the batch, counted as they join.
    advances_in_batch: usize,
    /// Writes (advances and resets, however many marks each) in the batch.
    writes_in_batch: usize,
    /// Room the group's new marks take, for `max_resources` and `max_table_bytes`.
    room: Room,
    /// Whether `run` finished; if not, its thread is unwinding (see `Drop`).
    finished: bool,
    /// The data directory's lock: released only once this writer can write no more.
    lock: Option<std::fs::File>,
    /// Takes each batch's answers to the requests waiting for them.
    relay: Relay,
    /// The answers of the batch being committed.
    answering: Vec<Answer>,
    /// Answered writes just taken from `answers`, kept for its capacity.
    taken: Vec<MarkBatch>,
}

enum Op {
    /// An advance or a reset, answered once the group is durable.
    Commit { batch: MarkBatch, done: Done },
    /// An answered write: nobody waits for it.
    Answered(MarkBatch),
}

/// What woke the writer from its wait for work.
enum Woke {
    /// A message: a change, a reminder, a close.
    Message(Msg),
    /// Its deadline: answers waited long enough, or it is time to look for room.
    Due,
    /// Every sender is gone: the store was dropped without `close()`.
    Dropped,
}

impl FileWriter {
    /// A writer for `log`, raising `table`; answered writes come in through `answers`.
    pub(super) fn new(
        log: Log,
        table: Arc<Table>,
        status: Arc<Status>,
        options: StoreOptions,
        answers: Answers,
        lock: std::fs::File,
        relay: Relay,
    ) -> FileWriter {
        FileWriter {
            answers,
            flush_by: None,
            log,
            table,
            status,
            options,
            failed: None,
            snapshot_bytes: Arc::new(AtomicU64::new(0)),
            batch: Vec::with_capacity(MAX_BATCH),
            advances_in_batch: 0,
            writes_in_batch: 0,
            room: Room::default(),
            finished: false,
            lock: Some(lock),
            relay,
            answering: Vec::with_capacity(MAX_BATCH),
            taken: Vec::new(),
        }
    }

    /// Runs until the store is closed or dropped: the body of the writer's thread.
    pub(super) fn run(mut self, rx: Receiver<Msg>) {
        let (compact_tx, compact_rx) = mpsc::sync_channel::<u64>(1);
        let dir = self.log.dir().to_owned();
        let compactor = compact::spawn(dir, &self.table, &self.snapshot_bytes, self.lock.as_ref(), compact_rx);
        // On this thread, which it schedules; after the compaction thread started, which keeps
        // the policy the process started with.
        let mut scheduler = Scheduler::new(self.options.writer_scheduling);
        let mut closing = None;
        while closing.is_none() {
            // Answered writes ride along with the next batch; without one, they are written
            // on their own by `flush_by`: ANSWER_FLUSH after the batch whose advances they
            // answer, after the reminder the first of them sends a writer that had none to
            // expect, or after the writer found them waiting as it was about to sleep. A store
            // refused room looks for some every ROOM_RETRY meanwhile.
            let retry = self.status.full().then(|| Instant::now() + faults::ROOM_RETRY);
            if self.flush_by.is_none() {
                self.until_reminded();
            }
            let wake = match (self.flush_by, retry) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let woke = match wake {
                None => rx.recv().map_or(Woke::Dropped, Woke::Message),
                Some(by) => match rx.recv_timeout(by.saturating_duration_since(Instant::now())) {
                    Ok(msg) => Woke::Message(msg),
                    Err(RecvTimeoutError::Timeout) => Woke::Due,
                    Err(RecvTimeoutError::Disconnected) => Woke::Dropped,
                },
            };
            if retry.is_some() && !matches!(woke, Woke::Message(_)) {
                self.retry_room();
            }
            match woke {
                Woke::Message(first) => {
                    closing = self.take(first);
                    if self.batch.is_empty() && closing.is_none() && self.flush_by.is_some() {
                        continue; // only a reminder of answers waiting: keep waiting for company
                    }
                }
                // Answers waited ANSWER_FLUSH: write them now. (Or only the look for room
                // woke the writer: then keep waiting.)
                Woke::Due if self.flush_by.is_some_and(|by| by > Instant::now()) || self.flush_by.is_none() => continue,
                Woke::Due => {}
                Woke::Dropped => {
                    self.take_answers(); // dropped without close(): keep what is known
                    self.commit();
                    break;
                }
            }
            self.flush_by = None;
            // Everything that arrived while the previous batch was syncing joins this one.
            self.take_answers();
            while closing.is_none() && self.batch.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(msg) => closing = self.take(msg),
                    Err(_) => break,
                }
            }
            scheduler.committing(self.writes_in_batch);
            self.commit();
            self.maybe_rotate(&compact_tx);
        }
        drop(compact_tx);
        if let Some(c) = compactor {
            let _ = c.join();
        }
        let flushed = match &self.failed {
            Some(f) => Err(StoreError::Failed(f.clone())),
            None => self.log.flush().map_err(|e| match e {
                LogError::NoRoom(e) | LogError::Failed(e) => io_err(&self.log.path(), e),
            }),
        };
        self.finished = true;
        drop(self.lock.take()); // the directory may belong to someone else from now on
        if let Some(done) = closing {
            let _ = done.send(flushed);
        }
    }

    /// Adds one message to the batch; returns the reply channel if it asks to close.
    fn take(&mut self, msg: Msg) -> Option<Done> {
        match msg {
            Msg::Commit { batch, done } => {
                // The answer to the previous write of this resource was recorded before this
                // advance was sent; logged after it, an answer for an equal token (equal_token =
                // "accept", or an operator's advance) would clear this write's in-flight mark.
                self.take_answers();
                self.admit(batch, done)
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

    /// Before a sleep with no deadline for answers (at most the look for room's): asks for a
    /// reminder from the next answered write, or, if answered writes already wait, sets
    /// `flush_by` for them.
    fn until_reminded(&mut self) {
        let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        if answers.list.is_empty() {
            answers.remind = true;
        } else {
            drop(answers);
            self.flush_by = Some(Instant::now() + ANSWER_FLUSH);
        }
    }

    /// Adds the answered writes recorded since the last batch.
    fn take_answers(&mut self) {
        let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        answers.remind = false;
        // Swapped with an emptied list, so that neither side allocates for the next ones.
        std::mem::swap(&mut answers.list, &mut self.taken);
        drop(answers);
        if self.failed.is_some() {
            self.taken.clear();
            return;
        }
        for answered in self.taken.drain(..) {
            self.log.append_batch(&answered);
            self.batch.push(Op::Answered(answered));
        }
    }

    /// Queues a change of one or several marks for this group, whole, or refuses it whole at
    /// once.
    fn admit(&mut self, batch: MarkBatch, done: Done) {
        if let Some(f) = &self.failed {
            let _ = done.send(Err(StoreError::Failed(f.clone())));
            return;
        }
        let (new, room) = self.room.take(&self.table, self.options.max_resources, &batch);
        if let Err(e) = room {
            match batch.marks() {
                [Mark { kind: MarkKind::Key, name }] if batch.change() == Change::Advance => {
                    tracing::warn!(resource = %name, error = %e, "refusing a write to a new resource");
                }
                marks => {
                    tracing::warn!(marks = marks.len(), new, error = %e, "refusing a write to new resources");
                }
            }
            let _ = done.send(Err(e));
            return;
        }
        self.log.append_batch(&batch);
        self.advances_in_batch += batch.len();
        self.writes_in_batch += 1;
        self.batch.push(Op::Commit { batch, done });
    }

    /// Writes the batch; syncs it if it holds an advance (a lost answer only costs a quarantine).
    fn commit(&mut self) {
        self.room = Room::default();
        self.writes_in_batch = 0;
        let advances = std::mem::take(&mut self.advances_in_batch);
        if self.batch.is_empty() {
            #[cfg(test)]
            {
                self.answers.lock().unwrap_or_else(|e| e.into_inner()).empty_commits += 1;
            }
            return;
        }
        let started = Instant::now();
        self.status.busy();
        stall_point(self.log.dir());
        let written = if advances > 0 { self.log.commit() } else { self.log.write() };
        self.status.idle();
        if let (Ok(()), Some(hook), true) = (&written, &self.options.on_commit, advances > 0) {
            hook(started.elapsed(), advances);
        }
        let outcome = match written {
            Ok(()) => {
                self.room_again();
                Ok(())
            }
            Err(LogError::NoRoom(e)) => Err(self.no_room(e)),
            Err(LogError::Failed(e)) => Err(self.fail(e)),
        };
        // Whether an advance (a fenced write's or an operator's) was made: its answer follows.
        // A reset has none, so a batch of resets alone ends the wait for the answers of an
        // earlier batch: the first of them then sends a reminder.
        let mut answers_follow = false;
        for op in self.batch.drain(..) {
            match op {
                Op::Commit { batch, done } => {
                    answers_follow |= batch.change() == Change::Advance;
                    if outcome.is_ok() {
                        // Durable now: raise the table before anyone hears back.
                        self.table.apply(&batch);
                    }
                    self.answering.push((done, outcome.clone()));
                }
                // An answer the log had no room for is lost, which only costs a quarantine
                // after a restart; the table need not wait for it.
                Op::Answered(answered) => self.table.apply(&answered),
            }
        }
        if answers_follow && outcome.is_ok() {
            // Their answers follow soon: written with the next batch, or on their own by then,
            // without a reminder each. (Advances refused get no answer.)
            self.flush_by = Some(Instant::now() + ANSWER_FLUSH);
        }
        self.relay.deliver(&mut self.answering);
    }
}
