//! Pinned writes (docs/pins.md), model-checked with stateright: one fencegate instance in front
//! of a backend that honours `If-Match` and `If-None-Match`, one key.
//!
//! Clients send `PUT`s (a body value from a small set), `DELETE`s and a write that cannot be
//! pinned (a `MOVE` into the key: no precondition), each with its own token, in any order.
//! fencegate checks a write's token against `max_seen` and the quarantine, takes the key's turn
//! and advances (durably, in the same step), learns an unknown pin by `HEAD`, sends the write
//! with its precondition, and on the answer sets the pin or makes it unknown. The backend
//! applies a write only when its precondition holds.
//!
//! The network holds a sent write for any length of time, and delivers it or loses it later.
//! A write whose answer fencegate has not read can time out: its outcome is unknown, the pin
//! becomes unknown and the key is quarantined, while the write may still land. fencegate can
//! crash (a bounded number of times) and restart: the turn, the pin and the quarantine are
//! lost; `max_seen` and the log's in-flight mark (the key's last advance has no Answered
//! record, docs/store.md) are kept, and that mark quarantines the key at restart.
//!
//! Time is not modelled as ticks. The one thing a quarantine's time bound buys is that the
//! backend has applied or dropped every write sent before the quarantine began by the time it
//! ends (`fence.quarantine` at least as long as the backend can hold a write). So a bounded
//! quarantine ends only once no write that was on its way when it began is still on its way;
//! an unbounded one ends whenever (the backend held a write longer than `fence.quarantine`).
//! The pins need no bound: a held write can land after any number of later steps.
//!
//! The properties: the backend applies the key's writes in strictly increasing token order (a
//! write whose precondition fails, or a `DELETE` of an absent key, is not applied), and every
//! write fencegate answered `2xx` was applied.
//!
//! A pinned write that passes a quarantine and is answered must leave the log's in-flight mark
//! set (`keeps_unknown`, as fencegate does): if its answer clears it, a restart forgets the
//! earlier write of unknown outcome and a `DELETE` lets a held create land late. The
//! variants that must fail: no pins with a quarantine that ends before a held write lands, a
//! `DELETE` passing a quarantine of pinned writes, tags that are hashes of the content, and a
//! quarantine found at restart that lets pinned writes pass when the write in flight was not
//! pinned.

use std::time::{Duration, Instant};

use stateright::{Checker, HasDiscoveries, Model, Path, Property};

use Op::{Delete, Move, Put};

const ORDER: &str = "the backend applies the key's writes in token order";
const ACKED: &str = "every write fencegate answered 2xx was applied";

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Op {
    Put(char),
    Delete,
    /// A write with no precondition that leaves the key present (a `MOVE` onto it).
    Move(char),
}

impl Op {
    /// Whether pins send it with a precondition (docs/pins.md, "A pinned write").
    fn pinnable(self) -> bool {
        !matches!(self, Op::Move(_))
    }
}

/// The backend's `ETag` of the key.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
enum Tag {
    /// A counter that never repeats (a generation number).
    Version(u8),
    /// A hash of the body (S3's MD5, Apache's `FileETag Digest`): the same body, the same tag.
    Hash(char),
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Tags {
    Version,
    Hash,
}

/// What fencegate last learnt of the backend's state of the key.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Pin {
    Unknown,
    Absent,
    Tag(Tag),
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Precondition {
    None,
    IfMatch(Tag),
    IfNoneMatch,
}

/// What a quarantine holds back.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
enum Hold {
    /// Only pinned writes that do not make the key absent pass (its write was pinned).
    Pinned,
    /// Every write waits.
    All,
}

/// The backend's answer to a delivered write.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Reply {
    /// `2xx`, with the key's state after it (a tag, or absent).
    Applied(Option<Tag>),
    /// `412`, or `404` to a `DELETE` of an absent key: nothing applied.
    NotApplied,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Stage {
    /// Checked and advanced, not sent yet.
    Checked,
    /// On its way to the backend.
    Sent,
    /// The backend answered; fencegate has not read the answer.
    Replied(Reply),
}

/// The write that holds the key's turn.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Turn {
    token: u8,
    op: Op,
    stage: Stage,
    /// What it was sent with.
    precondition: Precondition,
}

