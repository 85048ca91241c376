//! Pipelined batches of the shared fence's leader (docs/cluster.md, "Batches in flight"),
//! model-checked with stateright: several guarded transactions in flight to etcd at once,
//! etcd applying them in any order, answers lost, a barrier settling every unknown outcome,
//! and a crash of the leader followed by a takeover.
//!
//! The leader's writer gathers queued advances into a batch and sends it as one transaction,
//! `If(leader key's epoch, P/batch == guard) Then(levels, the batch's flight record, deletes of
//! spent records, P/batch = id)`, with up to `window` batches in flight. Each batch's guard is the id of the batch sent before
//! it, so that etcd can apply a batch only after every earlier one (the chain). The writer reads
//! the outcomes in the order it sent the batches:
//! - committed: the table is raised and the batch's writes may go to the backend;
//! - the compare failed and `P/batch` held an earlier id of this leader's own chain: etcd took the
//!   batch before its predecessor (it orders concurrent requests as it likes). The batch did not
//!   apply, and no later one can (each names an id that will never be written): all of them are
//!   sent again under new ids;
//! - the compare failed otherwise: another leader moved the chain on; this one steps down;
//! - unknown (the answer was lost; the transaction may still apply): a barrier,
//!   `If(epoch, P/batch == the id before the lost batch) Then(P/batch = barrier)`. If it commits,
//!   the lost batch and all after it can never apply: the lost batch's writes are refused, the
//!   later ones sent again. If its compare fails, `P/batch` names how far the chain got: every
//!   batch up to the one it names committed (settling walks the chain).
//!
//! etcd keeps the leader key (an epoch), `P/batch`, each resource's level, and a flight record
//! per batch: the resources it advanced and their tokens, the writes it let go. A record stays
//! until none of its writes is still in flight: each resource's newest record is the one that
//! counts, so a record's entry is spent when the backend answers that write or when a later
//! committed record names the resource. The writer counts each record's live entries and deletes
//! a spent record in a later batch. A crashed leader's transactions stay on their way to etcd
//! and its writes on their way to the backend; the next leader takes over with a new epoch (the
//! old lease expired), reads the table and the records, and keeps each resource a record names
//! closed until the old leader's writes to it have landed (the quarantine's time bound, as in
//! `pin_model`). A write's turn is its resource's from its check until the backend answered, so
//! a resource's answer (which spends its entry) and its next write's advance can be in two
//! batches in flight at once. A caller may also stop waiting for its advance (the store's
//! answer did not come in time): its write is refused and its turn ends, but the advance stays
//! queued or in flight and may still commit, so the writer refuses an advance below its mark's
//! level in the table, in a batch in flight or earlier in its own batch.
//!
//! The properties: per resource the backend applies tokens in strictly increasing order, a
//! level in etcd never goes down, and a write reaches the network only with its advance in
//! etcd. The variants that must fail: batches guarded by the epoch alone (etcd applies a batch
//! after a barrier cancelled it, and a level goes down), a writer that deletes a record once
//! one of its writes is answered (a takeover misses another write of the batch still on its
//! way, and a newer write overtakes it), and a barrier that takes a later id of its own chain for an earlier
//! try of itself instead of walking the chain (a committed batch is refused, its level unknown
//! to the table, and a lower token lowers etcd's level); and a writer that checks an advance
//! against the table and its own batch only (the advance of a caller that stopped waiting is
//! in flight, and a lower one checked against the table follows it into etcd).

use std::time::{Duration, Instant};

use stateright::{Checker, Model, Property};

const ORDER: &str = "the backend applies each resource's writes in token order";
const CLIMBS: &str = "a level in etcd never goes down";
const DURABLE: &str = "a write is sent only with its advance in etcd";
const RESENT: &str = "etcd takes a batch before its predecessor, and it is sent again";
const WALKED: &str = "a barrier finds the chain past the lost batch";
const UNRECORDED: &str = "a spent flight record is deleted";
const CARRIED: &str = "a record names a write in flight that an older one named";

