//! [`EtcdStore`]: the fence shared by several instances through an etcd cluster, one writer at
//! a time (docs/cluster.md). The instances elect a leader (`leadership`); the leader fences
//! writes with its own table and commits each group-commit batch to etcd as one transaction
//! guarded by its leadership (`batch`); the others forward fenced writes to it. A new leader
//! reads the fence from etcd first (`takeover`). Every advance is committed on a quorum of
//! etcd before the write is forwarded; without a leader, or without etcd, fenced writes are
//! refused and reads go on.

mod batch;
mod flights;
mod leadership;
mod lease;
pub(crate) mod names;
mod outcome;
mod provision;
mod takeover;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::file::CommitHook;
use super::mark_batch::{noted, refused};
use super::{Change, Condition, MarkBatch, Permit, Role, Store, StoreError, StoreFuture, Table};
use crate::etcd_client::Client;
use batch::Msg;
pub use batch::{DEFAULT_BATCHES_IN_FLIGHT, DEFAULT_MAX_TXN_OPS};
pub use leadership::TakeoverHook;
use lease::{Shared, Standing};
use names::Names;
pub use provision::{Agreement, Migrated, agreement, differences, init, migrate, rules, stored_rules};
pub use takeover::Adopted;

/// How an [`EtcdStore`] behaves.
#[derive(Clone)]
pub struct EtcdOptions {
    /// The key prefix every key of the store starts with (`/fencegate/`).
    pub prefix: String,
    /// The URL other instances forward fenced writes to while this one leads.
    pub advertise: String,
    /// The leader's lease: how long after its last acknowledged keep-alive a silent leader
    /// is replaced.
    pub lease_ttl: Duration,
    /// How much sooner than etcd the leader stops trusting its lease (clock-rate differences).
    pub lease_margin: Duration,
    /// New marks beyond this many, keys and floors together, are refused.
    pub max_resources: usize,
    /// New marks that would take the table's memory past this many bytes are refused.
    pub max_table_bytes: u64,
    /// The key rules the fence keys are made under, recorded at `init`.
    pub keying: String,
    /// The settings that decide a write's fate ([`Config::fence_record`](crate::Config::fence_record)),
    /// recorded at `init` or by the first instance to open a prefix without them.
    pub rules: String,
    /// The most operations one transaction may hold: etcd's `--max-txn-ops` (128 by default),
    /// which bounds how many writes one batch commits.
    pub max_txn_ops: usize,
    /// Batches in flight to etcd at once, each guarded by the one before it
    /// ([`DEFAULT_BATCHES_IN_FLIGHT`]).
    pub batches_in_flight: usize,
    /// Called after each batch that made advances durable (metrics).
    pub on_commit: Option<CommitHook>,
}

impl std::fmt::Debug for EtcdOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdOptions")
            .field("prefix", &self.prefix)
            .field("advertise", &self.advertise)
            .field("lease_ttl", &self.lease_ttl)
            .field("lease_margin", &self.lease_margin)
            .finish_non_exhaustive()
    }
}

/// The fence in etcd, as one instance sees it.
#[derive(Debug)]
pub struct EtcdStore {
    tx: mpsc::UnboundedSender<Msg>,
    table: Arc<Table>,
    shared: Arc<Shared>,
    /// The election, once started; taken by `close`, which waits for it to resign.
    campaign: Mutex<Option<JoinHandle<()>>>,
    /// What the election needs, until `start`.
    pending: Mutex<Option<(Client, Names, EtcdOptions, takeover::Recorded)>>,
    /// Operations a change may take in one batch.
    max_ops: usize,
    /// How long a change waits for its batch before it is refused (etcd that keeps answering
    /// neither way while the lease holds). The change may still commit after that: the writer
    /// never lowers a level, so a later write checked against the older level is refused there.
    answer_within: Duration,
    /// Batches etcd took before the batch sent ahead of them, which were sent again.
    overtaken: Arc<AtomicU64>,
}

impl EtcdStore {
    /// Opens the store on `client`'s cluster and starts its batch writer. If etcd answers, a
    /// prefix that was never initialised (or keyed under other rules) is refused here; if it
    /// does not, the store opens and serves no fenced write until it does. It does not
    /// campaign before [`EtcdStore::start`].
    pub async fn open(client: Client, options: EtcdOptions) -> Result<EtcdStore, StoreError> {
        let names = Names::new(&options.prefix);
        let recorded = takeover::Recorded { keying: options.keying.clone(), rules: stored_rules(&options.rules) };
        let mut secret = None;
        match takeover::admitted(&client, &names, &recorded).await {
            Ok(key) => secret = Some(key),
            Err(takeover::Failed::Fatal(e)) => return Err(e),
            Err(takeover::Failed::Etcd(e)) => {
                tracing::warn!(error = %e, "etcd does not answer: fenced writes are refused until it does");
            }
        }
        let table = Arc::new(Table::new().with_max_bytes(options.max_table_bytes));
        let shared = Arc::new(Shared::new(options.lease_margin));
        if let Some(secret) = secret {
            shared.set_secret(secret);
        }
        let mut writer = batch::EtcdWriter::new(client.clone(), names.clone(), Arc::clone(&shared), Arc::clone(&table));
        writer.max_resources = options.max_resources;
        let max_ops = batch::change_ops(options.max_txn_ops);
        writer.max_ops = max_ops;
        writer.window = options.batches_in_flight.max(1);
        let overtaken = Arc::clone(&writer.overtaken);
        writer.on_commit = options.on_commit.clone();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(writer.run(rx));
        let answer_within = options.lease_ttl * 2;
        let pending = Mutex::new(Some((client, names, options, recorded)));
        Ok(EtcdStore { tx, table, shared, campaign: Mutex::new(None), pending, max_ops, answer_within, overtaken })
    }