/// A write on its way to the backend.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct Message {
    token: u8,
    op: Op,
    precondition: Precondition,
    /// It was on its way when the running quarantine began: a bounded quarantine waits for it.
    covered: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct State {
    /// The backend: the key's tag (`None`: absent), the versions handed out, the tokens applied.
    backend: Option<Tag>,
    versions: u8,
    applied: Vec<u8>,
    /// Tokens fencegate answered `2xx`.
    acked: Vec<u8>,
    network: Vec<Message>,
    /// On disk: `max_seen` (0: none) and the log's in-flight mark of the key.
    max_seen: u8,
    in_flight: bool,
    /// In memory.
    up: bool,
    pin: Pin,
    quarantine: Option<Hold>,
    /// The tags the running quarantine's writes of unknown outcome were sent `If-Match`.
    late: Vec<Tag>,
    turn: Option<Turn>,
    /// Client writes not taken yet: (token, write).
    pending: Vec<(u8, Op)>,
    crashes: u8,
}

impl State {
    /// A quarantine begins (or is extended): it covers every write on its way at that step.
    fn quarantine(&mut self, hold: Hold, bounded: bool) {
        self.quarantine = self.quarantine.max(Some(hold));
        self.network.iter_mut().for_each(|m| m.covered = bounded);
    }
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum Action {
    /// The write of this token takes the turn: checked.
    Accept(u8),
    /// A `HEAD` of the key under the turn.
    Learn,
    /// The write is advanced (durably) and sent.
    Send,
    /// The backend receives the write of this token.
    Deliver(u8),
    /// The write of this token is lost on the way.
    Lose(u8),
    Answer,
    Timeout,
    QuarantineEnds,
    Crash,
    Restart,
}

#[derive(Clone)]
struct Pinning {
    /// Pinnable writes carry a precondition. Without: every write is sent as it came.
    pins: bool,
    tags: Tags,
    /// A `DELETE` may pass a quarantine whose writes were pinned (the design makes it wait).
    delete_passes: bool,
    /// While a quarantine runs, a write whose key is found tagged as one of its late writes'
    /// `If-Match` named it waits (is refused before its advance, and retried), and a kept pin
    /// naming such a tag is learnt again (the design). Without: it is sent pinned to that tag.
    late_tags: bool,
    /// The state a write refused for a late tag found is forgotten (the design). Without: it is
    /// kept as the key's pin, and a later write may be sent pinned to it after the late write
    /// landed.
    forgets_late: bool,
    /// A quarantine ends only once every write on its way when it began has landed or been lost.
    bounded: bool,
    /// What the quarantine of a key found in flight at start-up holds (the design: every write).
    at_restart: Hold,
    /// An answer read while the key is quarantined leaves the log's in-flight mark set, so the
    /// unknown outcome survives a restart. Without: every answer clears it.
    keeps_unknown: bool,
    crashes: u8,
    writes: Vec<(u8, Op)>,
}

impl Pinning {
    /// Pins as fencegate keeps them (docs/pins.md), with version tags and the quarantine's
    /// time bound holding.
    fn as_built(writes: Vec<(u8, Op)>) -> Pinning {
        Pinning {
            pins: true,
            tags: Tags::Version,
            delete_passes: false,
            late_tags: true,
            forgets_late: true,
            bounded: true,
            at_restart: Hold::All,
            keeps_unknown: true,
            crashes: 1,
            writes,
        }
    }

    /// Whether `pin` names a tag a late write of the running quarantine was sent pinned to,
    /// which the design does not send a write pinned to.
    fn late(&self, s: &State, pin: Pin) -> bool {
        self.late_tags && matches!(pin, Pin::Tag(tag) if s.late.contains(&tag))
    }