/// A transaction's id in `P/batch`: (epoch, sequence). `(0, 0)` is what `init` wrote.
type Id = (u8, u8);

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Msg {
    Advance { r: usize, token: u8 },
}

#[derive(Clone, Copy, Debug, Default, Hash, PartialEq, Eq)]
enum Outcome {
    /// No answer read yet.
    #[default]
    Pending,
    Committed,
    /// The compare failed; `P/batch` held this.
    Failed(Id),
    /// The answer is lost: the transaction may apply, now or later.
    Unknown,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Stage {
    /// Its advance is queued or in a batch in flight.
    Queued,
    /// Its batch committed: it may go.
    Ready,
    Sent,
    Delivered,
}

/// A transaction's operation.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Op {
    Level(usize, u8),
    /// A batch's flight record: the resources it advanced, with their tokens.
    Record(Id, Vec<(usize, u8)>),
    Unrecord(Id),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Txn {
    epoch: u8,
    /// The `P/batch` compare; `None` for the variant guarded by the epoch alone.
    guard: Option<Id>,
    id: Id,
    ops: Vec<Op>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Batch {
    id: Id,
    guard: Id,
    msgs: Vec<Msg>,
    /// Writes in flight its record names again, from older records (`flights::to_carry`).
    carried: Vec<(usize, u8)>,
    /// The spent records it deletes.
    deletes: Vec<Id>,
    outcome: Outcome,
}

/// What the writer knows of a flight record in etcd.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Rec {
    id: Id,
    /// Its entries still in flight: resources whose newest record it is, not yet answered.
    live: u8,
    /// Its entries.
    named: u8,
    /// A batch in flight deletes it.
    deleting: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Leader {
    epoch: u8,
    /// The last sequence used in this epoch.
    seq: u8,
    /// `P/batch` as the takeover read it.
    start: Id,
    /// `P/batch` after the last batch known to have committed.
    committed: Id,
    /// The id of the last batch sent: the next one's guard.
    tail: Id,
    table: Vec<Option<u8>>,
    /// Closed until the previous leader's writes to it have landed.
    quarantined: Vec<bool>,
    busy: Vec<Option<(u8, Stage)>>,
    /// Per resource, the newest record that names it while its write is in flight, and the
    /// token it names.
    flying: Vec<Option<(Id, u8)>>,
    records: Vec<Rec>,
    queue: Vec<Msg>,
    /// Batches in flight, in the order sent.
    pipeline: Vec<Batch>,
    /// The barrier settling the first batch's unknown outcome.
    barrier: Option<Barrier>,
}

/// The tries of a barrier, each with an id of its own, and the last one's outcome.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
struct Barrier {
    tries: Vec<Id>,
    outcome: Outcome,
}

impl Leader {
    /// Whether `read` is an id this leader's chain passed before reaching `guard`: the takeover's,
    /// or an earlier one of its own epoch.
    fn before(&self, read: Id, guard: Id) -> bool {
        read != guard && (read == self.start || guard.0 == self.epoch && read.0 == self.epoch && read.1 < guard.1)
    }

    /// A barrier try `id` committed: the lost first batch can never apply, nor any after it.
    /// Its writes are refused (nothing was sent), the later batches sent again.
    fn cancel(&mut self, id: Id) {
        self.barrier = None;
        self.committed = id;
        let lost = self.pipeline.remove(0);
        self.undelete(&lost.deletes);
        for Msg::Advance { r, token } in lost.msgs {
            if self.busy[r] == Some((token, Stage::Queued)) {
                self.busy[r] = None;
            }
        }
        self.resend_from(0);
    }

    fn new_id(&mut self) -> Id {
        self.seq += 1;
        (self.epoch, self.seq)
    }

    /// Every batch from the `from`th on goes back to the front of the queue, in order: none of
    /// them applied, and none can.
    fn resend_from(&mut self, from: usize) {
        let dropped: Vec<Batch> = self.pipeline.drain(from..).collect();
        for b in &dropped {
            self.undelete(&b.deletes);
        }
        let mut msgs: Vec<Msg> = dropped.into_iter().flat_map(|b| b.msgs).collect();
        msgs.append(&mut self.queue);
        self.queue = msgs;
        self.tail = self.committed;
    }

    /// Deletes of `ids` that did not apply: the records are deleted by a later batch.
    fn undelete(&mut self, ids: &[Id]) {
        for r in self.records.iter_mut().filter(|r| ids.contains(&r.id)) {
            r.deleting = false;
        }
    }

    /// One entry of record `id` is spent.
    fn spend(&mut self, id: Id) {
        if let Some(r) = self.records.iter_mut().find(|r| r.id == id) {
            r.live = r.live.saturating_sub(1);
        }
    }

    /// Writes in flight whose newest record also names spent entries.
    fn carryable(&self) -> Vec<(usize, u8)> {
        let stale = |id: Id| self.records.iter().any(|rec| rec.id == id && rec.live < rec.named);
        self.flying
            .iter()
            .enumerate()
            .filter_map(|(r, f)| f.filter(|(id, _)| stale(*id)).map(|(_, t)| (r, t)))
            .collect()
    }

    /// Records with no entry in flight that no batch deletes yet.
    fn spent(&self) -> impl Iterator<Item = Id> + '_ {
        self.records.iter().filter(|r| r.live == 0 && !r.deleting).map(|r| r.id)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    /// etcd: the leader key's epoch, `P/batch`, levels and flight records (in id order).
    epoch: u8,
    batch: Id,
    level: Vec<Option<u8>>,
    records: Vec<(Id, Vec<(usize, u8)>)>,
    /// Transactions on their way to etcd, applied in any order.
    to_etcd: Vec<Txn>,
    leader: Option<Leader>,
    /// Client writes not yet checked: (resource, token).
    pending: Vec<(usize, u8)>,
    /// Writes on their way to the backend: (resource, token, sender's epoch).
    network: Vec<(usize, u8, u8)>,
    applied: Vec<Vec<u8>>,
    crashes: u8,
    forgets: u8,
    lost_answers: u8,
    /// Callers that may still stop waiting for their advance.
    abandons: u8,
    lowered: bool,
    sent_uncommitted: bool,
    seen: Seen,
}

/// The paths the checker must reach, or it proves nothing about them.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
struct Seen {
    /// etcd took a batch before its predecessor, and it was sent again.
    resent: bool,
    /// A barrier found the chain past the lost batch and walked it.
    walked: bool,
    /// A batch deleted a spent flight record.
    unrecorded: bool,
    /// A batch's record named a write in flight that an older record named.
    carried: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Action {
    Check(usize),
    /// The caller of resource `r`'s queued advance stops waiting (the store's answer did not
    /// come in time): the write is refused and its turn ends, but the advance stays queued or
    /// in flight and may still commit.
    Abandon(usize),
    /// Sends the queued advances as a batch; with `true`, its record also names every write
    /// still in flight in a record beside spent entries (the code does so after a second).
    Flush(bool),
    /// The turn of resource `r`'s delivered write ends without its answer noted: an unknown
    /// outcome, or a pinned write that passed a quarantine. Its entry stays in flight.
    Forget(usize),
    Apply(usize),
    LoseAnswer,
    Read,
    Send(usize),
    Deliver(usize),
    Answer(usize),
    Lift(usize),
    Crash,
    Campaign,
}

struct Pipeline {
    resources: usize,
    writes: Vec<(usize, u8)>,
    /// Batches in flight at most.
    window: usize,
    /// Each batch's guard names its predecessor's id.
    chained: bool,
    /// A barrier that fails on a later id of this leader's chain walks the chain to it.
    walk: bool,
    /// Answers etcd may lose.
    lost_answers: u8,
    /// Callers that may stop waiting for their advance.
    abandons: u8,
    /// The writer refuses an advance below a level of its mark in a batch in flight, not only
    /// below the table's and the batch's own (`batch::EtcdWriter::send`).
    climb_in_flight: bool,
    /// A record is deleted once every write it names is spent, not once the first is answered.
    count_live: bool,
    /// Leader crashes.
    crashes: u8,
    /// Turns that may end without their answer noted.
    forgets: u8,
    /// Batches may carry writes in flight from older records.
    carry: bool,
    /// A carrying batch's record names the writes it carries (not only the writer's memory).
    carry_names: bool,
}

impl Pipeline {
    fn takeover(&self, s: &State) -> Leader {
        // Each resource's newest record; a record whose entries are all newer elsewhere is
        // spent already.
        let mut flying = vec![None; self.resources];
        for (id, entries) in &s.records {
            for &(r, token) in entries {
                flying[r] = Some((*id, token));
            }
        }
        let records = s
            .records
            .iter()
            .map(|(id, entries)| Rec {
                id: *id,
                live: flying.iter().flatten().filter(|(f, _)| f == id).count() as u8,
                named: entries.len() as u8,
                deleting: false,
            })
            .collect();
        Leader {
            epoch: s.epoch,
            seq: 0,
            start: s.batch,
            committed: s.batch,
            tail: s.batch,
            table: s.level.clone(),
            quarantined: flying.iter().map(Option::is_some).collect(),
            busy: vec![None; self.resources],
            flying,
            records,
            queue: Vec::new(),
            pipeline: Vec::new(),
            barrier: None,
        }
    }

    /// Reads the first batch's outcome, or settles it; `None` when there is nothing to read.
    fn read(&self, s: &mut State) -> Option<()> {
        let l = s.leader.as_mut()?;
        let head = l.pipeline.first()?.clone();
        match head.outcome {
            Outcome::Pending => return None,
            Outcome::Committed => {
                l.pipeline.remove(0);
                l.committed = head.id;
                l.records.retain(|r| !head.deletes.contains(&r.id));
                let mut live = 0;
                let mut named: Vec<usize> = Vec::new();
                for m in head.msgs {
                    let Msg::Advance { r, token } = m;
                    l.table[r] = Some(token);
                    if l.busy[r] == Some((token, Stage::Queued)) {
                        l.busy[r] = Some((token, Stage::Ready));
                    }
                    if !named.contains(&r) {
                        named.push(r);
                    }
                    // This batch's record is now the resource's newest: the older one's entry
                    // is spent.
                    match l.flying[r].replace((head.id, token)) {
                        Some((old, _)) if old == head.id => continue,
                        Some((old, _)) => l.spend(old),
                        None => {}
                    }
                    live += 1;
                }
                // A carried write still in flight is named by this record now; one answered
                // since is not.
                for &(r, token) in &head.carried {
                    named.push(r);
                    if let Some((old, t)) = l.flying[r]
                        && t == token
                        && old != head.id
                    {
                        l.flying[r] = Some((head.id, token));
                        l.spend(old);
                        live += 1;
                        s.seen.carried = true;
                    }
                }
                if !named.is_empty() {
                    l.records.push(Rec { id: head.id, live, named: named.len() as u8, deleting: false });
                }
            }
            Outcome::Failed(read) if l.before(read, head.guard) => {
                // etcd took it before its predecessor, which committed since.
                l.resend_from(0);
                s.seen.resent = true;
            }
            Outcome::Failed(_) => s.leader = None,
            Outcome::Unknown => {
                let Barrier { tries, outcome } = l.barrier.clone().unwrap_or_default();
                match outcome {
                    Outcome::Pending if !tries.is_empty() => return None,
                    // The first try, or another after a try's answer was lost: a new id, so
                    // that finding it in `P/batch` proves that very try committed.
                    Outcome::Pending | Outcome::Unknown => {
                        let id = l.new_id();
                        let mut tries = tries;
                        tries.push(id);
                        l.barrier = Some(Barrier { tries, outcome: Outcome::Pending });
                        let guard = Some(l.committed);
                        s.to_etcd.push(Txn { epoch: l.epoch, guard, id, ops: Vec::new() });
                    }
                    Outcome::Committed => l.cancel(*tries.last()?),
                    Outcome::Failed(read) if tries.contains(&read) => {
                        // An earlier try whose answer was lost committed.
                        l.cancel(read);
                    }
                    Outcome::Failed(read) => match l.pipeline.iter().position(|b| b.id == read) {
                        Some(n) if self.walk || n == 0 => {
                            // The chain got as far as the nth batch: it and all before it
                            // committed.
                            l.barrier = None;
                            for b in &mut l.pipeline[..=n] {
                                b.outcome = Outcome::Committed;
                            }
                            s.seen.walked |= n > 0;
                        }
                        // Taken for an earlier try of the barrier.
                        Some(_) => l.cancel(read),
                        None => s.leader = None,
                    },
                }
            }
        }
        Some(())
    }
}

impl Model for Pipeline {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let mut s = State {
            epoch: 1,
            batch: (0, 0),
            level: vec![None; self.resources],
            records: Vec::new(),
            to_etcd: Vec::new(),
            leader: None,
            pending: self.writes.clone(),
            network: Vec::new(),
            applied: vec![Vec::new(); self.resources],
            crashes: self.crashes,
            forgets: self.forgets,
            lost_answers: self.lost_answers,
            abandons: self.abandons,
            lowered: false,
            sent_uncommitted: false,
            seen: Seen::default(),
        };
        s.leader = Some(self.takeover(&s));
        vec![s]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        actions.extend((0..s.to_etcd.len()).map(Action::Apply));
        actions.extend((0..s.network.len()).map(Action::Deliver));
        let Some(l) = &s.leader else {
            actions.push(Action::Campaign);
            return;
        };
        if s.crashes > 0 {
            actions.push(Action::Crash);
        }
        for (w, &(r, _)) in s.pending.iter().enumerate() {
            if l.busy[r].is_none() && !l.quarantined[r] {
                actions.push(Action::Check(w));
            }
        }
        let settling = l.pipeline.iter().any(|b| b.outcome == Outcome::Unknown);
        let work = !l.queue.is_empty() || l.spent().next().is_some();
        if work && l.pipeline.len() < self.window && !settling {
            actions.push(Action::Flush(false));
            if self.carry && !l.carryable().is_empty() {
                actions.push(Action::Flush(true));
            }
        }
        if let Some(head) = l.pipeline.first() {
            if head.outcome != Outcome::Pending {
                actions.push(Action::Read);
            }
            let barrier = l.barrier.as_ref().map(|b| b.outcome);
            if s.lost_answers > 0
                && (head.outcome != Outcome::Unknown || barrier.is_some_and(|o| o != Outcome::Unknown))
            {
                actions.push(Action::LoseAnswer);
            }
        }
        for r in 0..self.resources {
            match l.busy[r] {
                Some((_, Stage::Queued)) if s.abandons > 0 => actions.push(Action::Abandon(r)),
                Some((_, Stage::Ready)) => actions.push(Action::Send(r)),
                Some((_, Stage::Delivered)) => {
                    actions.push(Action::Answer(r));
                    if s.forgets > 0 {
                        actions.push(Action::Forget(r));
                    }
                }
                _ => {}
            }
            if l.quarantined[r] && !s.network.iter().any(|&(n, _, e)| n == r && e < l.epoch) {
                actions.push(Action::Lift(r));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Check(w) => {
                let (r, token) = s.pending.remove(w);
                let l = s.leader.as_mut()?;
                if l.table[r].is_none_or(|m| m < token) {
                    l.busy[r] = Some((token, Stage::Queued));
                    l.queue.push(Msg::Advance { r, token });
                }
            }
            Action::Flush(carry) => {
                let l = s.leader.as_mut()?;
                let mut msgs = std::mem::take(&mut l.queue);
                // Levels only climb in the writer: an advance below its mark's level in the
                // table, in a batch in flight, or earlier in this batch is refused.
                let mut levels: Vec<Option<u8>> = l.table.clone();
                if self.climb_in_flight {
                    for &Msg::Advance { r, token } in l.pipeline.iter().flat_map(|b| &b.msgs) {
                        levels[r] = levels[r].max(Some(token));
                    }
                }
                let busy = &mut l.busy;
                msgs.retain(|m| match *m {
                    Msg::Advance { r, token } if levels[r].is_some_and(|l| token < l) => {
                        if busy[r] == Some((token, Stage::Queued)) {
                            busy[r] = None;
                        }
                        false
                    }
                    Msg::Advance { r, token } => {
                        levels[r] = levels[r].max(Some(token));
                        true
                    }
                });
                // One operation per key: etcd refuses a transaction naming one twice.
                let mut entries: Vec<(usize, u8)> = Vec::new();
                for &Msg::Advance { r, token } in &msgs {
                    match entries.iter_mut().find(|(n, _)| *n == r) {
                        Some(e) => e.1 = e.1.max(token),
                        None => entries.push((r, token)),
                    }
                }
                let id = l.new_id();
                let mut ops: Vec<Op> = entries.iter().map(|&(r, token)| Op::Level(r, token)).collect();
                let carried: Vec<(usize, u8)> = if carry {
                    l.carryable().into_iter().filter(|(r, _)| !entries.iter().any(|(n, _)| n == r)).collect()
                } else {
                    Vec::new()
                };
                if self.carry_names {
                    entries.extend(carried.iter().copied());
                }
                if !entries.is_empty() {
                    ops.push(Op::Record(id, entries));
                }
                let deletes: Vec<Id> = l.spent().collect();
                for r in l.records.iter_mut().filter(|r| deletes.contains(&r.id)) {
                    r.deleting = true;
                }
                ops.extend(deletes.iter().map(|&d| Op::Unrecord(d)));
                let guard = l.tail;
                l.tail = id;
                l.pipeline.push(Batch { id, guard, msgs, carried, deletes, outcome: Outcome::Pending });
                let guard = self.chained.then_some(guard);
                s.to_etcd.push(Txn { epoch: l.epoch, guard, id, ops });
            }
            Action::Apply(k) => {
                let txn = s.to_etcd.remove(k);
                let holds = s.epoch == txn.epoch && txn.guard.is_none_or(|g| g == s.batch);
                if holds {
                    for op in &txn.ops {
                        match op {
                            Op::Level(r, token) => {
                                s.lowered |= Some(*token) < s.level[*r];
                                s.level[*r] = Some(*token);
                            }
                            Op::Record(id, entries) => {
                                s.records.push((*id, entries.clone()));
                                s.records.sort();
                            }
                            Op::Unrecord(id) => {
                                s.records.retain(|(r, _)| r != id);
                                s.seen.unrecorded = true;
                            }
                        }
                    }
                    s.batch = txn.id;
                }
                let outcome = if holds { Outcome::Committed } else { Outcome::Failed(s.batch) };
                if let Some(l) = s.leader.as_mut().filter(|l| l.epoch == txn.epoch) {
                    let mine = l.pipeline.iter_mut().map(|b| (b.id, &mut b.outcome));
                    let barrier = l.barrier.as_mut().and_then(|b| Some((*b.tries.last()?, &mut b.outcome)));
                    if let Some((_, o)) = mine.chain(barrier).find(|(id, _)| *id == txn.id)
                        && *o == Outcome::Pending
                    {
                        *o = outcome;
                    }
                }
            }
            Action::LoseAnswer => {
                s.lost_answers -= 1;
                let l = s.leader.as_mut()?;
                match &mut l.barrier {
                    Some(b) if !b.tries.is_empty() => b.outcome = Outcome::Unknown,
                    _ => l.pipeline.first_mut()?.outcome = Outcome::Unknown,
                }
            }
            Action::Read => self.read(&mut s)?,
            Action::Abandon(r) => {
                s.abandons -= 1;
                s.leader.as_mut()?.busy[r] = None;
            }
            Action::Send(r) => {
                let l = s.leader.as_mut()?;
                let (token, _) = l.busy[r]?;
                l.busy[r] = Some((token, Stage::Sent));
                s.sent_uncommitted |= s.level[r].is_none_or(|m| m < token);
                s.network.push((r, token, l.epoch));
            }
            Action::Deliver(k) => {
                let (r, token, epoch) = s.network.remove(k);
                s.applied[r].push(token);
                if let Some(l) = s.leader.as_mut().filter(|l| l.epoch == epoch)
                    && l.busy[r] == Some((token, Stage::Sent))
                {
                    l.busy[r] = Some((token, Stage::Delivered));
                }
            }
            Action::Answer(r) => {
                // The answer spends the write's entry in its record at once: nothing goes to etcd
                // for it until the record is spent whole.
                let l = s.leader.as_mut()?;
                l.busy[r].take()?;
                if let Some((id, _)) = l.flying[r].take() {
                    if self.count_live {
                        l.spend(id);
                    } else if let Some(rec) = l.records.iter_mut().find(|rec| rec.id == id) {
                        rec.live = 0;
                    }
                }
            }
            Action::Forget(r) => {
                s.forgets -= 1;
                s.leader.as_mut()?.busy[r].take()?;
            }
            Action::Lift(r) => s.leader.as_mut()?.quarantined[r] = false,
            Action::Crash => {
                s.crashes -= 1;
                s.leader = None;
            }
            Action::Campaign => {
                // The old lease expired and the leader key was put again: a new epoch.
                s.epoch += 1;
                s.leader = Some(self.takeover(&s));
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::<Self>::always(ORDER, |_, s| s.applied.iter().all(|t| t.windows(2).all(|w| w[0] < w[1]))),
            Property::<Self>::always(CLIMBS, |_, s| !s.lowered),
            Property::<Self>::always(DURABLE, |_, s| !s.sent_uncommitted),
            Property::<Self>::sometimes(RESENT, |m, s| m.window < 2 || s.seen.resent),
            Property::<Self>::sometimes(WALKED, |m, s| m.window < 2 || m.lost_answers == 0 || s.seen.walked),
            Property::<Self>::sometimes(UNRECORDED, |_, s| s.seen.unrecorded),
            Property::<Self>::sometimes(CARRIED, |m, s| !m.carry || s.seen.carried),
        ]
    }
}

fn check(model: Pipeline) -> (impl Checker<Pipeline>, Duration) {
    let started = Instant::now();
    let checker = model.checker().spawn_bfs().join();
    (checker, started.elapsed())
}

fn model(resources: usize, writes: &[(usize, u8)], window: usize) -> Pipeline {
    Pipeline {
        resources,
        writes: writes.to_vec(),
        window,
        chained: true,
        walk: true,
        lost_answers: 1,
        abandons: 0,
        climb_in_flight: true,
        count_live: true,
        crashes: 1,
        forgets: 0,
        carry: false,
        carry_names: true,
    }
}

fn holds(m: Pipeline) {
    let label = format!("{} resource(s), writes {:?}, {} in flight", m.resources, m.writes, m.window);
    let (checker, took) = check(m);
    eprintln!("{label}: {} states in {took:?}", checker.unique_state_count());
    checker.assert_properties();
}

/// The safety properties `m` breaks, each with the steps of one way to break it.
fn broken(m: Pipeline) -> Vec<(&'static str, Vec<Action>)> {
    let (checker, _) = check(m);
    let found: Vec<_> = [ORDER, CLIMBS, DURABLE]
        .into_iter()
        .filter_map(|name| Some((name, checker.discovery(name)?.into_actions())))
        .collect();
    for (name, actions) in &found {
        eprintln!("{name}: {actions:?}");
    }
    found
}

// Separate tests, so that they run side by side.
#[test]
fn pipelined_batches_keep_one_resources_order_through_reordering_a_lost_answer_and_a_crash() {
    holds(model(1, &[(0, 1), (0, 2), (0, 3)], 2));
}

#[test]
fn pipelined_batches_keep_every_level_climbing_across_two_resources() {
    holds(model(2, &[(0, 2), (1, 3), (0, 1)], 2));
}

#[test]
fn three_batches_in_flight_keep_the_order_of_writes_to_two_resources() {
    holds(model(2, &[(0, 1), (1, 2), (0, 3)], 3));
}

#[test]
fn a_barrier_whose_own_answer_is_lost_tries_again_and_keeps_the_order() {
    holds(Pipeline { lost_answers: 2, ..model(1, &[(0, 1), (0, 2), (0, 3)], 2) });
}

#[test]
fn a_batch_guarded_by_the_epoch_alone_escapes_its_barrier_and_applies_late() {
    let broken = broken(Pipeline { chained: false, ..model(1, &[(0, 1), (0, 2)], 2) });
    let (_, actions) = broken.iter().find(|(name, _)| *name == CLIMBS).expect("a level goes down");
    assert!(actions.contains(&Action::LoseAnswer), "{actions:?}");
}

#[test]
fn a_barrier_that_does_not_walk_the_chain_refuses_a_committed_batch_and_a_level_goes_down() {
    let broken = broken(Pipeline { walk: false, ..model(2, &[(0, 2), (1, 3), (0, 1)], 2) });
    let (_, actions) = broken.iter().find(|(name, _)| *name == CLIMBS).expect("a level goes down");
    assert!(actions.contains(&Action::LoseAnswer), "{actions:?}");
}

#[test]
fn an_abandoned_advance_in_flight_keeps_a_lower_one_out() {
    holds(Pipeline { abandons: 1, ..model(1, &[(0, 3), (0, 2), (0, 4)], 2) });
}

#[test]
fn a_writer_that_checks_only_the_table_lets_a_lower_advance_follow_an_abandoned_one() {
    let m = Pipeline { abandons: 1, lost_answers: 0, climb_in_flight: false, ..model(1, &[(0, 3), (0, 2)], 2) };
    let broken = broken(m);
    let (_, actions) = broken.iter().find(|(name, _)| *name == CLIMBS).expect("a level goes down");
    assert!(actions.contains(&Action::Abandon(0)), "{actions:?}");
}

#[test]
fn a_record_deleted_once_one_of_its_writes_is_answered_lets_a_takeover_overtake_another() {
    let m = Pipeline { count_live: false, lost_answers: 0, ..model(2, &[(0, 1), (1, 2), (1, 3)], 2) };
    let broken = broken(m);
    let (_, actions) = broken.iter().find(|(name, _)| *name == ORDER).expect("the order breaks");
    assert!(actions.contains(&Action::Campaign), "{actions:?}");
}

#[test]
fn records_keep_the_order_of_two_resources_advanced_in_one_batch_through_a_crash() {
    holds(model(2, &[(0, 1), (1, 2), (1, 3)], 2));
}

#[test]
fn records_carry_a_forgotten_write_through_two_crashes() {
    let writes = [(0, 1), (1, 2), (0, 3), (1, 4)];
    holds(Pipeline { crashes: 2, forgets: 1, carry: true, lost_answers: 0, ..model(2, &writes, 1) });
}

#[test]
fn batches_guarded_by_the_epoch_alone_keep_the_order_while_no_answer_is_lost() {
    let unchained = Pipeline { chained: false, lost_answers: 0, ..model(1, &[(0, 1), (0, 2), (0, 3)], 2) };
    assert!(broken(unchained).is_empty(), "records do not depend on the order of batches in flight");
}

#[test]
fn a_carry_that_spends_the_old_record_without_naming_the_write_lets_a_takeover_overtake_it() {
    let m = Pipeline {
        forgets: 1,
        carry: true,
        carry_names: false,
        lost_answers: 0,
        ..model(2, &[(0, 1), (1, 2), (0, 3), (1, 4)], 1)
    };
    let broken = broken(m);
    let (_, actions) = broken.iter().find(|(name, _)| *name == ORDER).expect("the order breaks");
    assert!(actions.contains(&Action::Flush(true)), "{actions:?}");
}
