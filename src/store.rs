//! Durable `max_seen`: the [`Store`] trait and [`FileStore`], an append-only, CRC32C-checked log.
//!
//! The proxy only ever calls [`Store::advance`] and waits for it before forwarding, so any
//! implementation that resolves only once the advance would survive a crash keeps invariant 2.
//! [`FileStore`] batches concurrent advances into one write and one `fdatasync` (group commit)
//! on a dedicated thread. After any write or sync error it fails closed for good: the kernel
//! may have dropped the dirty pages, so a later "successful" fsync would be a lie.
//!
//! File format (`fence.log`, little-endian): a 16-byte header, `b"FENCELOG"`, version `u32` = 1,
//! 4 reserved zero bytes; then records `len u32 | crc u32 | token u64 | key bytes`, where `len`
//! counts token and key and `crc` is CRC32C over `len`, token and key. Replay takes the max.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::future::Future;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::mpsc;

use tokio::sync::oneshot;

use crate::config::SyncMode;

/// A boxed future returned by [`Store`] methods.
pub type StoreFuture<'a> = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>>;

/// Durable memory of `max_seen`. Implementations may be local (a log) or shared (etcd).
pub trait Store: Send + Sync + std::fmt::Debug {
    /// Records that `key` accepted `token`; resolves only once a crash can no longer lose it.
    fn advance(&self, key: &str, token: u64) -> StoreFuture<'_>;
    /// Flushes everything and stops; later advances fail with [`StoreError::Closed`].
    fn close(&self) -> StoreFuture<'_>;
}

/// Store failures. All of them keep fenced writes from being forwarded.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Another process holds the data directory's lock.
    #[error("data dir {} is in use by another fencegate (lock held on {})", .dir.display(), .dir.join(LOCK_FILE).display())]
    Locked {
        /// The data directory.
        dir: PathBuf,
    },
    /// An I/O error while opening or recovering.
    #[error("{}: {message}", .path.display())]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// A damaged record that is not a torn tail: starting would risk lowering `max_seen`.
    #[error("{}: corrupt at byte {offset}: {reason}; refusing to start (a dropped record could lower max_seen)", .path.display())]
    Corrupt {
        /// The damaged file.
        path: PathBuf,
        /// Byte offset of the damaged record.
        offset: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// A write or sync failed; the store accepts no more advances until restarted.
    #[error("store failed and refuses further advances until restart: {0}")]
    Failed(String),
    /// The store was closed.
    #[error("store is closed")]
    Closed,
}

const LOCK_FILE: &str = "LOCK";
const LOG_FILE: &str = "fence.log";
const MAGIC: &[u8; 8] = b"FENCELOG";
const VERSION: u32 = 1;
const HEADER_LEN: usize = 16;
const MAX_KEY_LEN: usize = 64 * 1024;
const MAX_BATCH: usize = 4096;

fn io_err(path: &Path, e: io::Error) -> StoreError {
    StoreError::Io { path: path.to_owned(), message: e.to_string() }
}

enum Msg {
    Advance { key: String, token: u64, done: oneshot::Sender<Result<(), StoreError>> },
    Close(oneshot::Sender<Result<(), StoreError>>),
}

/// The local log, one per data directory, guarded by an advisory lock.
#[derive(Debug)]
pub struct FileStore {
    tx: mpsc::Sender<Msg>,
    _lock: File,
}