    fn passes(&self, op: Op, hold: Option<Hold>) -> bool {
        match hold {
            None => true,
            Some(Hold::All) => false,
            Some(Hold::Pinned) => match op {
                Op::Put(_) => self.pins,
                Op::Delete => self.pins && self.delete_passes,
                Op::Move(_) => false,
            },
        }
    }
}

impl Model for Pinning {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            backend: None,
            versions: 0,
            applied: Vec::new(),
            acked: Vec::new(),
            network: Vec::new(),
            max_seen: 0,
            in_flight: false,
            up: true,
            pin: Pin::Unknown,
            quarantine: None,
            late: Vec::new(),
            turn: None,
            pending: self.writes.clone(),
            crashes: self.crashes,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        for m in &s.network {
            actions.push(Action::Deliver(m.token));
            actions.push(Action::Lose(m.token));
        }
        if s.quarantine.is_some() && !s.network.iter().any(|m| m.covered) {
            actions.push(Action::QuarantineEnds);
        }
        if !s.up {
            actions.push(Action::Restart);
            return;
        }
        if s.crashes > 0 {
            actions.push(Action::Crash);
        }
        match s.turn {
            None => actions.extend(s.pending.iter().map(|(token, _)| Action::Accept(*token))),
            Some(turn) => match turn.stage {
                Stage::Checked => actions.extend([Action::Learn, Action::Send]),
                Stage::Sent => actions.push(Action::Timeout),
                Stage::Replied(_) => actions.extend([Action::Answer, Action::Timeout]),
            },
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Accept(token) => {
                let w = s.pending.iter().position(|(t, _)| *t == token)?;
                let op = s.pending[w].1;
                if token <= s.max_seen || !self.passes(op, s.quarantine) {
                    return None;
                }
                s.pending.remove(w);
                s.turn = Some(Turn { token, op, stage: Stage::Checked, precondition: Precondition::None });
            }
            Action::Learn => {
                let turn = s.turn?;
                if !self.pins || !turn.op.pinnable() || (s.pin != Pin::Unknown && !self.late(&s, s.pin)) {
                    return None;
                }
                let before = s.pin;
                s.pin = s.backend.map_or(Pin::Absent, Pin::Tag);
                if self.late(&s, s.pin) {
                    // Refused before its advance: its client sends it again. The state it
                    // found is not kept (the pin stays what it was): the late write may land
                    // and move it at any time.
                    if self.forgets_late {
                        s.pin = before;
                    }
                    s.turn = None;
                    s.pending.push((turn.token, turn.op));
                    s.pending.sort_by_key(|(token, _)| *token);
                }
            }
            Action::Send => {
                let mut turn = s.turn?;
                let precondition = if self.pins && turn.op.pinnable() {
                    match s.pin {
                        Pin::Unknown => return None,
                        pin if self.late(&s, pin) => return None,
                        Pin::Absent => Precondition::IfNoneMatch,
                        Pin::Tag(tag) => Precondition::IfMatch(tag),
                    }
                } else {
                    Precondition::None
                };
                // Durable before it goes anywhere.
                s.max_seen = turn.token;
                s.in_flight = true;
                turn.precondition = precondition;
                turn.stage = Stage::Sent;
                s.turn = Some(turn);
                s.network.push(Message { token: turn.token, op: turn.op, precondition, covered: false });
            }
            Action::Deliver(token) => {
                let k = s.network.iter().position(|m| m.token == token)?;
                let m = s.network.remove(k);
                let holds = match m.precondition {
                    Precondition::None => true,
                    Precondition::IfMatch(tag) => s.backend == Some(tag),
                    Precondition::IfNoneMatch => s.backend.is_none(),
                };
                let reply = match m.op {
                    _ if !holds => Reply::NotApplied,
                    Op::Delete if s.backend.is_none() => Reply::NotApplied,
                    Op::Delete => {
                        s.backend = None;
                        Reply::Applied(None)
                    }
                    Op::Put(value) | Op::Move(value) => {
                        s.versions += 1;
                        let tag = match self.tags {
                            Tags::Version => Tag::Version(s.versions),
                            Tags::Hash => Tag::Hash(value),
                        };
                        s.backend = Some(tag);
                        Reply::Applied(Some(tag))
                    }
                };
                if matches!(reply, Reply::Applied(_)) {
                    s.applied.push(token);
                }
                if let Some(turn) = s.turn.as_mut().filter(|t| t.token == token && t.stage == Stage::Sent) {
                    turn.stage = Stage::Replied(reply);
                }
            }
            Action::Lose(token) => {
                let k = s.network.iter().position(|m| m.token == token)?;
                s.network.remove(k);
            }
            Action::Answer => {
                let turn = s.turn.take()?;
                let Stage::Replied(reply) = turn.stage else { return None };
                s.pin = match (reply, turn.op) {
                    (Reply::Applied(after), Op::Put(_) | Op::Delete) if self.pins => {
                        after.map_or(Pin::Absent, Pin::Tag)
                    }
                    _ => Pin::Unknown,
                };
                if matches!(reply, Reply::Applied(_)) {
                    s.acked.push(turn.token);
                }
                if !(self.keeps_unknown && s.quarantine.is_some()) {
                    s.in_flight = false;
                }
            }
            Action::Timeout => {
                let turn = s.turn.take()?;
                s.pin = Pin::Unknown;
                let hold = if turn.precondition == Precondition::None { Hold::All } else { Hold::Pinned };
                s.quarantine(hold, self.bounded);
                if let Precondition::IfMatch(tag) = turn.precondition
                    && !s.late.contains(&tag)
                {
                    s.late.push(tag);
                    s.late.sort();
                }
            }
            Action::QuarantineEnds => {
                s.quarantine = None;
                s.late.clear();
            }
            Action::Crash => {
                s.crashes -= 1;
                s.up = false;
                // A write not yet advanced is lost with the process: its client sends it again.
                if let Some(turn) = s.turn.take().filter(|t| t.stage == Stage::Checked) {
                    s.pending.push((turn.token, turn.op));
                    s.pending.sort_by_key(|(token, _)| *token);
                }
                s.pin = Pin::Unknown;
                s.quarantine = None;
                s.late.clear();
            }
            Action::Restart => {
                s.up = true;
                if s.in_flight {
                    s.quarantine(self.at_restart, self.bounded);
                }
            }
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::<Self>::always(ORDER, |_, s| s.applied.windows(2).all(|w| w[0] < w[1])),
            Property::<Self>::always(ACKED, |_, s| s.acked.iter().all(|t| s.applied.contains(t))),
        ]
    }
}

