//! [`EtcdWriter`]: the leader's group commit to etcd. Every change and answer queued while the
//! previous transaction was under way joins the next one, and a batch is one transaction,
//! guarded by the leader's epoch and the batch chain:
//! `If(create_revision(P/leader) == epoch, value(P/batch) == last) Then(puts, deletes,
//! P/batch = next)`. Only once etcd has committed it (a quorum has it) is the table raised and
//! are the writes answered.
//!
//! A batch that creates levels (a key or floor the table does not hold, which it would if etcd
//! did: the takeover loaded every level, and only this leader has written since) also puts the
//! new count in `P/census`, in the same transaction, so the census never counts a level etcd
//! does not hold.
//!
//! An outcome that is not known (a timeout, a lost connection) is never taken as a failure: the
//! transaction may still apply. A barrier settles it: `If(same guard) Then(P/batch = barrier)`.
//! If the barrier commits, the lost batch can never apply (its compare on `P/batch` fails for
//! ever) and its writes are refused, their tokens unused. If the barrier's compare fails and
//! `P/batch` holds the lost batch's id, the batch committed and its writes go. Otherwise the
//! leadership is gone, and the writes are refused (sending nothing is always safe).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::lease::{Shared, Standing};
use super::names::{Names, batch_id, parse_batch_id, token_value};
use super::outcome::refusal;
use crate::etcd_client::{Client, Compare, EtcdError, Op};
use crate::store::file::CommitHook;
use crate::store::mark_batch::Room;
use crate::store::{Change, Mark, MarkBatch, StoreError, Table};

/// etcd's default `--max-txn-ops`: the operations one transaction may hold.
pub const DEFAULT_MAX_TXN_OPS: usize = 128;
/// Bytes of keys and values one transaction may carry, well under etcd's default request limit
/// (1.5 MiB).
const MAX_BYTES: usize = 1 << 20;
/// Between two tries of a barrier while etcd does not answer.
const BARRIER_RETRY: Duration = Duration::from_millis(100);

pub(crate) type Done = oneshot::Sender<Result<(), StoreError>>;

pub(crate) enum Msg {
    /// An advance or a reset, checked ([`MarkBatch::check`]) in `term`.
    Commit { batch: MarkBatch, term: u64, done: Done },
    /// An answered write, advanced in `term`.
    Answered { batch: MarkBatch, term: u64 },
    /// Commits what is queued, resigns and stops.
    Close(Done),
}

/// The operations a transaction holds for each mark of a batch making `change`, at most: an
/// advance puts the level and the in-flight marker (a binding's only the level), a reset the
/// level, an answer deletes the marker, a drop the level.
pub(crate) fn ops_per_mark(change: Change) -> usize {
    match change {
        Change::Advance => 2,
        Change::Reset | Change::Answered | Change::Drop => 1,
    }
}

impl Msg {
    /// An upper bound of the operations and bytes this message adds to a batch.
    fn cost(&self) -> (usize, usize) {
        match self {
            Msg::Commit { batch, .. } | Msg::Answered { batch, .. } => {
                let per = ops_per_mark(batch.change());
                // A put carries a token value besides its key; a delete only its key.
                let each = if matches!(batch.change(), Change::Answered | Change::Drop) { 24 } else { 48 };
                (batch.len() * per, batch.marks().iter().map(|m| (m.name.len() + each) * per).sum())
            }
            Msg::Close(_) => (0, 0),
        }
    }
}

/// What the writer needs, apart from its queue.
pub(crate) struct EtcdWriter {
    pub(crate) client: Client,
    pub(crate) names: Names,
    pub(crate) shared: Arc<Shared>,
    pub(crate) table: Arc<Table>,
    pub(crate) max_resources: usize,
    /// Operations of changes and answers one batch may hold: etcd's `--max-txn-ops` less the
    /// batch id's and the census's.
    pub(crate) max_ops: usize,
    pub(crate) on_commit: Option<CommitHook>,
    /// Taken from the queue and not yet in a batch: it did not fit the last one.
    carry: Option<Msg>,
    /// The batch chain of the epoch this writer last wrote in.
    chain: Option<Chain>,
}

