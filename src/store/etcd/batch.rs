//! [`EtcdWriter`]: the leader's group commit to etcd. Every change and answer queued while the
//! window of batches in flight is full joins the next batch, and a batch is one transaction,
//! guarded by the leader's epoch and the batch chain:
//! `If(create_revision(P/leader) == epoch, value(P/batch) == previous) Then(puts, deletes,
//! P/batch = next)`. Only once etcd has committed it (a quorum has it) is the table raised and
//! are the writes answered.
//!
//! Up to `window` batches are in flight at once, each guarded by the id of the one sent before
//! it, so etcd applies a batch only after all earlier ones, whatever order it takes them in
//! (tests/cluster/pipeline_model.rs checks the protocol). Their answers are read in the order
//! the batches were sent:
//! - committed: the table is raised and the batch's writes go;
//! - the compare failed and `P/batch` held an earlier id of this leader's chain: etcd took the
//!   batch before its predecessor. It did not apply, and no batch after it can (each names an id
//!   that will never be written): all of them are sent again, under new ids;
//! - a refusal certain to have applied nothing (`outcome`): the batch's writes are refused, the
//!   batches after it sent again;
//! - the compare failed otherwise: another instance leads, and this one steps down.
//!
//! A batch that creates levels (a key or floor the table does not hold, nor a batch in flight
//! before it, which they would if etcd did: the takeover loaded every level, and only this
//! leader has written since) also puts the new count in `P/census`, in the same transaction, so
//! the census never counts a level etcd does not hold.
//!
//! An outcome that is not known (a timeout, a lost connection) is never taken as a failure: the
//! transaction may still apply. A barrier settles it: `If(same epoch, P/batch == the id before
//! the lost batch) Then(P/batch = barrier)`. If the barrier commits, the lost batch can never
//! apply (its compare on `P/batch` fails for ever), nor any after it: its writes are refused,
//! their tokens unused, and the later batches sent again. If the barrier's compare fails and
//! `P/batch` holds the lost batch's id or a later one of the batches in flight, the chain got
//! that far: every batch up to that one committed. Otherwise the leadership is gone, and the
//! writes are refused (sending nothing is always safe).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};
use tokio::task::{JoinError, JoinHandle};
use tokio::time;

use super::flights::{self, Entry, Flight, Flights};
use super::lease::{Shared, Standing, Start};
use super::names::{Names, batch_id, parse_batch_id, token_value};
use super::outcome::refusal;
use crate::etcd_client::{Client, Compare, EtcdError, Op, TxnResult};
use crate::store::file::CommitHook;
use crate::store::mark_batch::Room;
use crate::store::{Change, Mark, MarkBatch, StoreError, Table};

/// etcd's default `--max-txn-ops`: the operations one transaction may hold.
pub const DEFAULT_MAX_TXN_OPS: usize = 128;
/// Batches in flight to etcd at once, by default.
pub const DEFAULT_BATCHES_IN_FLIGHT: usize = 4;
/// Bytes of keys and values one transaction's changes may carry, well under etcd's default
/// request limit (1.5 MiB).
const MAX_BYTES: usize = 1 << 20;
/// Bytes beyond [`MAX_BYTES`] for the deletes of spent flight records and the entries a flight
/// record carries from older ones.
const EXTRA_BYTES: usize = 256 << 10;
/// Between two tries of a barrier while etcd does not answer.
const BARRIER_RETRY: Duration = Duration::from_millis(100);
/// How long the writer waits, idle, before it sends a transaction that only deletes spent
/// flight records: while changes keep coming, the deletes ride with them.
const FLIGHT_SWEEP: Duration = Duration::from_millis(100);

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
/// advance puts the level (its entry in the batch's flight record costs no operation), a
/// reset puts it, a drop deletes it; an answer costs none (it spends an entry of a flight
/// record, which a batch deletes once every entry is spent).
pub(crate) fn ops_per_mark(change: Change) -> usize {
    match change {
        Change::Advance | Change::Reset | Change::Drop => 1,
        Change::Answered => 0,
    }
}

/// The operations of a transaction of at most `max_txn_ops` that changes and deletes of spent
/// flight records may take: the rest are the batch id's, the census's and the flight record's.
pub(crate) fn change_ops(max_txn_ops: usize) -> usize {
    max_txn_ops.max(4) - 3
}