fn check(model: Pinning) -> (impl Checker<Pinning>, Duration) {
    let started = Instant::now();
    let checker = model.checker().spawn_bfs().join();
    (checker, started.elapsed())
}

/// Checks `model` through its whole state space and asserts both properties hold.
fn holds(name: &str, model: Pinning) {
    let writes = model.writes.clone();
    let (checker, took) = check(model);
    eprintln!(
        "{name}, writes {writes:?}: {} states ({} generated) in {took:?}",
        checker.unique_state_count(),
        checker.state_count()
    );
    checker.assert_properties();
}

/// Checks `model` until it finds a write applied out of order, and returns the steps that led
/// there. (The search stops at the first such state, so the acknowledgement property is
/// checked through whole state spaces by the models that hold.)
fn breaks_the_order(name: &str, model: Pinning) -> Vec<Action> {
    let writes = model.writes.clone();
    let started = Instant::now();
    let checker = model.checker().finish_when(HasDiscoveries::AnyOf([ORDER].into())).spawn_bfs().join();
    let took = started.elapsed();
    let path = checker.discovery(ORDER).unwrap_or_else(|| panic!("{name}: the checker finds no write out of order"));
    // Threads race to record a failing state, whose path may then run on past the first write
    // out of order: cut it there.
    let mut actions = Vec::new();
    let mut applied = Vec::new();
    for (state, action) in path.into_vec() {
        if state.applied.windows(2).any(|w| w[0] >= w[1]) {
            applied = state.applied;
            break;
        }
        actions.extend(action);
    }
    eprintln!(
        "{name}, writes {writes:?}: {} states in {took:?}; counterexample {actions:?}, applied {applied:?}",
        checker.unique_state_count()
    );
    actions
}