impl FileStore {
    /// Locks `dir`, replays the log (truncating a torn tail) and returns the recovered table.
    pub fn open(dir: &Path, sync: SyncMode) -> Result<(FileStore, HashMap<String, u64>), StoreError> {
        fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new().create(true).truncate(false).write(true).open(&lock_path);
        let lock = lock.map_err(|e| io_err(&lock_path, e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(StoreError::Locked { dir: dir.to_owned() });
            }
            Err(fs::TryLockError::Error(e)) => return Err(io_err(&lock_path, e)),
        }
        let path = dir.join(LOG_FILE);
        let table = if path.exists() { recover(&path)? } else { create(dir, &path)? };
        let file = OpenOptions::new().append(true).open(&path).map_err(|e| io_err(&path, e))?;
        if sync == SyncMode::Never {
            tracing::warn!("store.sync = \"never\": advances are not fsync'd; a power loss can lower max_seen");
        }
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("fencegate-log".into())
            .spawn(move || writer(file, path, sync, rx))
            .map_err(|e| io_err(dir, e))?;
        Ok((FileStore { tx, _lock: lock }, table))
    }
}

impl Store for FileStore {
    fn advance(&self, key: &str, token: u64) -> StoreFuture<'_> {
        let (done, rx) = oneshot::channel();
        let sent = self.tx.send(Msg::Advance { key: key.to_owned(), token, done });
        Box::pin(async move {
            sent.map_err(|_| StoreError::Closed)?;
            rx.await.map_err(|_| StoreError::Closed)?
        })
    }

    fn close(&self) -> StoreFuture<'_> {
        let (done, rx) = oneshot::channel();
        let sent = self.tx.send(Msg::Close(done));
        Box::pin(async move {
            sent.map_err(|_| StoreError::Closed)?;
            rx.await.map_err(|_| StoreError::Closed)?
        })
    }
}

fn create(dir: &Path, path: &Path) -> Result<HashMap<String, u64>, StoreError> {
    let mut header = Vec::with_capacity(HEADER_LEN);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&[0; 4]);
    let tmp = dir.join(format!("{LOG_FILE}.tmp"));
    let write = || -> io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(&header)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    };
    write().map_err(|e| io_err(path, e))?;
    Ok(HashMap::new())
}

fn encode(buf: &mut Vec<u8>, key: &str, token: u64) {
    let len = (8 + key.len()) as u32;
    let crc = crc32c::crc32c_append(crc32c::crc32c(&len.to_le_bytes()), &token.to_le_bytes());
    let crc = crc32c::crc32c_append(crc, key.as_bytes());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&crc.to_le_bytes());
    buf.extend_from_slice(&token.to_le_bytes());
    buf.extend_from_slice(key.as_bytes());
}

enum Bad {
    Truncated,
    Length(usize),
    Crc,
    Utf8,
}

/// Decodes the record at the start of `b`: `(key, token, bytes used)`.
fn decode(b: &[u8]) -> Result<(&str, u64, usize), Bad> {
    let word = |at: usize| b.get(at..at + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]));
    let (Some(len), Some(crc)) = (word(0), word(4)) else {
        return Err(Bad::Truncated);
    };
    let len = len as usize;
    if !(9..=8 + MAX_KEY_LEN).contains(&len) {
        return Err(Bad::Length(len));
    }
    let payload = b.get(8..8 + len).ok_or(Bad::Truncated)?;
    let expect = crc32c::crc32c_append(crc32c::crc32c(&(len as u32).to_le_bytes()), payload);
    if expect != crc {
        return Err(Bad::Crc);
    }
    let (token, key) = payload.split_at(8);
    let token = u64::from_le_bytes(token.try_into().map_err(|_| Bad::Truncated)?);
    let key = std::str::from_utf8(key).map_err(|_| Bad::Utf8)?;
    Ok((key, token, 8 + len))
}