/// Where a leader's batches stand in etcd.
struct Chain {
    epoch: i64,
    /// The id `P/batch` holds after this leader's last committed batch (or what the takeover
    /// read): the next batch's guard.
    last: Vec<u8>,
    /// The sequence number of the last transaction sent, batch or barrier, whatever became of
    /// it: every transaction gets an id never used before, so that reading it back in
    /// `P/batch` proves that very transaction committed.
    sent: u64,
    /// The levels etcd holds after this leader's last committed batch (the takeover's count
    /// to start with): what the census becomes with the next batch that creates any.
    census: u64,
}

/// One change of a batch, applied to the table once the batch commits.
enum Applied {
    Commit { batch: MarkBatch, done: Done },
    Answered(MarkBatch),
}

impl EtcdWriter {
    pub(crate) fn new(client: Client, names: Names, shared: Arc<Shared>, table: Arc<Table>) -> EtcdWriter {
        EtcdWriter {
            client,
            names,
            shared,
            table,
            max_resources: usize::MAX,
            max_ops: DEFAULT_MAX_TXN_OPS - 2,
            on_commit: None,
            carry: None,
            chain: None,
        }
    }

    /// Runs until closed, or until every sender is gone.
    pub(crate) async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Msg>) {
        loop {
            let first = match self.carry.take() {
                Some(m) => m,
                None => match rx.recv().await {
                    Some(m) => m,
                    None => break,
                },
            };
            let mut batch = Vec::new();
            let mut closing = None;
            let (mut ops, mut bytes) = (0, 0);
            let mut next = Some(first);
            while let Some(msg) = next.take() {
                if let Msg::Close(done) = msg {
                    closing = Some(done);
                    break;
                }
                let (o, b) = msg.cost();
                if !batch.is_empty() && (ops + o > self.max_ops || bytes + b > MAX_BYTES) {
                    self.carry = Some(msg);
                    break;
                }
                ops += o;
                bytes += b;
                batch.push(msg);
                next = rx.try_recv().ok();
            }
            self.commit(batch).await;
            if let Some(done) = closing {
                rx.close();
                while let Ok(msg) = rx.try_recv() {
                    if let Msg::Commit { done, .. } = msg {
                        let _ = done.send(Err(StoreError::Closed));
                    }
                }
                let _ = done.send(Ok(()));
                return;
            }
        }
    }

    /// The chain of `epoch`: from what the takeover read, the first time.
    fn chain(&mut self, epoch: i64) -> &mut Chain {
        if self.chain.as_ref().is_none_or(|c| c.epoch != epoch) {
            let (last, census) = self.shared.last_batch();
            self.chain = Some(Chain { epoch, last, sent: 0, census });
        }
        self.chain.get_or_insert_with(|| Chain { epoch, last: Vec::new(), sent: 0, census: 0 })
    }

    /// The guard's last id, and a new id and its sequence for the next transaction of `epoch`.
    fn next_id(&mut self, epoch: i64) -> (Vec<u8>, Vec<u8>, u64) {
        let chain = self.chain(epoch);
        chain.sent += 1;
        (chain.last.clone(), batch_id(epoch, chain.sent), chain.sent)
    }

    async fn commit(&mut self, group: Vec<Msg>) {
        if group.is_empty() {
            return;
        }
        let term = self.shared.term();
        let guard = self.shared.leading_in(term);
        let not_leader = || StoreError::Unavailable(not_leading(&self.shared.standing()));
        // The final state of every key the batch writes, in key order: etcd refuses a
        // transaction that names a key twice.
        let mut writes: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        let mut applied = Vec::with_capacity(group.len());
        let mut room = Room::default();
        // The highest advance of each mark so far in this batch.
        let mut batch_levels: HashMap<Mark, u64> = HashMap::new();
        // The levels this batch creates, each once however many of its changes name it.
        let mut created: HashSet<Mark> = HashSet::new();
        for msg in group {
            match msg {
                Msg::Answered { batch, term: answered_in } => {
                    // An answer from an earlier term leaves etcd's marker alone: a later term
                    // may have set it for a write of its own (costing a quarantine at most).
                    if answered_in == term {
                        for mark in batch.marks() {
                            writes.insert(self.names.in_flight(mark.borrowed()), None);
                        }
                    }
                    applied.push(Applied::Answered(batch));
                }
                Msg::Commit { done, term: checked, .. } if guard.is_none() || checked != term => {
                    let _ = done.send(Err(not_leader()));
                }
                Msg::Commit { batch, done, .. } => {
                    let (marks, token, change) = (batch.marks(), batch.token(), batch.change());
                    // Levels only climb here, whatever the caller checked: an advance below a
                    // mark's level, or below an advance of it earlier in this batch, is refused
                    // (a change whose caller stopped waiting may still be queued ahead of it).
                    let level = |mark: &Mark| self.table.level(mark.borrowed());
                    if change == Change::Advance
                        && marks.iter().any(|m| {
                            let queued = batch_levels.get(m).copied();
                            level(m).max(queued).is_some_and(|l| token < l)
                        })
                    {
                        let why = "a higher level of one of its marks was committed or is being committed";
                        let _ = done.send(Err(StoreError::Unavailable(why.into())));
                        continue;
                    }
                    if change == Change::Advance {
                        for m in marks {
                            let e = batch_levels.entry(m.clone()).or_insert(token);
                            *e = (*e).max(token);
                        }
                    }
                    if let (_, Err(e)) = room.take(&self.table, self.max_resources, &batch) {
                        let _ = done.send(Err(e));
                        continue;
                    }
                    // The census counts levels, which are never lost; a binding is not one.
                    created.extend(marks.iter().filter(|m| m.kind.is_level() && level(m).is_none()).cloned());
                    for mark in marks {
                        if change == Change::Drop {
                            writes.insert(self.names.level(mark.borrowed()), None);
                            continue;
                        }
                        writes.insert(self.names.level(mark.borrowed()), Some(token_value(token)));
                        if change == Change::Advance && mark.kind.is_level() {
                            writes.insert(self.names.in_flight(mark.borrowed()), Some(token_value(token)));
                        }
                    }
                    applied.push(Applied::Commit { batch, done });
                }
                Msg::Close(done) => {
                    let _ = done.send(Ok(()));
                }
            }
        }
        let Some((epoch, _lease)) = guard else {
            // Not leading: answers stay in flight in etcd, which costs the next leader a
            // quarantine at most.
            self.apply(applied, Ok(()), true);
            return;
        };
        if applied.iter().all(|a| matches!(a, Applied::Answered(_))) && writes.is_empty() {
            // Answers of an earlier term only: nothing for etcd, but the table hears of them.
            self.apply(applied, Ok(()), true);
            return;
        }
        let (last, next, seq) = self.next_id(epoch);
        let advances = applied.iter().filter(|a| matches!(a, Applied::Commit { .. })).count();
        let mut success: Vec<Op> = writes
            .into_iter()
            .map(|(key, value)| match value {
                Some(value) => Op::Put { key, value, lease: 0 },
                None => Op::Delete(key),
            })
            .collect();
        success.push(Op::Put { key: self.names.batch(), value: next.clone(), lease: 0 });
        // Counted from the chain's census, which only committed batches move.
        let census = (!created.is_empty()).then(|| self.chain(epoch).census + created.len() as u64);
        if let Some(count) = census {
            success.push(Op::Put { key: self.names.census(), value: token_value(count), lease: 0 });
        }
        let guard =
            [Compare::CreateRevision(self.names.leader(), epoch), Compare::Value(self.names.batch(), last.clone())];
        let failure = [Op::Get(self.names.batch())];
        let started = Instant::now();
        let outcome = match self.client.txn(&guard, &success, &failure).await {
            Ok(r) if r.succeeded => Ok(()),
            Ok(_) => Err(self.lost(epoch, "the leader key or the batch chain in etcd changed: another instance leads")),
            Err(e) => match refusal(&e) {
                Some(definite) => Err(definite),
                None => self.settle(term, epoch, (&next, seq), &e).await,
            },
        };
        match &outcome {
            Ok(()) => {
                let chain = self.chain(epoch);
                chain.last = next;
                if let Some(count) = census {
                    chain.census = count;
                }
                self.shared.set_full(None);
                if let (Some(hook), true) = (&self.on_commit, advances > 0) {
                    hook(started.elapsed(), advances);
                }
            }
            Err(StoreError::NoSpace(why)) => self.shared.set_full(Some(why.clone())),
            Err(_) => {}
        }
        self.apply(applied, outcome, false);
    }

    /// Settles a batch whose outcome etcd did not tell, with a barrier (module docs).
    async fn settle(&mut self, term: u64, epoch: i64, lost: (&[u8], u64), error: &EtcdError) -> Result<(), StoreError> {
        tracing::warn!(error = %error, "etcd did not answer a batch; settling it with a barrier");
        let (lost, lost_seq) = lost;
        let cancelled = || {
            StoreError::Unavailable(format!(
                "etcd did not answer ({error}); the batch was cancelled and nothing was sent"
            ))
        };
        loop {
            // A new id for every try: a barrier whose answer is lost too must not be taken for
            // the batch, nor for another try of itself.
            let (last, barrier, _) = self.next_id(epoch);
            let guard = [Compare::CreateRevision(self.names.leader(), epoch), Compare::Value(self.names.batch(), last)];
            let success = [Op::Put { key: self.names.batch(), value: barrier.clone(), lease: 0 }];
            let failure = [Op::Get(self.names.batch())];
            let read = |r: &crate::etcd_client::TxnResult| {
                r.ranges.first().and_then(Option::as_ref).map(|kv| kv.value.clone())
            };
            match self.client.txn(&guard, &success, &failure).await {
                Ok(r) if r.succeeded => {
                    self.chain(epoch).last = barrier;
                    return Err(cancelled());
                }
                Ok(r) if read(&r).as_deref() == Some(lost) => {
                    tracing::info!("the batch etcd did not answer had committed");
                    return Ok(());
                }
                Ok(r)
                    if read(&r)
                        .and_then(|id| parse_batch_id(&id))
                        .is_some_and(|(e, seq)| e == epoch && seq > lost_seq && seq <= self.chain(epoch).sent) =>
                {
                    // An earlier try of this barrier, whose answer was lost, committed.
                    self.chain(epoch).last = read(&r).unwrap_or_default();
                    return Err(cancelled());
                }
                Ok(_) => {
                    let why = "the leader key or the batch chain in etcd changed while a batch was unsettled";
                    return Err(self.lost(epoch, why));
                }
                // Only while this leadership lasts: a definite refusal, or a lease that lapsed,
                // ends it (the writes are refused; a batch that did commit is in etcd for the
                // next takeover).
                Err(e) if refusal(&e).is_none() && self.shared.leading_in(term).is_some() => {
                    tokio::time::sleep(BARRIER_RETRY).await;
                }
                Err(e) => {
                    return Err(self.lost(epoch, &format!("the batch could not be settled: {e}")));
                }
            }
        }
    }

    /// Steps down from leading in `epoch`: its guard no longer holds. A newer leadership of
    /// this instance is left alone.
    fn lost(&self, epoch: i64, why: &str) -> StoreError {
        if self.shared.step_down(epoch, why) {
            tracing::warn!(reason = why, "no longer the leader: stepping down");
        }
        StoreError::Unavailable(format!("this instance stopped leading: {why}"))
    }

    /// Raises the table for what committed, and answers every change with `outcome`.
    fn apply(&self, applied: Vec<Applied>, outcome: Result<(), StoreError>, answers_only: bool) {
        for a in applied {
            match a {
                Applied::Answered(answered) => self.table.apply(&answered),
                Applied::Commit { done, .. } if answers_only => {
                    let _ = done.send(Err(StoreError::Unavailable(not_leading(&self.shared.standing()))));
                }
                Applied::Commit { batch, done } => {
                    if outcome.is_ok() {
                        self.table.apply(&batch);
                    }
                    let _ = done.send(outcome.clone());
                }
            }
        }
    }
}

/// Why this instance cannot advance now, for a refusal.
pub(crate) fn not_leading(standing: &Standing) -> String {
    match standing {
        Standing::Seeking(why) => format!("no instance leads the fence now ({why})"),
        Standing::Following(url) => format!("the fence is led by {url}, not by this instance"),
        Standing::TakingOver => "this instance is taking over the fence and reading it from etcd".into(),
        Standing::Leading { .. } => "this instance's lease is not trusted now".into(),
        Standing::Stopped(why) => format!("the etcd store stopped: {why}"),
    }
}
