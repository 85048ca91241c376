//! Durable `max_seen`: the [`Store`] trait, the in-memory [`Table`] it keeps current, and
//! [`FileStore`], a log-structured store in the tradition of etcd's WAL.
//!
//! The store keeps a level for each [`Mark`], of three kinds ([`MarkKind`]): a key's
//! `max_seen`; floors, each the highest token a write covering everything under a string was
//! accepted with; and bindings, the token each open multipart upload was created with. Names
//! are opaque strings to the store, in a map per kind: a floor and a key spelled alike are
//! different marks.
//!
//! Every change reaches a store as a [`MarkBatch`]: the proxy hands its advance (one key, or
//! several marks in one atomic batch) to [`Store::commit`] and waits for it before forwarding.
//! An implementation must resolve only once the advance would survive a crash, and must have
//! raised the [`Table`] by then. Because the store itself raises the table, and only after the
//! advance is durable, the table is always an image of durable state: a snapshot taken from it
//! can never miss a record of the segments it replaces. [`EtcdStore`] shares the fence between several
//! instances through an etcd cluster (docs/cluster.md).

mod compact;
pub mod etcd;
mod failpoint;
mod file;
pub(crate) mod format;
mod init;
mod inspect;
mod listing;
mod log;
mod mark;
mod mark_batch;
pub(crate) mod recovery;
mod relay;
mod replay;
mod scheduling;
mod status;
mod table;
mod usable;
mod writer;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

pub use etcd::{Adopted, EtcdOptions, EtcdStore, Migrated, TakeoverHook};
pub(crate) use failpoint::failpoint;
pub use file::{CommitHook, FileStore, StoreOptions};
pub use init::{check_initialised, init};
pub use inspect::{Inspection, inspect};
pub use listing::Listed;
pub use mark::{Mark, MarkKind, MarkRef};
pub use mark_batch::{Change, MarkBatch};
pub use scheduling::WriterScheduling;
pub use status::Condition;
#[cfg(feature = "stall-hook")]
pub use status::{Stall, hold};
pub use table::{MARK_BYTES, Table, TableBytes};
pub use usable::{Usable, check_usable};

/// Whether an advance is made durable with `fdatasync` before it resolves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// fdatasync before resolving: survives power loss (the default).
    Always,
    /// Leave it to the page cache: survives a process crash only. For benchmarks.
    Never,
}

/// A boxed future returned by [`Store`] methods.
pub type StoreFuture<'a> = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>>;

/// What this instance does with a fenced write, as its store decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Fences it here: the file store, or the etcd store's leader.
    Fences,
    /// Sends it to the leader at this URL, which fences it (the etcd store's followers).
    Forward(String),
    /// Refuses it: no instance can fence writes now, for this reason.
    Unavailable(String),
}

/// Whether a write the store advanced may still be sent on: checked after the backend
/// connection is taken and before each body chunk. The etcd store's leader closes it when its
/// lease lapses.
pub type Permit = Arc<dyn Fn() -> bool + Send + Sync>;

/// Durable memory of `max_seen`.
///
/// A store may serve in terms (the etcd store's leaderships): a write is checked against the
/// table in one term and must be advanced in that same term, or not at all, so the fence reads
/// [`Store::term`] before its check and commits with it. The file store has one term for ever.
pub trait Store: Send + Sync + std::fmt::Debug {
    /// The table this store raises once each advance is durable.
    fn table(&self) -> &Arc<Table>;
    /// Makes `batch`'s change, checked in `term`; refused if the store's term is no longer
    /// `term`. The batch is handed over when this is called; the future waits for its outcome.
    ///
    /// An advance or a reset resolves once a crash can no longer lose it, with the [`Table`]
    /// already changed: every mark of it, or none (never split across the writer's groups,
    /// whatever their bounds). Each mark an advance raises is in flight until answered; a reset
    /// leaves that as it was, and the caller must hold every turn its marks could move under.
    /// A drop ([`Change::Drop`]) may be made in parts, as each binding's drop stands alone.
    ///
    /// An answer ([`Change::Answered`]) resolves at once and is made durable with a later
    /// group; a store with terms forgets one from an earlier term rather than clear a marker a
    /// later term may have set.
    fn commit(&self, term: u64, batch: MarkBatch) -> StoreFuture<'_>;
    /// Flushes everything and stops; later commits fail with [`StoreError::Closed`].
    fn close(&self) -> StoreFuture<'_>;
    /// What the store can do now (for readiness).
    fn condition(&self) -> Condition;
    /// The term now (module docs); 0 for a store with one term.
    fn term(&self) -> u64 {
        0
    }
    /// What this instance does with a fenced write now.
    fn role(&self) -> Role {
        Role::Fences
    }
    /// For a write advanced in `term`: whether it may still be sent on; `None` when it always
    /// may (the file store).
    fn permit(&self, term: u64) -> Option<Permit> {
        let _ = term;
        None
    }
    /// The key a shared fence's instances sign the writes they send on to the leader with
    /// (docs/cluster.md); `None` for a store of one instance, or before it was read.
    fn peer_secret(&self) -> Option<Arc<[u8]>> {
        None
    }
    /// Batches sent again because the store's backing service took them out of order (the
    /// etcd store's batches in flight); 0 for a store that has none.
    fn batches_overtaken(&self) -> u64 {
        0
    }
}

