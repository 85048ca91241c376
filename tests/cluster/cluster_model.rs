//! The cluster protocol of docs/cluster.md, model-checked with stateright: several fencegate
//! instances, one leader at a time elected through an etcd lease, writes committed to etcd
//! under the leader's epoch before they are forwarded, and the self-fence check that keeps a
//! leader that paused past its lease from sending.
//!
//! Time is discrete and shared (no clock drift: drift goes into the margin, docs/cluster.md).
//! A write at the leader is separate steps: commit (one etcd transaction guarded by the
//! leader's epoch and live lease), the lease check, the send, the backend's receipt, and the
//! answer. The backend's applied order is the property: per resource, strictly increasing
//! tokens. Faults: one crash and one pause of any length anywhere, save between the last check
//! and the bytes leaving (the window docs/cluster.md bounds), and messages in the network for
//! at most `DELIVERY` ticks.
//!
//! A keep-alive is two steps, its send (etcd renews the lease) and its acknowledgement (the
//! instance moves `lease_until`), with a pause possible between them: counting the lease from
//! the send holds, counting it from the acknowledgement does not.
//!
//! The same model without the self-fence check must break the property: the checker has to
//! find the zombie leader that wakes after its lease and sends; so must one without the
//! quarantine, and one that counts the lease from the acknowledgement.

use std::time::{Duration, Instant};

use stateright::{Checker, Model, Property};

