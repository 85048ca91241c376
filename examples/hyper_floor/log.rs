//! The durable floor's log: every record is written and synced, in a group commit on a writer
//! thread of its own, before whoever sent it hears back, as fencegate's store does it at the
//! least. Batches are what arrives during one sync; one `pwrite` and one `fdatasync` a batch,
//! into zeros written (and synced) up front, so a sync commits no file size; the batch's answers
//! go back to the runtime with one wake-up. The writer is scheduled as fencegate's is by
//! default (`store.writer_scheduling = "batch"`): a `SCHED_BATCH` thread from the first batch
//! of two writes until eight batches of one in a row, so that its wake-ups do not preempt the
//! serving thread and batches hold what it produced meanwhile. Not done here, and counted in
//! fencegate's share against it: fencegate's zeros written a mebibyte at a time, its segments
//! and their rotation, its answered records, snapshots and compaction.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::mpsc;

use tokio::sync::oneshot;

/// A record to make durable, and whom to tell once it is.
pub type Entry = (Vec<u8>, oneshot::Sender<()>);

/// A batch's answers, for the relay task to send.
type Answers = tokio::sync::mpsc::UnboundedSender<Vec<oneshot::Sender<()>>>;

/// The zeros written ahead of the log; a batch past them starts over at the front, which
/// overwrites in place and so, like the zeros, commits no file size.
const AHEAD: u64 = 64 << 20;

/// Lone batches in a row after which the batch thread is an ordinary one again.
const LONE_BATCHES: u32 = 8;

/// Opens the log at `path` with its zeros written ahead and starts its writer; the answers are
/// relayed by a task on the current runtime.
pub fn open(path: &str) -> std::io::Result<mpsc::Sender<Entry>> {
    let file = std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(path)?;
    file.write_all_at(&vec![0; AHEAD as usize], 0)?;
    file.sync_all()?;
    let (tx, entries) = mpsc::channel();
    let (answers, mut relayed) = tokio::sync::mpsc::unbounded_channel::<Vec<oneshot::Sender<()>>>();
    std::thread::Builder::new().name("floor-writer".into()).spawn(move || write(file, entries, answers))?;
    tokio::spawn(async move {
        while let Some(batch) = relayed.recv().await {
            for tell in batch {
                let _ = tell.send(());
            }
        }
    });
    Ok(tx)
}

/// The writer thread: takes what has arrived, writes it in one `pwrite`, syncs it, and hands
/// the batch's answers to the relay task at once.
fn write(file: File, entries: mpsc::Receiver<Entry>, answers: Answers) {
    let (mut offset, mut buf, mut done) = (0u64, Vec::new(), Vec::new());
    let (mut batch_thread, mut lone) = (false, 0u32);
    while let Ok(first) = entries.recv() {
        for (record, tell) in std::iter::once(first).chain(entries.try_iter()) {
            buf.extend_from_slice(&record);
            done.push(tell);
        }
        lone = if done.len() == 1 { lone.saturating_add(1) } else { 0 };
        let wanted = match (batch_thread, done.len()) {
            (false, 2..) => true,
            (true, _) if lone >= LONE_BATCHES => false,
            (now, _) => now,
        };
        if wanted != batch_thread && set_batch(wanted) {
            batch_thread = wanted;
        }
        if offset + buf.len() as u64 > AHEAD {
            offset = 0;
        }
        if let Err(e) = file.write_all_at(&buf, offset).and_then(|()| file.sync_data()) {
            eprintln!("hyper_floor: the log failed: {e}");
            std::process::exit(1);
        }
        offset += buf.len() as u64;
        buf.clear();
        let capacity = done.capacity();
        let batch = std::mem::replace(&mut done, Vec::with_capacity(capacity));
        if answers.send(batch).is_err() {
            return;
        }
    }
}

/// Makes the calling thread a batch thread (`SCHED_BATCH`) or an ordinary one; whether it did.
fn set_batch(batch: bool) -> bool {
    let param = libc::sched_param { sched_priority: 0 };
    let policy = if batch { libc::SCHED_BATCH } else { libc::SCHED_OTHER };
    // SAFETY: `param` is a valid sched_param for the call, which only reads it; pid 0 is the
    // calling thread.
    unsafe { libc::sched_setscheduler(0, policy, &param) == 0 }
}