/// Store failures. All of them keep fenced writes from being forwarded.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Another process holds the data directory's lock.
    #[error("data dir {} is in use by another fencegate (lock held on {})", .dir.display(), .dir.join(file::LOCK_FILE).display())]
    Locked {
        /// The data directory.
        dir: PathBuf,
    },
    /// An I/O error while opening, recovering or compacting.
    #[error("{}: {message}", .path.display())]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// Damage that is not a torn tail: starting would risk lowering `max_seen`.
    #[error("{}: corrupt at byte {offset}: {reason}; refusing to start (a dropped record could lower max_seen)", .path.display())]
    Corrupt {
        /// The damaged file.
        path: PathBuf,
        /// Byte offset of the damage.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// A write or sync failed; the store accepts no more advances until restarted.
    #[error("store failed and refuses further advances until restart: {0}")]
    Failed(String),
    /// The disk gave no room for the log (a full disk): nothing of the batch was written, and
    /// the next one tries again.
    #[error("no room on disk for the fence log: {0}")]
    NoSpace(String),
    /// The disk failed a write that makes room for the log (an I/O error, not a full disk):
    /// nothing of the batch was written, and the next one tries again.
    #[error("the disk failed to make room for the fence log (an I/O error, not a full disk): {0}")]
    RoomFailed(String),
    /// The data directory's file system is read-only: a store cannot open it.
    #[error("{}", read_only(.dir, .message))]
    ReadOnly {
        /// The data directory.
        dir: PathBuf,
        /// The file that could not be opened for writing, and the OS error.
        message: String,
    },
    /// The table holds `store.max_resources` marks (keys and floors); new ones are refused.
    #[error("the fence table is full ({0} resources, store.max_resources); only known resources accept writes")]
    Full(usize),
    /// The table's marks would take more than `store.max_table_bytes` ([`Table::bytes`]); new
    /// ones are refused.
    #[error(
        "the fence table is full ({0} bytes of keys, floors and gates, store.max_table_bytes); only known \
        resources accept writes"
    )]
    FullBytes(u64),
    /// The data directory's keys were made under other key rules (scopes, canonicalisation).
    #[error("{}: its fence keys were made under other key rules (recorded: {recorded:?}; configured: {configured:?}); \
        resources would get new keys without their max_seen and stale writes would pass. Restore the previous \
        [[fence.scopes]], or start on a new data dir made by `fencegate init --dir DIR --floor N` with N at or \
        above the lock service's current token (for etcd, its current revision)", .dir.display())]
    KeyingChanged {
        /// The data directory.
        dir: PathBuf,
        /// Rules recorded in the directory.
        recorded: String,
        /// Rules in the configuration.
        configured: String,
    },
    /// The data directory is missing or holds no state. It was never initialised, or its state
    /// was lost (a volume that was not mounted, a wiped disk): opening it would forget every
    /// `max_seen`.
    #[error("{}", not_initialised(.dir, *.missing))]
    NotInitialised {
        /// The data directory.
        dir: PathBuf,
        /// Whether it does not exist at all (otherwise it exists but holds no state).
        missing: bool,
    },
    /// The data directory has no segment and no snapshot, yet shows that it held a log:
    /// `KEYING` (recorded only once the log exists) or floors in `INIT` (recorded in segment
    /// 1). Its records were lost (a clean-up of `*.log`, a backup that skipped them): opening
    /// it would forget every `max_seen`.
    #[error("{}", log_missing(.dir, .evidence))]
    LogMissing {
        /// The data directory.
        dir: PathBuf,
        /// What shows it held a log.
        evidence: String,
    },
    /// `init` was asked to start a directory that already holds state.
    #[error("data dir {} already holds fence state ({found}); refusing to initialise it again, which could lower \
        max_seen; `fencegate run` opens it as it is", .dir.display())]
    AlreadyInitialised {
        /// The data directory.
        dir: PathBuf,
        /// The first file found that holds state.
        found: String,
    },
    /// The data directory's path names something that is not a directory (a regular file).
    #[error("{} is a file, not a directory: the data dir must be a directory, or a path where one can be made", .0.display())]
    NotADirectory(PathBuf),
    /// The key is longer than a record can hold.
    #[error("resource key of {0} bytes is too long")]
    KeyTooLong(usize),
    /// A batch makes a change its kind of mark does not take (a drop of a key, say).
    #[error("the store does not take {0}")]
    Unsupported(String),
    /// The store was closed.
    #[error("store is closed")]
    Closed,
    /// The etcd store cannot make advances durable now: no instance leads, etcd does not
    /// answer or lacks a quorum, or this instance stopped leading. Comes back by itself.
    #[error("the fence store in etcd is unavailable: {0}")]
    Unavailable(String),
    /// The etcd prefix holds no fence state (never initialised, or its state was lost).
    #[error(
        "etcd holds no fence state under {prefix:?}: it has no max_seen for any resource, and serving from it \
        would let every stale lock holder write again. A new deployment: `fencegate init --config FILE`. After \
        losing the state: `fencegate init --config FILE --floor <the lock service's current token>`, or \
        `fencegate migrate --config FILE --from DIR` to copy a file store's max_seen"
    )]
    NotInitialisedEtcd {
        /// The key prefix.
        prefix: String,
    },
    /// The etcd prefix holds fewer levels (`P/k/…`, `P/f/…`) than its census (`P/census`) says
    /// it must: some were deleted, and serving would forget their `max_seen`.
    #[error("{}", lost_marks_etcd(.prefix, *.recorded, *.found))]
    LostMarksEtcd {
        /// The key prefix.
        prefix: String,
        /// The levels the census records.
        recorded: u64,
        /// The levels found.
        found: u64,
    },
    /// `init` was asked to start an etcd prefix that already holds a fence.
    #[error(
        "etcd already holds fence state under {prefix:?}; refusing to initialise it again, which could \
        lower max_seen"
    )]
    AlreadyInitialisedEtcd {
        /// The key prefix.
        prefix: String,
    },
    /// The etcd prefix's keys were made under other key rules.
    #[error(
        "etcd prefix {prefix:?}: its fence keys were made under other key rules (recorded: {recorded:?}; \
        configured: {configured:?}); resources would get new keys without their max_seen. Restore the previous \
        [[fence.scopes]], or use a new prefix initialised with a floor at or above the lock service's token"
    )]
    KeyingChangedEtcd {
        /// The key prefix.
        prefix: String,
        /// Rules recorded in etcd.
        recorded: String,
        /// Rules in the configuration.
        configured: String,
    },
    /// The configuration decides writes otherwise than the fence's other instances.
    #[error(
        "etcd prefix {prefix:?}: this configuration fences writes otherwise than the fence's recorded rules, which \
        every instance shares ({differences}). Make [fence] (and [verify]'s and [s3]'s settings named) match them, or change \
        the fence's rules: stop every instance on the prefix, run `fencegate rules --config FILE --set` with the \
        new config, and start them all with it"
    )]
    RulesDifferEtcd {
        /// The key prefix.
        prefix: String,
        /// Each setting that differs, `name: recorded X, configured Y`, joined by `; `.
        differences: String,
    },
}