/// Replays `actions` in `model` and returns the tokens the backend applied.
fn replay(model: &Pinning, actions: &[Action]) -> Vec<u8> {
    let init = model.init_states().remove(0);
    let path = Path::from_actions(model, init, actions).expect("every step of the trace is enabled");
    path.last_state().applied.clone()
}

// Each test explores one variant, so that they run side by side.

#[test]
fn pins_that_keep_the_unknown_outcome_across_restarts_apply_every_write_in_token_order() {
    let writes = vec![(1, Put('A')), (2, Put('B')), (3, Delete), (4, Move('A')), (5, Put('A')), (6, Delete)];
    holds(
        "pins, version tags, unknown outcome kept, two crashes",
        Pinning { keeps_unknown: true, crashes: 2, ..Pinning::as_built(writes) },
    );
}

#[test]
fn pinned_puts_need_no_time_bound_but_a_delete_does() {
    let puts = vec![(1, Put('A')), (2, Put('B')), (3, Put('A')), (4, Put('B'))];
    let unbounded = Pinning { bounded: false, keeps_unknown: true, crashes: 2, ..Pinning::as_built(puts) };
    holds("pins, version tags, PUTs only, quarantine ends whenever, two crashes", unbounded.clone());
    let writes = vec![(1, Put('A')), (2, Put('B')), (3, Delete)];
    let actions = breaks_the_order("pins, quarantine ends whenever, a DELETE", Pinning { writes, ..unbounded });
    // Every restart quarantines here: only a quarantine that ends too early lets it happen.
    assert!(actions.contains(&Action::QuarantineEnds), "{actions:?}");
}

#[test]
fn pins_hold_while_fencegate_runs_even_when_answers_clear_the_mark() {
    let writes = vec![(1, Put('A')), (2, Put('B')), (3, Delete), (4, Move('A')), (5, Put('A')), (6, Delete)];
    holds(
        "answers that clear the mark, no crash",
        Pinning { keeps_unknown: false, crashes: 0, ..Pinning::as_built(writes) },
    );
}

#[test]
fn pins_whose_answers_clear_the_mark_forget_a_held_create_at_restart() {
    let model = Pinning { keeps_unknown: false, ..Pinning::as_built(vec![(1, Put('A')), (2, Put('B')), (3, Delete)]) };
    let actions = breaks_the_order("pins as designed, one crash", model);
    // The PUT that passed the quarantine was answered, which cleared the log's in-flight mark:
    // the restart quarantined nothing, and the DELETE passed while the create was on its way.
    assert!(actions.contains(&Action::Restart), "{actions:?}");
}

#[test]
fn without_pins_a_quarantine_shorter_than_the_backends_delay_lets_a_late_write_land_out_of_order() {
    let writes = vec![(1, Put('A')), (2, Move('B')), (3, Delete), (4, Put('A'))];
    let unpinned = Pinning { pins: false, crashes: 2, ..Pinning::as_built(writes) };
    holds("no pins, quarantine bounded, two crashes", unpinned.clone());
    let actions = breaks_the_order("no pins, quarantine ends whenever", Pinning { bounded: false, ..unpinned });
    assert!(actions.contains(&Action::QuarantineEnds), "{actions:?}");
}

#[test]
fn a_delete_that_passes_a_quarantine_of_pinned_writes_lets_absent_come_back() {
    let writes = vec![(1, Put('A')), (2, Put('B')), (3, Delete)];
    let model = Pinning { delete_passes: true, keeps_unknown: true, crashes: 0, ..Pinning::as_built(writes) };
    let actions = breaks_the_order("pins, DELETE passes the quarantine", model);
    // No quarantine ended: the DELETE passed it, then the held create landed.
    assert!(!actions.contains(&Action::QuarantineEnds), "{actions:?}");
}