/// Instances.
const N: usize = 2;
/// The leader's lease in ticks: etcd expires it this long after the last renewal.
const TTL: u8 = 2;
/// The self-fence margin: a leader trusts its lease until TTL - MARGIN after the renewal's send.
const MARGIN: u8 = 0;
/// A new leader keeps a resource with a write in flight closed this long (fence.quarantine):
/// longer than a message can be on the way.
const QUARANTINE: u8 = 1;
/// Longest a message to the backend is on the way.
const DELIVERY: u8 = 1;
/// Time runs to here.
const HORIZON: u8 = 5;

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Stage {
    /// Committed in etcd, not checked yet.
    Committed,
    /// The lease check passed: the bytes leave before time moves (the bounded window).
    Checked,
    /// On its way to the backend.
    Sent,
    /// The backend has it and answered.
    Delivered,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Instance {
    up: bool,
    paused: bool,
    /// The epoch it leads, as it believes.
    leading: Option<u8>,
    /// It trusts its lease until here (last renewal's send + TTL - MARGIN).
    lease_until: u8,
    /// Its table: `max_seen` per resource.
    max_seen: Vec<Option<u8>>,
    quarantined_until: Vec<u8>,
    /// The write in flight per resource: its token and stage.
    busy: Vec<Option<(u8, Stage)>>,
    /// A keep-alive etcd took, whose answer the instance has not read yet: its send time.
    renewal_sent: Option<u8>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    now: u8,
    /// etcd: the leader key (instance, epoch), each instance's lease expiry, the committed
    /// `max_seen` and in-flight markers.
    leader: Option<(usize, u8)>,
    lease_expiry: [u8; N],
    epochs: u8,
    etcd_max_seen: Vec<Option<u8>>,
    etcd_in_flight: Vec<Option<u8>>,
    instances: [Instance; N],
    /// Client writes not yet taken: (resource, token).
    pending: Vec<(usize, u8)>,
    /// To the backend: (resource, token, sender, sent at).
    network: Vec<(usize, u8, usize, u8)>,
    applied: Vec<Vec<u8>>,
    crashes: u8,
    pauses: u8,
}

impl State {
    fn leader_alive(&self) -> Option<(usize, u8)> {
        self.leader.filter(|(i, _)| self.now < self.lease_expiry[*i])
    }

    /// An instance learns it is no longer the leader: it stops, and abandons what it had in
    /// flight (its in-flight markers stay in etcd for the next leader to honour).
    fn step_down(&mut self, i: usize) {
        let inst = &mut self.instances[i];
        inst.leading = None;
        inst.renewal_sent = None;
        inst.busy.iter_mut().for_each(|b| *b = None);
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Action {
    Tick,
    Campaign(usize),
    KeepAlive(usize),
    KeepAliveAck(usize),
    Accept(usize, usize),
    Check(usize, usize),
    Send(usize, usize),
    Deliver(usize),
    Answer(usize, usize),
    Crash(usize),
    Pause(usize),
    Resume(usize),
}

struct Cluster {
    /// Counts the lease from the acknowledgement's arrival instead of the keep-alive's send.
    from_ack: bool,
    self_fence: bool,
    quarantine: u8,
    resources: usize,
    writes: Vec<(usize, u8)>,
}

impl Model for Cluster {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let inst = Instance {
            up: true,
            paused: false,
            leading: None,
            lease_until: 0,
            max_seen: vec![None; self.resources],
            quarantined_until: vec![0; self.resources],
            busy: vec![None; self.resources],
            renewal_sent: None,
        };
        vec![State {
            now: 0,
            leader: None,
            lease_expiry: [0; N],
            epochs: 0,
            etcd_max_seen: vec![None; self.resources],
            etcd_in_flight: vec![None; self.resources],
            instances: [inst.clone(), inst],
            pending: self.writes.clone(),
            network: Vec::new(),
            applied: vec![Vec::new(); self.resources],
            crashes: 1,
            pauses: 1,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let checked = s.instances.iter().any(|i| i.busy.iter().flatten().any(|(_, st)| *st == Stage::Checked));
        let overdue = s.network.iter().any(|(.., at)| at + DELIVERY <= s.now);
        if s.now < HORIZON && !checked && !overdue {
            actions.push(Action::Tick);
        }
        for k in 0..s.network.len() {
            actions.push(Action::Deliver(k));
        }
        for i in 0..N {
            let inst = &s.instances[i];
            if !inst.up {
                continue;
            }
            if inst.paused {
                actions.push(Action::Resume(i));
                continue;
            }
            if s.crashes > 0 {
                actions.push(Action::Crash(i));
            }
            let no_checked = !inst.busy.iter().flatten().any(|(_, st)| *st == Stage::Checked);
            if s.pauses > 0 && no_checked {
                actions.push(Action::Pause(i));
            }
            match inst.leading {
                None if s.leader_alive().is_none() => actions.push(Action::Campaign(i)),
                None => {}
                Some(_) => {
                    if inst.renewal_sent.is_some() {
                        actions.push(Action::KeepAliveAck(i));
                    } else {
                        actions.push(Action::KeepAlive(i));
                    }
                    for (w, (r, _)) in s.pending.iter().enumerate() {
                        if inst.busy[*r].is_none() {
                            actions.push(Action::Accept(i, w));
                        }
                    }
                    for r in 0..self.resources {
                        match inst.busy[r] {
                            Some((_, Stage::Committed)) => actions.push(Action::Check(i, r)),
                            Some((_, Stage::Checked)) => actions.push(Action::Send(i, r)),
                            Some((_, Stage::Delivered)) => actions.push(Action::Answer(i, r)),
                            _ => {}
                        }
                    }
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Tick => s.now += 1,
            Action::Campaign(i) => {
                // A put of the leader key if absent (its create revision is the epoch), with a
                // new lease; then the takeover reads the table and the in-flight markers.
                s.epochs += 1;
                s.leader = Some((i, s.epochs));
                s.lease_expiry[i] = s.now + TTL;
                let now = s.now;
                let (max_seen, in_flight) = (s.etcd_max_seen.clone(), s.etcd_in_flight.clone());
                let inst = &mut s.instances[i];
                inst.leading = Some(s.epochs);
                inst.lease_until = now + TTL - MARGIN;
                inst.max_seen = max_seen;
                for (r, flying) in in_flight.iter().enumerate() {
                    inst.quarantined_until[r] = if flying.is_some() { now + self.quarantine } else { 0 };
                }
            }
            Action::KeepAlive(i) => {
                let epoch = s.instances[i].leading;
                if s.leader_alive().is_some_and(|(l, e)| l == i && Some(e) == epoch) {
                    // etcd renews at once; the instance reads the answer in a later step.
                    s.lease_expiry[i] = s.now + TTL;
                    s.instances[i].renewal_sent = Some(s.now);
                } else {
                    // A lost lease is never renewed.
                    s.step_down(i);
                }
            }
            Action::KeepAliveAck(i) => {
                let sent = s.instances[i].renewal_sent.take()?;
                let from = if self.from_ack { s.now } else { sent };
                s.instances[i].lease_until = s.instances[i].lease_until.max(from + TTL - MARGIN);
            }
            Action::Accept(i, w) => {
                let (r, token) = s.pending[w];
                let inst = &s.instances[i];
                if s.now < inst.quarantined_until[r] || inst.max_seen[r].is_some_and(|m| token <= m) {
                    return None;
                }
                // The batch's transaction: applied only under the leader's epoch and lease.
                if s.leader_alive().is_some_and(|(l, e)| l == i && Some(e) == inst.leading) {
                    s.etcd_max_seen[r] = Some(token);
                    s.etcd_in_flight[r] = Some(token);
                    s.instances[i].max_seen[r] = Some(token);
                    s.instances[i].busy[r] = Some((token, Stage::Committed));
                    s.pending.remove(w);
                } else {
                    s.step_down(i);
                }
            }
            Action::Check(i, r) => {
                let (token, _) = s.instances[i].busy[r]?;
                if self.self_fence && s.now >= s.instances[i].lease_until {
                    s.step_down(i);
                } else {
                    s.instances[i].busy[r] = Some((token, Stage::Checked));
                }
            }
            Action::Send(i, r) => {
                let (token, _) = s.instances[i].busy[r]?;
                s.network.push((r, token, i, s.now));
                s.instances[i].busy[r] = Some((token, Stage::Sent));
            }
            Action::Deliver(k) => {
                let (r, token, sender, _) = s.network.remove(k);
                s.applied[r].push(token);
                if s.instances[sender].busy[r] == Some((token, Stage::Sent)) {
                    s.instances[sender].busy[r] = Some((token, Stage::Delivered));
                }
            }
            Action::Answer(i, r) => {
                let (token, _) = s.instances[i].busy[r]?;
                s.instances[i].busy[r] = None;
                // Clearing the marker is guarded like every transaction of the leader's.
                if s.leader_alive().is_some_and(|(l, e)| l == i && Some(e) == s.instances[i].leading)
                    && s.etcd_in_flight[r] == Some(token)
                {
                    s.etcd_in_flight[r] = None;
                }
            }
            Action::Crash(i) => {
                s.crashes -= 1;
                s.step_down(i);
                s.instances[i].up = false;
            }
            Action::Pause(i) => {
                s.pauses -= 1;
                s.instances[i].paused = true;
            }
            Action::Resume(i) => s.instances[i].paused = false,
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![Property::<Self>::always("the backend applies each resource's writes in token order", |_, s| {
            s.applied.iter().all(|tokens| tokens.windows(2).all(|w| w[0] < w[1]))
        })]
    }
}

fn check(model: Cluster) -> (impl Checker<Cluster>, Duration) {
    let started = Instant::now();
    let checker = model.checker().spawn_bfs().join();
    (checker, started.elapsed())
}

/// The model with every fix in place holds for `resources` and `writes`.
fn holds(resources: usize, writes: Vec<(usize, u8)>) {
    let model =
        Cluster { from_ack: false, self_fence: true, quarantine: QUARANTINE, resources, writes: writes.clone() };
    let (checker, took) = check(model);
    eprintln!("{resources} resource(s), writes {writes:?}: {} states in {took:?}", checker.unique_state_count());
    checker.assert_properties();
}

// Two tests, so that they run side by side.
#[test]
fn with_the_self_fence_check_no_order_of_steps_breaks_the_order_of_three_writes_to_one_resource() {
    holds(1, vec![(0, 1), (0, 2), (0, 3)]);
}

#[test]
fn with_the_self_fence_check_no_order_of_steps_breaks_the_order_of_writes_to_two_resources() {
    holds(2, vec![(0, 1), (1, 2)]);
}

#[test]
fn without_the_self_fence_check_a_leader_that_outlived_its_lease_breaks_it() {
    let (checker, _) = check(Cluster {
        from_ack: false,
        self_fence: false,
        quarantine: QUARANTINE,
        resources: 1,
        writes: vec![(0, 1), (0, 2)],
    });
    let path = checker.discovery("the backend applies each resource's writes in token order");
    let path = path.expect("the checker finds the zombie leader");
    let actions = path.into_actions();
    eprintln!("counterexample: {actions:?}");
    // The leadership changed hands while the first leader still had a write to send.
    assert!(actions.contains(&Action::Campaign(0)) && actions.contains(&Action::Campaign(1)), "{actions:?}");
}

#[test]
fn without_a_quarantine_a_new_leader_overtakes_the_old_ones_write_still_on_the_way() {
    let (checker, _) =
        check(Cluster { from_ack: false, self_fence: true, quarantine: 0, resources: 1, writes: vec![(0, 1), (0, 2)] });
    let path = checker.discovery("the backend applies each resource's writes in token order");
    let actions = path.expect("the checker finds the overtaking write").into_actions();
    eprintln!("counterexample: {actions:?}");
}

#[test]
fn counting_the_lease_from_the_keep_alives_acknowledgement_breaks_it() {
    let model = Cluster {
        from_ack: true,
        self_fence: true,
        quarantine: QUARANTINE,
        resources: 1,
        writes: vec![(0, 1), (0, 2)],
    };
    let (checker, _) = check(model);
    let path = checker.discovery("the backend applies each resource's writes in token order");
    let actions = path.expect("the checker finds the lease counted too late").into_actions();
    eprintln!("counterexample: {actions:?}");
    assert!(actions.iter().any(|a| matches!(a, Action::KeepAliveAck(_))), "{actions:?}");
}
