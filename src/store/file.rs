//! [`FileStore`]: one writer thread doing group commit, one compaction thread writing
//! snapshots, and an advisory lock making the data directory this process's alone.
//!
//! Group commit: the writer takes every advance queued while the previous batch was syncing,
//! appends them all, and issues one `fdatasync` for the lot; so a request waits for at most the
//! sync that follows its record. Only after the sync does it raise the [`Table`] and answer.
//!
//! Failure is closed and final: after a failed write or sync the kernel may have dropped the
//! dirty pages, so a later sync that "succeeds" proves nothing (PostgreSQL's fsync lesson).
//! Every later advance fails until the process restarts and recovers from what is on disk.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use super::format::MAX_KEY_LEN;
use super::log::{self, Log};
use super::recovery::{self, Mode, io_err};
use super::{Store, StoreError, StoreFuture, Table};
use crate::config::SyncMode;

/// Name of the lock file in a data directory.
pub(crate) const LOCK_FILE: &str = "LOCK";
/// Most advances committed by one write and one sync.
const MAX_BATCH: usize = 4096;

/// How a [`FileStore`] behaves.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Whether commits are fsync'd.
    pub sync: SyncMode,
    /// A segment is closed, and a snapshot may be taken, once it holds this many bytes (or
    /// the size of the last snapshot, if larger, so compaction costs stay proportional).
    pub segment_bytes: u64,
    /// New resources beyond this many are refused.
    pub max_resources: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions { sync: SyncMode::Always, segment_bytes: 64 << 20, max_resources: 10_000_000 }
    }
}

/// Takes the data directory's advisory lock; the OS releases it when the process dies.
pub(crate) fn lock(dir: &Path, create: bool) -> Result<File, StoreError> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new().create(create).truncate(false).write(true).open(&path);
    let file = file.map_err(|e| io_err(&path, e))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(TryLockError::WouldBlock) => Err(StoreError::Locked { dir: dir.to_owned() }),
        Err(TryLockError::Error(e)) => Err(io_err(&path, e)),
    }
}

enum Msg {
    Advance { key: String, token: u64, done: oneshot::Sender<Result<(), StoreError>> },
    Close(oneshot::Sender<Result<(), StoreError>>),
}

/// The local, log-structured store of one data directory.
#[derive(Debug)]
pub struct FileStore {
    tx: mpsc::Sender<Msg>,
    table: Arc<Table>,
    healthy: Arc<AtomicBool>,
    _lock: File,
}

impl FileStore {
    /// Locks `dir`, recovers it (truncating a torn tail, removing obsolete files) and starts
    /// the writer and compaction threads.
    pub fn open(dir: &Path, options: StoreOptions) -> Result<FileStore, StoreError> {
        std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        let lock = lock(dir, true)?;
        let table = Arc::new(Table::new());
        let started = std::time::Instant::now();
        let recovered = recovery::recover(dir, &table, Mode::Repair)?;
        tracing::info!(dir = %dir.display(), resources = table.len(), snapshot = ?recovered.snapshot,
            segments = recovered.segments.len(), records = recovered.records, elapsed = ?started.elapsed(),
            "fence store recovered");
        let log = Log::open(dir, options.sync, &recovered).map_err(|e| io_err(dir, e))?;
        if options.sync == SyncMode::Never {
            tracing::warn!("store.sync = \"never\": advances are not fsync'd; a power loss can lower max_seen");
        }
        let healthy = Arc::new(AtomicBool::new(true));
        let (tx, rx) = mpsc::channel();
        let writer = Writer {
            log,
            table: Arc::clone(&table),
            healthy: Arc::clone(&healthy),
            options,
            failed: None,
            snapshot_bytes: Arc::new(AtomicU64::new(0)),
            new_in_batch: 0,
        };
        std::thread::Builder::new()
            .name("fencegate-log".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| io_err(dir, e))?;
        Ok(FileStore { tx, table, healthy, _lock: lock })
    }

