//! [`FileStore`]: a data directory opened, recovered and locked (an advisory lock makes it this
//! process's alone), with its writer thread (`writer`) behind the [`Store`] trait.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::Path;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use tokio::sync::oneshot;

use super::SyncMode;
use super::log::{self, Log};
use super::mark_batch::{noted, refused};
use super::recovery::{self, Mode, io_err, round_ms};
use super::relay::Relay;
use super::scheduling::WriterScheduling;
use super::status::{Condition, Status};
use super::writer::{FileWriter, Msg};
use super::{Change, MarkBatch, Store, StoreError, StoreFuture, Table};

/// Answered writes waiting for the writer's next batch, shared by the store and its writer.
pub(super) type Answers = Arc<std::sync::Mutex<Answered>>;

/// What [`Answers`] holds.
#[derive(Debug, Default)]
pub(super) struct Answered {
    /// The answered writes, each a [`Change::Answered`] batch.
    pub(super) list: Vec<MarkBatch>,
    /// The writer sleeps with no deadline for answers: the next answer sends it a reminder.
    /// Otherwise the writer is busy, or wakes by itself within `ANSWER_FLUSH` (it committed
    /// advances whose answers it expects), and an answer wakes nobody: for writes less than
    /// `ANSWER_FLUSH` apart, that is one wake-up of the writer less per write.
    pub(super) remind: bool,
    /// Reminders sent.
    #[cfg(test)]
    pub(super) reminders: usize,
    /// Commits of an empty batch: the writer woke and found nothing to write.
    #[cfg(test)]
    pub(super) empty_commits: usize,
}

/// Name of the lock file in a data directory.
pub(crate) const LOCK_FILE: &str = "LOCK";

/// Told of every durable batch: how long its write and sync took, and how many advances it
/// made durable.
pub type CommitHook = Arc<dyn Fn(Duration, usize) + Send + Sync>;

/// How a [`FileStore`] behaves.
#[derive(Clone)]
pub struct StoreOptions {
    /// Whether commits are fsync'd.
    pub sync: SyncMode,
    /// A segment is closed, and a snapshot may be taken, once it holds this many bytes (or
    /// the size of the last snapshot, if larger, so compaction costs stay proportional).
    pub segment_bytes: u64,
    /// New marks beyond this many, keys and floors together, are refused.
    pub max_resources: usize,
    /// New marks that would take the table's memory past this many bytes are refused
    /// ([`Table::with_max_bytes`]).
    pub max_table_bytes: u64,
    /// A description of the rules that made the keys, recorded in a new directory; a directory
    /// that recorded other rules refuses to open (keys made under them would not match). The
    /// default is empty, which names no rules: a directory a proxy wrote does not open with it.
    pub keying: String,
    /// Called after each batch that made advances durable (metrics).
    pub on_commit: Option<CommitHook>,
    /// How the writer thread is scheduled.
    pub writer_scheduling: WriterScheduling,
}

impl std::fmt::Debug for StoreOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreOptions")
            .field("sync", &self.sync)
            .field("segment_bytes", &self.segment_bytes)
            .field("max_resources", &self.max_resources)
            .field("max_table_bytes", &self.max_table_bytes)
            .field("keying", &self.keying)
            .field("writer_scheduling", &self.writer_scheduling)
            .finish_non_exhaustive()
    }
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            sync: SyncMode::Always,
            segment_bytes: 64 << 20,
            max_resources: 10_000_000,
            max_table_bytes: 1 << 30,
            keying: String::new(),
            on_commit: None,
            writer_scheduling: WriterScheduling::Batch,
        }
    }
}

/// Creates `dir` if missing and makes its directory entry durable, so a power loss right
/// after the first start cannot take the whole data directory with it.
pub(super) fn create_dir_durably(dir: &Path) -> Result<(), StoreError> {
    if dir.is_dir() {
        return Ok(());
    }
    if dir.exists() {
        return Err(StoreError::NotADirectory(dir.to_owned()));
    }
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    File::open(parent).and_then(|p| p.sync_all()).map_err(|e| io_err(parent, e))
}

/// Name of the file recording the key rules a directory's keys were made under.
pub(super) const KEYING_FILE: &str = "KEYING";