fn recover(path: &Path) -> Result<HashMap<String, u64>, StoreError> {
    let data = fs::read(path).map_err(|e| io_err(path, e))?;
    let corrupt =
        |offset: usize, reason: String| StoreError::Corrupt { path: path.to_owned(), offset: offset as u64, reason };
    if data.len() < HEADER_LEN || &data[..8] != MAGIC {
        return Err(corrupt(0, "not a fencegate log (bad header)".into()));
    }
    let version = u32::from_le_bytes([data[8], data[9], data[10], data[11]]);
    if version != VERSION {
        return Err(corrupt(8, format!("log version {version} is not supported (expected {VERSION})")));
    }
    let mut table = HashMap::new();
    let mut pos = HEADER_LEN;
    while pos < data.len() {
        let rest = &data[pos..];
        match decode(rest) {
            Ok((key, token, used)) => {
                let slot = table.entry(key.to_owned()).or_insert(token);
                *slot = (*slot).max(token);
                pos += used;
            }
            Err(bad) => {
                // A crash mid-append leaves a prefix of the batch, or zeros where the file grew
                // before its data landed: either way nothing valid follows. A valid record
                // after the bad one means damage we must not paper over.
                if let Some(next) = (pos + 1..data.len()).find(|&p| decode(&data[p..]).is_ok()) {
                    let what = match bad {
                        Bad::Length(n) => format!("record length {n} is out of range"),
                        Bad::Crc => "checksum mismatch".into(),
                        Bad::Utf8 => "key is not UTF-8".into(),
                        Bad::Truncated => "record cut short".into(),
                    };
                    return Err(corrupt(pos, format!("{what}, with a valid record at byte {next} after it")));
                }
                truncate_torn_tail(path, &data, pos)?;
                break;
            }
        }
    }
    Ok(table)
}

fn truncate_torn_tail(path: &Path, data: &[u8], pos: usize) -> Result<(), StoreError> {
    let aside = path.with_extension(format!("log.torn-at-{pos}"));
    tracing::warn!(file = %path.display(), offset = pos, bytes = data.len() - pos, aside = %aside.display(),
        "torn write at the end of the log (a crash mid-append): keeping a copy and truncating");
    let work = || -> io::Result<()> {
        fs::write(&aside, &data[pos..])?;
        File::open(&aside)?.sync_all()?;
        let f = OpenOptions::new().write(true).open(path)?;
        f.set_len(pos as u64)?;
        f.sync_all()
    };
    work().map_err(|e| io_err(path, e))
}