    /// The table this store keeps current.
    pub fn table(&self) -> &Arc<Table> {
        &self.table
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
    fn advance(&self, key: &str, token: u64) -> StoreFuture<'_> {
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Box::pin(std::future::ready(Err(StoreError::KeyTooLong(key.len()))));
        }
        self.send(|done| Msg::Advance { key: key.to_owned(), token, done })
    }

    fn close(&self) -> StoreFuture<'_> {
        self.send(Msg::Close)
    }

    fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
}

struct Writer {
    log: Log,
    table: Arc<Table>,
    healthy: Arc<AtomicBool>,
    options: StoreOptions,
    failed: Option<String>,
    snapshot_bytes: Arc<AtomicU64>,
    new_in_batch: usize,
}

type Pending = (String, u64, oneshot::Sender<Result<(), StoreError>>);

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Msg>) {
        let (compact_tx, compact_rx) = mpsc::sync_channel::<u64>(1);
        let compactor = self.spawn_compactor(compact_rx);
        let mut batch: Vec<Pending> = Vec::with_capacity(MAX_BATCH);
        let mut closing = None;
        while closing.is_none() {
            let Ok(first) = rx.recv() else { break };
            let mut next = Some(first);
            while let Some(msg) = next.take() {
                match msg {
                    Msg::Advance { key, token, done } => self.admit(key, token, done, &mut batch),
                    Msg::Close(done) => closing = Some(done),
                }
                if closing.is_none() && batch.len() < MAX_BATCH {
                    next = rx.try_recv().ok();
                }
            }
            self.commit(&mut batch);
            self.maybe_rotate(&compact_tx);
        }
        drop(compact_tx);
        if let Some(c) = compactor {
            let _ = c.join();
        }
        let flushed = match &self.failed {
            Some(f) => Err(StoreError::Failed(f.clone())),
            None => self.log.flush().map_err(|e| io_err(&self.log.path(), e)),
        };
        if let Some(done) = closing {
            let _ = done.send(flushed);
        }
    }

    /// Queues one advance for this batch, or refuses it at once.
    fn admit(
        &mut self,
        key: String,
        token: u64,
        done: oneshot::Sender<Result<(), StoreError>>,
        batch: &mut Vec<Pending>,
    ) {
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
        self.log.append(&key, token);
        batch.push((key, token, done));
    }

    fn commit(&mut self, batch: &mut Vec<Pending>) {
        self.new_in_batch = 0;
        if batch.is_empty() {
            return;
        }
        let outcome = match self.log.commit() {
            Ok(()) => {
                for (key, token, _) in batch.iter() {
                    self.table.raise(key, *token);
                }
                Ok(())
            }
            Err(e) => {
                let reason = format!("{}: {e}", self.log.path().display());
                tracing::error!(error = %reason,
                    "fence log write or fsync failed: refusing every fenced write until fencegate is restarted");
                self.failed = Some(reason.clone());
                self.healthy.store(false, Ordering::Relaxed);
                Err(StoreError::Failed(reason))
            }
        };
        for (_, _, done) in batch.drain(..) {
            let _ = done.send(outcome.clone());
        }
    }

    /// Closes a full segment and asks for a snapshot, unless one is still being written.
    fn maybe_rotate(&mut self, compact: &mpsc::SyncSender<u64>) {
        let threshold = self.options.segment_bytes.max(self.snapshot_bytes.load(Ordering::Relaxed));
        if self.failed.is_some() || self.log.len() < threshold {
            return;
        }
        match self.log.rotate() {
            Ok(seq) => {
                let _ = compact.try_send(seq);
            }
            // Keep appending to the current segment: nothing is lost, compaction waits.
            Err(e) => tracing::error!(error = %e, dir = %self.log.path().display(), "cannot start a new log segment"),
        }
    }

    fn spawn_compactor(&self, rx: mpsc::Receiver<u64>) -> Option<JoinHandle<()>> {
        let table = Arc::clone(&self.table);
        let size = Arc::clone(&self.snapshot_bytes);
        let dir: PathBuf = self.log.path().parent().map(Path::to_owned).unwrap_or_default();
        let spawned = std::thread::Builder::new().name("fencegate-compact".into()).spawn(move || {
            while let Ok(seq) = rx.recv() {
                let started = std::time::Instant::now();
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