#[test]
fn tags_that_hash_the_content_hold_while_the_late_writes_quarantine_runs() {
    let writes = vec![(1, Put('A')), (2, Put('C')), (3, Put('B')), (4, Put('A')), (5, Put('C'))];
    let hashed = Pinning { tags: Tags::Hash, ..Pinning::as_built(writes) };
    holds("pins, content-hash tags, quarantine bounded, one crash", hashed.clone());
    let writes = vec![(1, Put('A')), (2, Delete), (3, Put('A')), (4, Move('B')), (5, Put('A'))];
    holds("pins, content-hash tags, deletes and moves, one crash", Pinning { writes, ..hashed });
}

#[test]
fn a_state_found_under_a_late_tag_and_kept_pins_a_write_the_same_bytes_then_overtake() {
    let writes = vec![(1, Put('A')), (2, Put('C')), (3, Put('B')), (4, Put('A'))];
    let kept = Pinning { tags: Tags::Hash, forgets_late: false, crashes: 0, ..Pinning::as_built(writes) };
    let actions = breaks_the_order("pins, content-hash tags, a late tag's state kept", kept);
    // The write refused for the late tag kept it; the late write landed and the quarantine
    // ended; that write went pinned to the state the backend had left, and was late itself
    // when a write of the same bytes brought the tag back.
    assert!(actions.contains(&Action::QuarantineEnds), "{actions:?}");
}

#[test]
fn tags_that_hash_the_content_let_a_late_write_land_when_the_same_body_comes_back() {
    let writes = vec![(1, Put('A')), (2, Put('C')), (3, Put('B')), (4, Put('A'))];
    let designed = Pinning { tags: Tags::Hash, crashes: 0, ..Pinning::as_built(writes) };
    // Without the wait for a late write's tag, within its quarantine.
    let hashed = Pinning { late_tags: false, ..designed.clone() };
    breaks_the_order("pins, content-hash tags, no wait for a late tag", hashed.clone());
    // A -> B -> A: the PUT of C, pinned to the first A, is held; B replaces A, A replaces B, and
    // the held PUT matches the second A. With version tags the same steps apply it nowhere;
    // with the wait, the PUT of B finds A, the held write's tag, and is refused.
    let a_b_a = [
        [Action::Accept(1), Action::Learn, Action::Send, Action::Deliver(1), Action::Answer].as_slice(),
        &[Action::Accept(2), Action::Send, Action::Timeout],
        &[Action::Accept(3), Action::Learn, Action::Send, Action::Deliver(3), Action::Answer],
        &[Action::Accept(4), Action::Send, Action::Deliver(4), Action::Answer],
        &[Action::Deliver(2)],
    ]
    .concat();
    assert_eq!(replay(&hashed, &a_b_a), [1, 3, 4, 2]);
    assert_eq!(replay(&Pinning { tags: Tags::Version, ..hashed }, &a_b_a), [1, 3, 4]);
    let init = designed.init_states().remove(0);
    assert!(Path::from_actions(&designed, init, &a_b_a).is_none(), "the PUT of B is sent pinned to the late tag");
    // Once the quarantine ends before the held write lands, the time bound is all there is.
    let unbounded = Pinning { bounded: false, ..designed };
    let actions = breaks_the_order("pins, content-hash tags, quarantine ends whenever", unbounded);
    assert!(actions.contains(&Action::QuarantineEnds), "{actions:?}");
}

#[test]
fn a_quarantine_at_restart_that_lets_pinned_writes_pass_is_overtaken_by_an_unpinned_write() {
    let writes = vec![(1, Move('A')), (2, Put('B'))];
    let model = Pinning { at_restart: Hold::Pinned, keeps_unknown: true, ..Pinning::as_built(writes) };
    let actions = breaks_the_order("pins, restart quarantine lets pinned writes pass", model);
    assert!(actions.contains(&Action::Restart), "{actions:?}");
}