    /// Starts campaigning; `hook` hears of each takeover before this instance leads. Once.
    pub fn start(&self, hook: TakeoverHook) {
        let Some((client, names, options, recorded)) = self.pending.lock().unwrap_or_else(|e| e.into_inner()).take()
        else {
            return;
        };
        let campaign = leadership::Campaign {
            client,
            names,
            shared: Arc::clone(&self.shared),
            table: Arc::clone(&self.table),
            ttl: options.lease_ttl,
            advertise: options.advertise,
            recorded,
            hook,
        };
        *self.campaign.lock().unwrap_or_else(|e| e.into_inner()) = Some(tokio::spawn(campaign.run()));
    }

    /// Whether this instance leads the fence now.
    pub fn leading(&self) -> bool {
        matches!(self.shared.standing(), Standing::Leading { .. }) && self.shared.lease_valid()
    }

    /// Drops bindings more than one transaction takes, in as many as they need: each binding's
    /// drop stands alone, so a drop need not be atomic (when `s3.max_uploads` is reached the
    /// fence drops every binding that can never complete at once, however many).
    fn drop_in_parts(&self, term: u64, batch: &MarkBatch) -> StoreFuture<'_> {
        let parts: Vec<StoreFuture<'_>> = batch
            .marks()
            .chunks(self.max_ops / batch::ops_per_mark(Change::Drop))
            .map(|some| {
                let part = MarkBatch::drop_bindings(some.iter().cloned());
                self.send(|done| Msg::Commit { batch: part, term, done })
            })
            .collect();
        Box::pin(async move {
            for part in parts {
                part.await?;
            }
            Ok(())
        })
    }

    fn send(&self, make: impl FnOnce(oneshot::Sender<Result<(), StoreError>>) -> Msg) -> StoreFuture<'_> {
        let (done, rx) = oneshot::channel();
        let sent = self.tx.send(make(done));
        let within = self.answer_within;
        Box::pin(async move {
            sent.map_err(|_| StoreError::Closed)?;
            match tokio::time::timeout(within, rx).await {
                Ok(answer) => answer.map_err(|_| StoreError::Closed)?,
                // Refused unsent: should the batch still commit, its advance is in etcd, which
                // only refuses more.
                Err(_) => Err(StoreError::Unavailable(format!("the fence store did not answer within {within:?}"))),
            }
        })
    }
}

impl Drop for EtcdStore {
    /// A store dropped without `close` (an open that failed later, a proxy dropped) stops: its
    /// lease lapses, its keep-alive ends, and the election resigns if it led and revokes the
    /// lease, on the runtime while it runs; so it never leads with no writer behind it.
    fn drop(&mut self) {
        self.shared.stop("the store was dropped");
    }
}

impl Store for EtcdStore {
    fn table(&self) -> &Arc<Table> {
        &self.table
    }

    fn peer_secret(&self) -> Option<Arc<[u8]>> {
        self.shared.secret()
    }

    fn batches_overtaken(&self) -> u64 {
        self.overtaken.load(Ordering::Relaxed)
    }

    fn commit(&self, term: u64, mut batch: MarkBatch) -> StoreFuture<'_> {
        if batch.change() == Change::Answered {
            let _ = self.tx.send(Msg::Answered { batch, term });
            return noted();
        }
        match batch.check() {
            Err(e) => return refused(e),
            Ok(false) => return noted(),
            Ok(true) => {}
        }
        if batch.len() * batch::ops_per_mark(batch.change()) > self.max_ops {
            if batch.change() == Change::Drop {
                return self.drop_in_parts(term, &batch);
            }
            let why = format!("a write of {} marks does not fit one etcd transaction", batch.len());
            return refused(StoreError::Unavailable(why));
        }
        self.send(|done| Msg::Commit { batch, term, done })
    }

    fn close(&self) -> StoreFuture<'_> {
        let flushed = self.send(Msg::Close);
        Box::pin(async move {
            let flushed = flushed.await;
            self.shared.stop("the store was closed");
            let campaign = self.campaign.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(campaign) = campaign {
                // It resigns if it leads; a cluster that does not answer leaves it to the lease.
                let _ = tokio::time::timeout(Duration::from_secs(5), campaign).await;
            }
            flushed
        })
    }

    fn condition(&self) -> Condition {
        match self.shared.standing() {
            Standing::Leading { .. } if !self.shared.lease_valid() => {
                Condition::Unavailable("this instance's lease is not trusted now".into())
            }
            Standing::Leading { .. } => match self.shared.full() {
                Some(why) => Condition::Full(why),
                None => Condition::Ready,
            },
            Standing::Following(_) => Condition::Ready,
            Standing::Stopped(why) => Condition::Failed(why),
            standing => Condition::Unavailable(batch::not_leading(&standing)),
        }
    }

    fn term(&self) -> u64 {
        self.shared.term()
    }

    fn role(&self) -> Role {
        match self.shared.standing() {
            Standing::Leading { .. } if self.shared.lease_valid() => Role::Fences,
            Standing::Following(url) => Role::Forward(url),
            standing => Role::Unavailable(batch::not_leading(&standing)),
        }
    }

    fn permit(&self, term: u64) -> Option<Permit> {
        let shared = Arc::clone(&self.shared);
        Some(Arc::new(move || shared.may_send(term)))
    }
}