/// The group-commit loop: everything queued while the previous batch was syncing goes into
/// the next write and shares its one `fdatasync`.
fn writer(mut file: File, path: PathBuf, sync: SyncMode, rx: mpsc::Receiver<Msg>) {
    let mut failed: Option<String> = None;
    let mut buf = Vec::with_capacity(64 * 1024);
    let mut waiters = Vec::with_capacity(MAX_BATCH);
    while let Ok(first) = rx.recv() {
        let mut closing = None;
        let mut next = Some(first);
        while let Some(msg) = next.take() {
            match msg {
                Msg::Advance { key, token, done } => {
                    encode(&mut buf, &key, token);
                    waiters.push(done);
                }
                Msg::Close(done) => closing = Some(done),
            }
            if closing.is_none() && waiters.len() < MAX_BATCH {
                next = rx.try_recv().ok();
            }
        }
        if failed.is_none() && !buf.is_empty() {
            let result = file.write_all(&buf).and_then(|()| match sync {
                SyncMode::Always => file.sync_data(),
                SyncMode::Never => Ok(()),
            });
            if let Err(e) = result {
                tracing::error!(file = %path.display(), error = %e,
                    "fence log write or fsync failed: refusing all fenced writes until restart");
                failed = Some(format!("{}: {e}", path.display()));
            }
        }
        buf.clear();
        let outcome = failed.clone().map_or(Ok(()), |f| Err(StoreError::Failed(f)));
        for done in waiters.drain(..) {
            let _ = done.send(outcome.clone());
        }
        if let Some(done) = closing {
            let flushed = match &failed {
                Some(f) => Err(StoreError::Failed(f.clone())),
                None => file.sync_all().map_err(|e| io_err(&path, e)),
            };
            let _ = done.send(flushed);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(dir: &Path) -> (FileStore, HashMap<String, u64>) {
        FileStore::open(dir, SyncMode::Always).unwrap()
    }

    async fn write(dir: &Path, entries: &[(&str, u64)]) {
        let (store, _) = open(dir);
        for (k, t) in entries {
            store.advance(k, *t).await.unwrap();
        }
        store.close().await.unwrap();
    }

    fn log_len(dir: &Path) -> u64 {
        fs::metadata(dir.join(LOG_FILE)).unwrap().len()
    }

    #[tokio::test]
    async fn empty_dir_then_clean_shutdown_recovers_the_maximum() {
        let dir = tempfile::tempdir().unwrap();
        assert!(open(dir.path()).1.is_empty());
        write(dir.path(), &[("/a", 5), ("/b", 7), ("/a", 9), ("/a", 6)]).await;
        let table = open(dir.path()).1;
        assert_eq!(table, HashMap::from([("/a".into(), 9), ("/b".into(), 7)]));
    }

    #[tokio::test]
    async fn torn_tail_is_set_aside_and_truncated() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &[("/a", 5), ("/b", 7)]).await;
        let full = log_len(dir.path());
        let f = OpenOptions::new().write(true).open(dir.path().join(LOG_FILE)).unwrap();
        f.set_len(full - 3).unwrap();
        let table = open(dir.path()).1;
        assert_eq!(table, HashMap::from([("/a".into(), 5)]));
        assert!(log_len(dir.path()) < full - 3, "tail truncated to the last whole record");
        assert!(fs::read_dir(dir.path()).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().contains("torn")));
    }

    #[tokio::test]
    async fn zero_filled_tail_is_a_torn_write() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &[("/a", 5)]).await;
        let mut f = OpenOptions::new().append(true).open(dir.path().join(LOG_FILE)).unwrap();
        f.write_all(&[0; 100]).unwrap();
        assert_eq!(open(dir.path()).1, HashMap::from([("/a".into(), 5)]));
    }

    #[tokio::test]
    async fn a_half_written_record_followed_by_zeros_is_a_torn_write() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &[("/a", 5), ("/b", 7)]).await;
        let path = dir.path().join(LOG_FILE);
        let mut data = fs::read(&path).unwrap();
        let n = data.len();
        data[n - 4..].fill(0); // the last record's key bytes never landed
        data.extend_from_slice(&[0; 64]);
        fs::write(&path, &data).unwrap();
        assert_eq!(open(dir.path()).1, HashMap::from([("/a".into(), 5)]));
    }

    #[tokio::test]
    async fn corruption_before_valid_records_refuses_to_start() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &[("/a", 5), ("/b", 7)]).await;
        let path = dir.path().join(LOG_FILE);
        let mut data = fs::read(&path).unwrap();
        data[HEADER_LEN + 12] ^= 0xff; // inside the first record's token
        fs::write(&path, &data).unwrap();
        let err = FileStore::open(dir.path(), SyncMode::Always).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { offset, .. } if offset == HEADER_LEN as u64), "{err}");
        assert!(err.to_string().contains("fence.log"));
    }

    #[tokio::test]
    async fn a_second_store_on_the_same_dir_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (_first, _) = open(dir.path());
        let err = FileStore::open(dir.path(), SyncMode::Always).unwrap_err();
        assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    }

    #[tokio::test]
    async fn concurrent_advances_are_all_durable() {
        let dir = tempfile::tempdir().unwrap();
        let (store, _) = open(dir.path());
        let store = std::sync::Arc::new(store);
        let tasks: Vec<_> = (0..64u64)
            .map(|i| {
                let s = std::sync::Arc::clone(&store);
                tokio::spawn(async move { s.advance(&format!("/r{}", i % 8), i).await })
            })
            .collect();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        store.close().await.unwrap();
        assert!(store.advance("/x", 1).await.is_err(), "closed stores refuse advances");
        drop(store);
        let table = open(dir.path()).1;
        assert_eq!(table.len(), 8);
        assert_eq!(table["/r7"], 63);
    }
}