/// Refuses a directory whose keys were made under other rules. Whether the rules are recorded:
/// a directory without `KEYING` gets it from [`record_keying`], once its log exists.
fn check_keying(dir: &Path, configured: &str) -> Result<bool, StoreError> {
    let path = dir.join(KEYING_FILE);
    match std::fs::read_to_string(&path) {
        Ok(recorded) if recorded == configured => Ok(true),
        Ok(recorded) => {
            Err(StoreError::KeyingChanged { dir: dir.to_owned(), recorded, configured: configured.to_owned() })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(io_err(&path, e)),
    }
}

/// Records the key rules in a directory that has none. Only once its log exists: recovery
/// takes `KEYING` without a segment or a snapshot for a log that was lost.
fn record_keying(dir: &Path, configured: &str) -> Result<(), StoreError> {
    let path = dir.join(KEYING_FILE);
    log::create_durably(dir, KEYING_FILE, |w| std::io::Write::write_all(w, configured.as_bytes()))
        .map_err(|e| io_err(&path, e))
}

/// An error opening `path`, in the data directory `dir`, for writing: a read-only file system
/// is named as such, with what to do about it.
pub(super) fn write_err(dir: &Path, path: &Path, e: std::io::Error) -> StoreError {
    if e.kind() == std::io::ErrorKind::ReadOnlyFilesystem {
        return StoreError::ReadOnly { dir: dir.to_owned(), message: format!("{}: {e}", path.display()) };
    }
    io_err(path, e)
}

/// Takes the data directory's advisory lock; the OS releases it when the process dies.
pub(crate) fn lock(dir: &Path, create: bool) -> Result<File, StoreError> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new().create(create).truncate(false).write(true).open(&path);
    let file = file.map_err(|e| write_err(dir, &path, e))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => Err(StoreError::Locked { dir: dir.to_owned() }),
        Err(TryLockError::Error(e)) => Err(io_err(&path, e)),
    }
}

/// The local, log-structured store of one data directory.
#[derive(Debug)]
pub struct FileStore {
    tx: mpsc::Sender<Msg>,
    /// Answered writes, logged with the next batch: recording one wakes the writer only if it
    /// sleeps with no deadline for answers.
    answers: Answers,
    table: Arc<Table>,
    status: Arc<Status>,
    in_flight_at_start: Vec<(String, u64)>,
    floors_in_flight_at_start: Vec<(String, u64)>,
}

impl FileStore {
    /// Locks `dir`, recovers it (truncating a torn tail, removing obsolete files) and starts
    /// the writer and the compaction threads. The writer runs until the store is closed or
    /// dropped; its answers wake tasks on any runtime.
    ///
    /// It opens whatever directory it is given, creating it if missing, as tests and tools
    /// need. Whoever serves from a directory that may have been lost calls
    /// [`check_initialised`](super::check_initialised) first, as `Proxy::open` does.
    pub fn open(dir: &Path, options: StoreOptions) -> Result<FileStore, StoreError> {
        create_dir_durably(dir)?;
        let lock = lock(dir, true)?;
        let keyed = check_keying(dir, &options.keying)?;
        let capacity = recovery::size_hint(dir).min(options.max_resources);
        let table = Arc::new(Table::with_capacity(capacity).with_max_bytes(options.max_table_bytes));
        let started = std::time::Instant::now();
        let recovered = recovery::recover(dir, &table, Mode::Repair)?;
        tracing::info!(dir = %dir.display(), resources = table.len(), snapshot = %recovered.snapshot.map_or_else(|| "none".to_owned(), |s| s.to_string()),
            segments = recovered.segments.len(), records = recovered.records, elapsed = %humantime::format_duration(round_ms(started.elapsed())),
            "fence store recovered");
        // Zeros ahead of the log: 1 MiB, or less for small segments, so they stay small.
        let ahead = (options.segment_bytes / 16).clamp(4096, 1 << 20);
        let log = Log::open(dir, options.sync, &recovered, ahead).map_err(|e| io_err(dir, e))?;
        if !keyed {
            record_keying(dir, &options.keying)?;
        }
        if options.sync == SyncMode::Never {
            tracing::warn!("store.sync = \"never\": advances are not fsync'd; a power loss can lower max_seen");
        }
        let status = Arc::new(Status::new());
        let in_flight_at_start = recovered.in_flight;
        let floors_in_flight_at_start = recovered.floors_in_flight;
        if !in_flight_at_start.is_empty() || !floors_in_flight_at_start.is_empty() {
            tracing::warn!(
                writes = in_flight_at_start.len(),
                floors = floors_in_flight_at_start.len(),
                "writes were in flight when fencegate last stopped; their resources start quarantined"
            );
        }
        let (tx, rx) = mpsc::channel();
        let answers = Arc::new(std::sync::Mutex::new(Answered::default()));
        // The writer holds the directory's lock, so it is released only once it can write no
        // more: a store dropped without close() still logs what it knew, and no second store
        // may append meanwhile.
        // Started here, on the runtime that opens the store, if there is one.
        let relay = Relay::start();
        let writer =
            FileWriter::new(log, Arc::clone(&table), Arc::clone(&status), options, Arc::clone(&answers), lock, relay);
        std::thread::Builder::new()
            .name("fencegate-log".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| io_err(dir, e))?;
        Ok(FileStore { tx, answers, table, status, in_flight_at_start, floors_in_flight_at_start })
    }