impl Msg {
    /// An upper bound of the operations and bytes this message adds to a batch.
    fn cost(&self) -> (usize, usize) {
        match self {
            Msg::Commit { batch, .. } => {
                let per = ops_per_mark(batch.change());
                // A put carries a token value besides its key, and an advance an entry in the
                // flight record (its name as JSON: at most six bytes a byte); a delete only its
                // key.
                let each = match batch.change() {
                    Change::Advance => |m: &Mark| 7 * m.name.len() + 88,
                    Change::Reset => |m: &Mark| m.name.len() + 48,
                    Change::Answered | Change::Drop => |m: &Mark| m.name.len() + 24,
                };
                (batch.len() * per, batch.marks().iter().map(each).sum())
            }
            Msg::Answered { .. } | Msg::Close(_) => (0, 0),
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
    /// Operations of changes and of deletes of spent flight records one batch may hold
    /// ([`change_ops`]).
    pub(crate) max_ops: usize,
    /// Batches in flight at most.
    pub(crate) window: usize,
    pub(crate) on_commit: Option<CommitHook>,
    /// Batches sent again because etcd took them before the batch sent ahead of them.
    pub(crate) overtaken: Arc<AtomicU64>,
    /// The batch chain of the epoch this writer last wrote in.
    chain: Option<Chain>,
}

/// Where a leader's batches stand in etcd.
struct Chain {
    epoch: i64,
    /// What the takeover read in `P/batch`: where this leader's chain starts.
    start: Vec<u8>,
    /// The id `P/batch` holds after this leader's last batch known to have committed (or what
    /// the takeover read): the guard of a barrier.
    last: Vec<u8>,
    /// The id of the last batch sent: the next batch's guard. `last` when none is in flight.
    tail: Vec<u8>,
    /// The sequence number of the last transaction sent, batch or barrier, whatever became of
    /// it: every transaction gets an id never used before, so that reading it back in
    /// `P/batch` proves that very transaction committed.
    sent: u64,
    /// The levels etcd holds after this leader's last committed batch (the takeover's count
    /// to start with).
    census: u64,
    /// The levels etcd holds once every batch in flight commits: what the census becomes with
    /// the next batch that creates any.
    tail_census: u64,
    /// The writes in flight as etcd's committed flight records hold them.
    flights: Flights,
}

impl Chain {
    /// Whether `read`, found in `P/batch` by a batch guarded by `guard`, is an id this chain
    /// passed before it reached `guard`: the takeover's, or an earlier one of this epoch. Then
    /// etcd took the batch before its predecessor.
    fn passed(&self, read: &[u8], guard: &[u8]) -> bool {
        if read == guard {
            return false;
        }
        if read == self.start {
            return true;
        }
        match (parse_batch_id(read), parse_batch_id(guard)) {
            (Some((e, seq)), Some((g, guard_seq))) => e == self.epoch && g == self.epoch && seq < guard_seq,
            _ => false,
        }
    }
}

/// A batch sent to etcd whose answer is not read yet.
struct InFlight {
    epoch: i64,
    term: u64,
    /// Its id, and its guard's: the id of the batch sent before it.
    id: Vec<u8>,
    guard: Vec<u8>,
    /// Its changes and answers, as queued.
    msgs: Vec<Msg>,
    /// The highest advance of each mark in it, which batches behind it check against.
    levels: HashMap<Mark, u64>,
    /// The levels it creates, which batches behind it do not count again.
    created: HashSet<Mark>,
    /// The room its own new marks take (not the batches' ahead of it).
    room: Room,
    /// What `P/census` holds once it commits, when it moves it.
    census: Option<u64>,
    /// Its flight record's entries: the marks it advances, and those it carries from older
    /// records, with their tokens.
    record: Vec<Entry>,
    /// The spent flights it deletes.
    deletes: Vec<Flight>,
    /// A barrier found the chain past it: it committed, whatever its answer says.
    committed: bool,
    started: Instant,
    answer: JoinHandle<Result<TxnResult, EtcdError>>,
}

/// How a batch ended that did not commit.
enum Ended {
    /// Certain not to have applied; its writes are refused with the error.
    Refused(StoreError),
    /// etcd took it before its predecessor: it is sent again.
    Overtaken,
}

impl EtcdWriter {
    pub(crate) fn new(client: Client, names: Names, shared: Arc<Shared>, table: Arc<Table>) -> EtcdWriter {
        EtcdWriter {
            client,
            names,
            shared,
            table,
            max_resources: usize::MAX,
            max_ops: change_ops(DEFAULT_MAX_TXN_OPS),
            window: DEFAULT_BATCHES_IN_FLIGHT,
            on_commit: None,
            overtaken: Arc::default(),
            chain: None,
        }
    }

    /// Runs until closed, or until every sender is gone.
    pub(crate) async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Msg>) {
        let mut pipeline: VecDeque<InFlight> = VecDeque::new();
        // Taken from the channel and not yet in a batch: sent-again batches' messages first.
        let mut queue: VecDeque<Msg> = VecDeque::new();
        let mut closing = None;
        let mut open = true;
        let mut pace = Pace::default();
        // Whether the spent records were sent once the store began to close.
        let mut swept = false;
        loop {
            // Send while the window has room and the pace allows. A batch goes only in the
            // epoch of those in flight: a new leadership starts its chain once the old one's
            // batches are read.
            if open && closing.is_none() {
                take(&mut rx, &mut queue, &mut closing, &mut open);
            }
            while pipeline.len() < self.window.max(1)
                && self.same_epoch(&pipeline)
                && (pipeline.is_empty() || (self.holds_a_full_batch(&queue) && pace.allows(time::Instant::now())))
            {
                let group = self.group(&mut queue);
                if group.is_empty() {
                    break;
                }
                match self.send(group, &pipeline, false) {
                    Ok(Some(sent)) => {
                        pace.sent(time::Instant::now(), self.window);
                        pipeline.push_back(sent);
                    }
                    Ok(None) => {}
                    Err(group) => {
                        // The leadership changed since `same_epoch` looked: this group waits
                        // until the old epoch's batches are read.
                        for msg in group.into_iter().rev() {
                            queue.push_front(msg);
                        }
                        break;
                    }
                }
            }
            let room = pipeline.len() < self.window && open && closing.is_none();
            // Queued messages wait for the pace, not for an answer or a new message.
            let paced = (room
                && self.holds_a_full_batch(&queue)
                && self.same_epoch(&pipeline)
                && !pace.allows(time::Instant::now()))
            .then(|| pace.next());
            let Some(head) = pipeline.front_mut() else {
                if !queue.is_empty() {
                    continue;
                }
                if closing.is_some() && !swept && self.spent_waiting() {
                    // Closing: the spent records go before the leader resigns, so that the
                    // next one does not quarantine what was answered.
                    swept = true;
                    if let Ok(Some(sent)) = self.send(Vec::new(), &pipeline, true) {
                        pipeline.push_back(sent);
                    }
                    continue;
                }
                if let Some(done) = closing.take() {
                    rx.close();
                    while let Ok(msg) = rx.try_recv() {
                        if let Msg::Commit { done, .. } = msg {
                            let _ = done.send(Err(StoreError::Closed));
                        }
                    }
                    let _ = done.send(Ok(()));
                    return;
                }
                if !open {
                    return;
                }
                let msg = if self.spent_waiting() {
                    match time::timeout(FLIGHT_SWEEP, rx.recv()).await {
                        Ok(msg) => msg,
                        Err(_) => {
                            // Idle: the spent records go alone.
                            if let Ok(Some(sent)) = self.send(Vec::new(), &pipeline, true) {
                                pipeline.push_back(sent);
                            }
                            continue;
                        }
                    }
                } else {
                    rx.recv().await
                };
                match msg {
                    Some(Msg::Close(done)) => closing = Some(done),
                    Some(msg) => queue.push_back(msg),
                    None => open = false,
                }
                continue;
            };
            let answer = tokio::select! {
                biased;
                answer = &mut head.answer, if !head.committed => Some(answer),
                () = std::future::ready(()), if head.committed => None,
                () = time::sleep_until(paced.unwrap_or_else(time::Instant::now)), if paced.is_some() => continue,
                msg = rx.recv(), if room => {
                    match msg {
                        Some(Msg::Close(done)) => closing = Some(done),
                        Some(msg) => queue.push_back(msg),
                        None => open = false,
                    }
                    continue;
                }
            };
            let took = self.read(answer, &mut pipeline, &mut queue).await;
            pace.answered(took);
            // Answers etcd sent together are read together, so that they free the window for
            // one batch, not several sent back to back; so are batches a barrier found committed.
            while let Some(head) = pipeline.front_mut().filter(|f| f.committed || f.answer.is_finished()) {
                let answer = if head.committed { None } else { Some((&mut head.answer).await) };
                let took = self.read(answer, &mut pipeline, &mut queue).await;
                pace.answered(took);
            }
        }
    }

    /// Whether spent flight records wait for a batch to delete them while this instance leads:
    /// its own, or those its takeover read. Only with nothing in flight (the chain may be of
    /// a new epoch).
    fn spent_waiting(&mut self) -> bool {
        match self.shared.leading_in(self.shared.term()) {
            Some((epoch, _)) => self.chain(epoch).flights.has_spent(),
            None => false,
        }
    }

    /// Whether a batch sent now would be in the epoch of the batches in flight.
    fn same_epoch(&self, pipeline: &VecDeque<InFlight>) -> bool {
        let Some(last) = pipeline.back() else { return true };
        self.shared.leading_in(self.shared.term()).is_some_and(|(epoch, _)| epoch == last.epoch)
    }

    /// Whether `queue` holds at least as much as one transaction takes. Beside batches in
    /// flight only a full batch goes: a partial one waits for the answer ahead of it and
    /// gathers what arrives meanwhile, since etcd commits one transaction of many writes for
    /// about the cost of one of few.
    fn holds_a_full_batch(&self, queue: &VecDeque<Msg>) -> bool {
        let (mut ops, mut bytes) = (0, 0);
        queue.iter().any(|msg| {
            let (o, b) = msg.cost();
            ops += o;
            bytes += b;
            ops >= self.change_room() || bytes >= MAX_BYTES
        })
    }

    /// Operations of changes one batch may hold: [`EtcdWriter::max_ops`] less a sixteenth (one
    /// at least) kept for the deletes of spent flight records, so that full batches delete them
    /// too.
    fn change_room(&self) -> usize {
        self.max_ops.saturating_sub((self.max_ops / 16).max(1)).max(1)
    }

    /// The messages of the next batch, from the front of `queue`: as many as one transaction
    /// holds (the first one always).
    fn group(&self, queue: &mut VecDeque<Msg>) -> Vec<Msg> {
        let mut group = Vec::new();
        let (mut ops, mut bytes) = (0, 0);
        while let Some(msg) = queue.front() {
            let (o, b) = msg.cost();
            if !group.is_empty() && (ops + o > self.change_room() || bytes + b > MAX_BYTES) {
                break;
            }
            ops += o;
            bytes += b;
            group.extend(queue.pop_front());
        }
        group
    }

    /// The chain of `epoch`: from what the takeover read, the first time.
    fn chain(&mut self, epoch: i64) -> &mut Chain {
        if self.chain.as_ref().is_none_or(|c| c.epoch != epoch) {
            let Start { batch, census, flights } = self.shared.start();
            let chain = Chain {
                epoch,
                start: batch.clone(),
                tail: batch.clone(),
                last: batch,
                sent: 0,
                census,
                tail_census: census,
                flights,
            };
            self.chain = Some(chain);
        }
        self.chain.get_or_insert_with(|| Chain {
            epoch,
            start: Vec::new(),
            last: Vec::new(),
            tail: Vec::new(),
            sent: 0,
            census: 0,
            tail_census: 0,
            flights: Flights::default(),
        })
    }

    /// A new id and its sequence number, for the next transaction of `epoch`.
    fn next_id(&mut self, epoch: i64) -> (Vec<u8>, u64) {
        let chain = self.chain(epoch);
        chain.sent += 1;
        (batch_id(epoch, chain.sent), chain.sent)
    }

    /// Makes `group` one transaction, guarded by the batch sent before it, and sends it.
    /// Answers at once what cannot go: every change when this instance does not lead, one
    /// that would lower a level or that does not fit the table. `None` when nothing goes to
    /// etcd; the group itself, untouched, when this instance leads in another epoch than the
    /// batches in flight (one chain at a time: their ids and guards are of theirs). Spent
    /// flight records ride along with changes; with none, they go alone only to `sweep`.
    fn send(
        &mut self,
        group: Vec<Msg>,
        pipeline: &VecDeque<InFlight>,
        sweep: bool,
    ) -> Result<Option<InFlight>, Vec<Msg>> {
        let term = self.shared.term();
        let guard = self.shared.leading_in(term);
        if let (Some((epoch, _)), Some(last)) = (guard, pipeline.back())
            && epoch != last.epoch
        {
            return Err(group);
        }
        let shared = Arc::clone(&self.shared);
        let not_leader = move || StoreError::Unavailable(not_leading(&shared.standing()));
        // The final state of every key the batch writes, in key order: etcd refuses a
        // transaction that names a key twice.
        let mut writes: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
        let mut msgs = Vec::with_capacity(group.len());
        // The room of the batches in flight, each its own: this batch's new marks fit beside
        // them, and its own room is what it adds.
        let mut room = Room::default();
        for sent in pipeline {
            room.add(&sent.room);
        }
        let in_flight = room.clone();
        // The highest advance of each mark in this batch so far.
        let mut levels: HashMap<Mark, u64> = HashMap::new();
        // The levels this batch creates, each once however many of its changes name it.
        let mut created: HashSet<Mark> = HashSet::new();
        // This batch's flight record: the highest advance of each key and floor in it, and
        // whether it is carried from an older record.
        let mut record: BTreeMap<Mark, (u64, bool)> = BTreeMap::new();
        for msg in group {
            match msg {
                Msg::Answered { batch, term: answered_in } => {
                    // The answer spends the write's entry in its flight record now: etcd hears
                    // of it when the whole record is spent and deleted. An answer from an
                    // earlier term leaves etcd's records alone: a later term may have named the
                    // mark for a write of its own (costing a quarantine at most).
                    if let (Some((epoch, _)), true) = (guard, answered_in == term) {
                        let flights = &mut self.chain(epoch).flights;
                        batch.marks().iter().for_each(|mark| flights.answered(mark));
                    }
                    self.table.apply(&batch);
                }
                Msg::Commit { done, term: checked, .. } if guard.is_none() || checked != term => {
                    let _ = done.send(Err(not_leader()));
                }
                Msg::Commit { batch, done, term: checked } => {
                    let (marks, token, change) = (batch.marks(), batch.token(), batch.change());
                    // Levels only climb here, whatever the caller checked: an advance below a
                    // mark's level, or below an advance of it in flight or earlier in this
                    // batch, is refused (a change whose caller stopped waiting may still be
                    // queued ahead of it).
                    let level = |mark: &Mark| self.table.level(mark.borrowed());
                    let queued = |mark: &Mark| {
                        let in_flight = pipeline.iter().filter_map(|f| f.levels.get(mark).copied()).max();
                        in_flight.max(levels.get(mark).copied())
                    };
                    if change == Change::Advance
                        && marks.iter().any(|m| level(m).max(queued(m)).is_some_and(|l| token < l))
                    {
                        let why = "a higher level of one of its marks was committed or is being committed";
                        let _ = done.send(Err(StoreError::Unavailable(why.into())));
                        continue;
                    }
                    if let (_, Err(e)) = room.take(&self.table, self.max_resources, &batch) {
                        let _ = done.send(Err(e));
                        continue;
                    }
                    if change == Change::Advance {
                        for m in marks {
                            let e = levels.entry(m.clone()).or_insert(token);
                            *e = (*e).max(token);
                        }
                    }
                    // The census counts levels, which are never lost; a binding is not one.
                    let new = |m: &&Mark| {
                        m.kind.is_level() && level(m).is_none() && !pipeline.iter().any(|f| f.created.contains(*m))
                    };
                    created.extend(marks.iter().filter(new).cloned());
                    for mark in marks {
                        if change == Change::Drop {
                            writes.insert(self.names.level(mark.borrowed()), None);
                            continue;
                        }
                        writes.insert(self.names.level(mark.borrowed()), Some(token_value(token)));
                        if change == Change::Advance && mark.kind.is_level() {
                            let entry = record.entry(mark.clone()).or_insert((token, false));
                            entry.0 = entry.0.max(token);
                        }
                    }
                    msgs.push(Msg::Commit { batch, term: checked, done });
                }
                Msg::Close(done) => {
                    let _ = done.send(Ok(()));
                }
            }
        }
        let Some((epoch, _lease)) = guard else {
            // Not leading: answers stay in flight in etcd, which costs the next leader a
            // quarantine at most.
            self.answer(msgs, Err(not_leader()));
            return Ok(None);
        };
        // A transaction for spent records alone is one more for etcd to commit: they wait for
        // the next batch of changes, or for the writer to be idle (`FLIGHT_SWEEP`).
        let changes = msgs.iter().any(|m| matches!(m, Msg::Commit { .. }));
        let (mut ops, mut bytes) = (self.max_ops.saturating_sub(writes.len()), EXTRA_BYTES);
        if !(changes || sweep) {
            ops = 0;
        }
        let names = self.names.clone();
        let flights = &mut self.chain(epoch).flights;
        let deletes = flights.spent(|flight| {
            let size = names.flight(flight).len();
            let fits = ops > 0 && size <= bytes;
            if fits {
                ops -= 1;
                bytes -= size;
            }
            fits
        });
        if changes {
            // Writes still in flight beside answered ones in an old record move to this one,
            // so that the old record goes and a takeover quarantines only what may be in flight.
            for (mark, token) in flights.to_carry(time::Instant::now()) {
                let size = 7 * mark.name.len() + 40;
                if size > bytes {
                    continue;
                }
                bytes -= size;
                record.entry(mark).or_insert((token, true));
            }
        }
        if writes.is_empty() && deletes.is_empty() {
            // Answers only: nothing for etcd yet.
            self.answer(msgs, Ok(()));
            return Ok(None);
        }
        let (id, _) = self.next_id(epoch);
        let record: Vec<Entry> = record.into_iter().map(|(mark, (token, carried))| (mark, token, carried)).collect();
        for flight in &deletes {
            writes.insert(self.names.flight(flight), None);
        }
        if !record.is_empty() {
            let value = flights::encode(record.iter().map(|(mark, token, _)| (mark, *token)));
            writes.insert(self.names.flight_record(&id), Some(value));
        }
        let chain = self.chain(epoch);
        let previous = std::mem::replace(&mut chain.tail, id.clone());
        // Counted from the census the batches in flight leave.
        let census = (!created.is_empty()).then(|| chain.tail_census + created.len() as u64);
        if let Some(count) = census {
            chain.tail_census = count;
        }
        let mut success: Vec<Op> = writes
            .into_iter()
            .map(|(key, value)| match value {
                Some(value) => Op::Put { key, value, lease: 0 },
                None => Op::Delete(key),
            })
            .collect();
        success.push(Op::Put { key: self.names.batch(), value: id.clone(), lease: 0 });
        if let Some(count) = census {
            success.push(Op::Put { key: self.names.census(), value: token_value(count), lease: 0 });
        }
        let compare =
            [Compare::CreateRevision(self.names.leader(), epoch), Compare::Value(self.names.batch(), previous.clone())];
        let failure = [Op::Get(self.names.batch())];
        let client = self.client.clone();
        let answer = tokio::spawn(async move { client.txn(&compare, &success, &failure).await });
        Ok(Some(InFlight {
            epoch,
            term,
            id,
            guard: previous,
            msgs,
            levels,
            created,
            room: room.since(&in_flight),
            census,
            record,
            deletes,
            committed: false,
            started: Instant::now(),
            answer,
        }))
    }

    /// Reads the answer of the first batch in flight, settling it if it is unknown, and acts
    /// on it (module docs); `None` for a batch a barrier found committed, whose own answer is
    /// not waited for. Returns how long the batch took when it committed.
    async fn read(
        &mut self,
        answer: Option<Result<Result<TxnResult, EtcdError>, JoinError>>,
        pipeline: &mut VecDeque<InFlight>,
        queue: &mut VecDeque<Msg>,
    ) -> Option<Duration> {
        let head = pipeline.pop_front()?;
        let took = head.started.elapsed();
        let ended = if head.committed {
            None
        } else {
            match answer {
                Some(Ok(Ok(r))) if r.succeeded => None,
                Some(Ok(Ok(r))) => {
                    let read =
                        r.ranges.first().and_then(Option::as_ref).map(|kv| kv.value.as_slice()).unwrap_or_default();
                    if self.chain(head.epoch).passed(read, &head.guard) {
                        Some(Ended::Overtaken)
                    } else {
                        let why = "the leader key or the batch chain in etcd changed: another instance leads";
                        Some(Ended::Refused(self.lost(head.epoch, why)))
                    }
                }
                Some(Ok(Err(e))) => match refusal(&e) {
                    Some(definite) => Some(Ended::Refused(definite)),
                    None => self.settle(&head, pipeline, &e.to_string()).await.err().map(Ended::Refused),
                },
                Some(Err(e)) => self.settle(&head, pipeline, &e.to_string()).await.err().map(Ended::Refused),
                None => self.settle(&head, pipeline, "its answer was not read").await.err().map(Ended::Refused),
            }
        };
        match ended {
            None => {
                let chain = self.chain(head.epoch);
                chain.flights.committed(&head.id, &head.record, time::Instant::now());
                chain.flights.deleted(&head.deletes);
                chain.last = head.id;
                if let Some(count) = head.census {
                    chain.census = count;
                }
                self.shared.set_full(None);
                let advances = head.msgs.iter().filter(|m| matches!(m, Msg::Commit { .. })).count();
                if let (Some(hook), true) = (&self.on_commit, advances > 0) {
                    hook(head.started.elapsed(), advances);
                }
                self.answer(head.msgs, Ok(()));
                return Some(took);
            }
            Some(Ended::Refused(e)) => {
                self.chain(head.epoch).flights.kept(&head.deletes);
                if let StoreError::NoSpace(why) = &e {
                    self.shared.set_full(Some(why.clone()));
                }
                self.answer(head.msgs, Err(e));
                self.send_again(head.epoch, pipeline, queue);
            }
            Some(Ended::Overtaken) => {
                tracing::debug!(
                    batches = pipeline.len() + 1,
                    "etcd took a batch before the one sent ahead of it: sending them again"
                );
                self.overtaken.fetch_add(1, Ordering::Relaxed);
                pipeline.push_front(head);
                self.send_again(head_epoch(pipeline), pipeline, queue);
            }
        }
        None
    }

    /// Puts every batch in flight back at the front of the queue, in order, to be sent again
    /// under new ids: none of them applied, and none can, since the chain they name was
    /// broken before them. Their answers, when they come, are not read.
    fn send_again(&mut self, epoch: i64, pipeline: &mut VecDeque<InFlight>, queue: &mut VecDeque<Msg>) {
        if pipeline.is_empty() {
            return;
        }
        let dropped: Vec<InFlight> = pipeline.drain(..).collect();
        let chain = self.chain(epoch);
        for f in &dropped {
            chain.flights.kept(&f.deletes);
        }
        let again: Vec<Msg> = dropped.into_iter().flat_map(|f| f.msgs).collect();
        for msg in again.into_iter().rev() {
            queue.push_front(msg);
        }
        let chain = self.chain(epoch);
        chain.tail = chain.last.clone();
        chain.tail_census = chain.census;
    }

    /// Settles `lost`, a batch whose outcome etcd did not tell, with a barrier (module docs):
    /// `Ok` when it committed, and with it every batch in flight up to the one `P/batch` names.
    async fn settle(
        &mut self,
        lost: &InFlight,
        pipeline: &mut VecDeque<InFlight>,
        error: &str,
    ) -> Result<(), StoreError> {
        tracing::warn!(error, "etcd did not answer a batch; settling it with a barrier");
        let epoch = lost.epoch;
        let cancelled = || {
            StoreError::Unavailable(format!(
                "etcd did not answer ({error}); the batch was cancelled and nothing was sent"
            ))
        };
        // The ids of this barrier's tries: each try has a new one, so that a try whose answer
        // is lost too is not taken for the batch, nor for another try.
        let mut tries: Vec<Vec<u8>> = Vec::new();
        loop {
            let (barrier, _) = self.next_id(epoch);
            tries.push(barrier.clone());
            let guard = [
                Compare::CreateRevision(self.names.leader(), epoch),
                Compare::Value(self.names.batch(), lost.guard.clone()),
            ];
            let success = [Op::Put { key: self.names.batch(), value: barrier.clone(), lease: 0 }];
            let failure = [Op::Get(self.names.batch())];
            match self.client.txn(&guard, &success, &failure).await {
                Ok(r) if r.succeeded => {
                    self.chain(epoch).last = barrier;
                    return Err(cancelled());
                }
                Ok(r) => {
                    let read = r.ranges.first().and_then(Option::as_ref).map(|kv| kv.value.clone()).unwrap_or_default();
                    if read == lost.id {
                        tracing::info!("the batch etcd did not answer had committed");
                        return Ok(());
                    }
                    if let Some(n) = pipeline.iter().position(|f| f.id == read) {
                        tracing::info!(
                            batches = n + 2,
                            "the batch etcd did not answer had committed, and those after it"
                        );
                        for f in pipeline.iter_mut().take(n + 1) {
                            f.committed = true;
                        }
                        return Ok(());
                    }
                    if tries.contains(&read) {
                        // An earlier try of this barrier, whose answer was lost, committed.
                        self.chain(epoch).last = read;
                        return Err(cancelled());
                    }
                    let why = "the leader key or the batch chain in etcd changed while a batch was unsettled";
                    return Err(self.lost(epoch, why));
                }
                // Only while this leadership lasts: a definite refusal, or a lease that lapsed,
                // ends it (the writes are refused; a batch that did commit is in etcd for the
                // next takeover).
                Err(e) if refusal(&e).is_none() && self.shared.leading_in(lost.term).is_some() => {
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

    /// Answers every change of a batch with `outcome`, raising the table for what committed;
    /// answered writes reach the table whatever the outcome.
    fn answer(&self, msgs: Vec<Msg>, outcome: Result<(), StoreError>) {
        for msg in msgs {
            match msg {
                Msg::Answered { batch, .. } => self.table.apply(&batch),
                Msg::Commit { batch, done, .. } => {
                    if outcome.is_ok() {
                        self.table.apply(&batch);
                    }
                    let _ = done.send(outcome.clone());
                }
                Msg::Close(done) => {
                    let _ = done.send(Ok(()));
                }
            }
        }
    }
}

/// When the next batch may go while others are in flight: batches in flight are spread over
/// the time one takes (its latency, smoothed, over the window), so that each carries what
/// arrived since the last, and no two leave so close together that etcd takes them in the
/// wrong order (the later one is then refused and sent again). With nothing in flight a batch
/// goes at once.
#[derive(Debug, Default)]
struct Pace {
    /// The smoothed time from a batch's send to its answer.
    latency: Duration,
    last_sent: Option<time::Instant>,
    gap: Duration,
}

impl Pace {
    fn sent(&mut self, at: time::Instant, window: usize) {
        self.last_sent = Some(at);
        self.gap = self.latency / u32::try_from(window.max(1)).unwrap_or(u32::MAX);
    }

    fn answered(&mut self, took: Option<Duration>) {
        if let Some(took) = took {
            // An exponentially weighted average, an eighth for the newest.
            self.latency = if self.latency.is_zero() { took } else { (self.latency * 7 + took) / 8 };
        }
    }

    /// When the next batch may go.
    fn next(&self) -> time::Instant {
        self.last_sent.map_or_else(time::Instant::now, |at| at + self.gap)
    }

    fn allows(&self, now: time::Instant) -> bool {
        now >= self.next()
    }
}

/// The epoch of the first batch in `pipeline` (0 when empty: then nothing is sent again).
fn head_epoch(pipeline: &VecDeque<InFlight>) -> i64 {
    pipeline.front().map_or(0, |f| f.epoch)
}

/// Moves what the channel holds now into `queue`, up to a `Close`, which it keeps in
/// `closing`; `open` becomes false once every sender is gone.
fn take(rx: &mut mpsc::UnboundedReceiver<Msg>, queue: &mut VecDeque<Msg>, closing: &mut Option<Done>, open: &mut bool) {
    loop {
        match rx.try_recv() {
            Ok(Msg::Close(done)) => {
                *closing = Some(done);
                return;
            }
            Ok(msg) => queue.push_back(msg),
            Err(mpsc::error::TryRecvError::Empty) => return,
            Err(mpsc::error::TryRecvError::Disconnected) => {
                *open = false;
                return;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::etcd::lease::Standing;

    #[tokio::test(start_paused = true)]
    async fn batches_in_flight_are_spread_over_one_batchs_latency() {
        let mut pace = Pace::default();
        // Nothing measured yet: no wait.
        pace.sent(time::Instant::now(), 4);
        assert!(pace.allows(time::Instant::now()));
        pace.answered(Some(Duration::from_millis(8)));
        pace.answered(None); // a batch that did not commit says nothing of the latency
        let start = time::Instant::now();
        pace.sent(start, 4);
        assert_eq!(pace.next(), start + Duration::from_millis(2));
        time::advance(Duration::from_millis(1)).await;
        assert!(!pace.allows(time::Instant::now()));
        time::advance(Duration::from_millis(1)).await;
        assert!(pace.allows(time::Instant::now()));
        // The newest answer moves the average by an eighth of the difference.
        pace.answered(Some(Duration::from_millis(16)));
        assert_eq!(pace.latency, Duration::from_millis(9));
    }

    /// A writer whose instance leads in epoch 2 while a batch of epoch 1 is still in flight
    /// (a step down and a new takeover came between the writer's look at the epoch and its
    /// send): the group waits, whole and unanswered, instead of starting epoch 2's chain
    /// beside epoch 1's, which would replace the one chain the writer keeps and reuse ids.
    #[tokio::test]
    async fn a_group_is_not_sent_in_another_epoch_than_the_batches_in_flight() {
        let client = Client::new(&["http://127.0.0.1:9".to_owned()], Duration::from_secs(1));
        let shared = Arc::new(Shared::new(Duration::ZERO));
        shared.acknowledged(shared.now(), Duration::from_secs(60));
        shared.set(Standing::Leading { epoch: 2, lease: 7 });
        let mut writer = EtcdWriter::new(client, Names::new("/p/"), Arc::clone(&shared), Arc::new(Table::new()));
        let old = InFlight {
            epoch: 1,
            term: shared.term() - 1,
            id: batch_id(1, 1),
            guard: b"start".to_vec(),
            msgs: Vec::new(),
            levels: HashMap::new(),
            created: HashSet::new(),
            room: Room::default(),
            census: None,
            record: Vec::new(),
            deletes: Vec::new(),
            committed: false,
            started: Instant::now(),
            answer: tokio::spawn(std::future::pending()),
        };
        let pipeline = VecDeque::from([old]);
        let (done, mut answered) = oneshot::channel();
        let batch = MarkBatch::advance([Mark::key("/a")], 5);
        let group = vec![Msg::Commit { batch, term: shared.term(), done }];
        let kept = writer.send(group, &pipeline, false).err().expect("not sent in epoch 2");
        assert_eq!(kept.len(), 1);
        assert!(
            matches!(answered.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
            "the change waits for its batch"
        );
        assert!(writer.chain.is_none(), "no chain of epoch 2 yet");
    }
}