fn not_initialised(dir: &std::path::Path, missing: bool) -> String {
    let d = dir.display();
    let what = if missing { "does not exist" } else { "holds no fence state" };
    format!(
        "data dir {d} {what}: it has no max_seen for any resource. If it held state before (a volume that was not \
        mounted, a wiped disk, a new machine), starting on it would let every stale lock holder write again, so \
        fencegate does not start on it. A new deployment: `fencegate init --dir {d}`. After losing the state: \
        with no fencegate serving the backend, read the lock service's current token (for etcd, its current \
        revision) and run `fencegate init --dir {d} --floor <that token>` (README: Recovering from a lost volume)"
    )
}

fn read_only(dir: &std::path::Path, message: &str) -> String {
    format!(
        "data dir {} is on a read-only file system ({message}): fencegate keeps its fence log there and cannot \
        serve without writing it. A file system the kernel made read-only after a disk error stays so until it is \
        repaired: read the kernel log (dmesg), repair the file system (fsck) and mount it read-write, then start \
        fencegate. Until then it exits with status 74, and restarting it cannot help (docs/operations.md: A \
        read-only data directory)",
        dir.display()
    )
}

fn log_missing(dir: &std::path::Path, evidence: &str) -> String {
    let d = dir.display();
    format!(
        "data dir {d} has no segment and no snapshot, though it held a log ({evidence}): the log, and with it \
        the max_seen of every resource, was lost (a clean-up of *.log files, a backup or copy that skipped \
        them). Starting on it would let every stale lock holder write again, so fencegate does not start on it. \
        Recover as after a lost volume: with no fencegate serving the backend, read the lock service's current \
        token (for etcd, its current revision), make a new data dir with `fencegate init --dir <new dir> --floor \
        <that token>` and serve from it (docs/operations.md: Recovering from a lost volume)"
    )
}

fn lost_marks_etcd(prefix: &str, recorded: u64, found: u64) -> String {
    format!(
        "etcd prefix {prefix:?} holds {found} fence levels ({prefix}k/... and {prefix}f/...) where its census \
        ({prefix}census) records {recorded}: {} were deleted (by hand, a clean-up of keys, a restore or copy that \
        skipped them), and with them the max_seen of their resources. Serving from it would let stale lock \
        holders write again, so no instance leads it. Recover as after a lost volume: with no fencegate serving \
        the backend, read the lock service's current token (for etcd, its current revision) and start the fence \
        again on a new prefix (or this one emptied: `etcdctl del --prefix {prefix}`) with `fencegate init \
        --config FILE --floor <that token>` (docs/operations.md: Recovering from a lost volume)",
        recorded.saturating_sub(found)
    )
}

#[cfg(test)]
mod init_tests;
#[cfg(test)]
mod mark_tests;
#[cfg(test)]
mod model_tests;
#[cfg(test)]
mod reset_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod writer_tests;