    /// Writes that were on their way to the backend when the last process stopped, as
    /// `(key, token)`: the backend may still apply them, so their resources need quarantine.
    pub fn in_flight_at_start(&self) -> &[(String, u64)] {
        &self.in_flight_at_start
    }

    /// Writes that had raised a floor and were on their way to the backend when the last
    /// process stopped, as `(p, token)`: everything under `p` needs quarantine.
    pub fn floors_in_flight_at_start(&self) -> &[(String, u64)] {
        &self.floors_in_flight_at_start
    }

    /// Whether the writer sleeps until an answered write reminds it.
    #[cfg(test)]
    pub(super) fn writer_awaits_reminder(&self) -> bool {
        self.answers.lock().unwrap_or_else(|e| e.into_inner()).remind
    }

    /// How many reminders answered writes sent the writer.
    #[cfg(test)]
    pub(super) fn reminders_sent(&self) -> usize {
        self.answers.lock().unwrap_or_else(|e| e.into_inner()).reminders
    }

    /// How many times the writer committed an empty batch.
    #[cfg(test)]
    pub(super) fn empty_commits(&self) -> usize {
        self.answers.lock().unwrap_or_else(|e| e.into_inner()).empty_commits
    }

    /// Queues an answered write for the writer's next group, reminding it if it sleeps until
    /// told.
    fn note_answer(&self, answered: MarkBatch) {
        let mut answers = self.answers.lock().unwrap_or_else(|e| e.into_inner());
        if !answered.is_empty() {
            answers.list.push(answered);
        }
        let remind = answers.remind && !answers.list.is_empty();
        if remind {
            answers.remind = false;
            #[cfg(test)]
            {
                answers.reminders += 1;
            }
        }
        drop(answers);
        if remind {
            let _ = self.tx.send(Msg::AnswersWaiting);
        }
    }

    fn send(&self, make: impl FnOnce(oneshot::Sender<Result<(), StoreError>>) -> Msg) -> StoreFuture<'_> {
        let (done, rx) = oneshot::channel();
        let sent = self.tx.send(make(done));
        Box::pin(async move {
            sent.map_err(|_| StoreError::Closed)?;
            rx.await.map_err(|_| StoreError::Closed)?
        })
    }
}

impl Store for FileStore {
    fn table(&self) -> &Arc<Table> {
        &self.table
    }

    /// One term for ever: `term` is not looked at.
    fn commit(&self, _term: u64, mut batch: MarkBatch) -> StoreFuture<'_> {
        if batch.change() == Change::Answered {
            self.note_answer(batch);
            return noted();
        }
        match batch.check() {
            Err(e) => refused(e),
            Ok(false) => noted(),
            // One entry of one group: its records share one commit marker.
            Ok(true) => self.send(|done| Msg::Commit { batch, done }),
        }
    }

    fn close(&self) -> StoreFuture<'_> {
        // The writer releases the directory's lock after its last write, before it answers.
        self.send(Msg::Close)
    }

    fn condition(&self) -> Condition {
        self.status.condition()
    }
}
