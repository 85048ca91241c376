//! Randomized rounds of pinned writes (docs/pins.md) to Apache with mod_dav, through a relay
//! that holds one chosen write of each round past fencegate's timeout and three quarantines
//! and then delivers it, as a buffer nobody can see into would. Each round writes a fresh key:
//! two to five `PUT`s and `DELETE`s with climbing tokens, one of them held, the held one
//! delivered after a random number of the later writes, and restarts of fencegate (in-process,
//! on the same data dir) between writes from time to time. `DELETE` is not a subtree method here
//! (the rounds write files only), so it is pinned as a `PUT` is. The one case docs/pins.md
//! leaves to the time bound, a `DELETE` after a create of unknown outcome, waits out the
//! quarantine, and a held create is delivered before such a `DELETE` is let through, as a
//! backend that holds no write longer than `fence.quarantine` would.
//!
//! The oracle: fencegate answers each write with Apache's own status, and the relay returns
//! Apache's answer to the late one, so the order in which Apache applied the key's writes is
//! known exactly. It must be strictly increasing in token, and the file must end as the last
//! applied write left it. With pins on, no round may break either; with pins off, the same
//! rounds must break the order (the check can fail).
//!
//! `FG_PIN_ROUNDS` rounds with pins on (default 6; `.ci/run` sets more; a soak, 1,000),
//! `FG_SEED` replays a run's choices. Skipped with a message where Apache is not installed.

use crate::common;

use std::time::Duration;

use common::Harness;
use common::apache::{Apache, start_apache};
use common::relay::{Relay, method_with_token};
use common::rng::Rng;
use fencegate::config::{DEFAULT_DOMAIN, PinMode, Rule};

/// fencegate's bound on Apache's answer: the held write's `504`.
const TIMEOUT: Duration = Duration::from_secs(1);
/// How long a key refuses the writes that may not pass after that `504`.
const QUARANTINE: Duration = Duration::from_millis(200);
/// How long the relay holds the chosen write at least: three quarantines past fencegate's
/// giving up on it.
const HOLD: Duration = TIMEOUT.saturating_add(QUARANTINE.saturating_mul(3));
/// Rounds with pins off, each of which holds a `PUT` and delivers it after a newer write.
const CONTROL_ROUNDS: u64 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Put,
    Delete,
}

/// One round's choices.
#[derive(Debug)]
struct Round {
    ops: Vec<Op>,
    /// The index of the held write.
    held: usize,
    /// The late write is delivered once this many writes have been sent.
    deliver_after: usize,
    /// fencegate restarts before the writes at these indexes.
    restarts: Vec<usize>,
}

impl Round {
    fn draw(rng: &mut Rng) -> Round {
        let n = 2 + rng.below(4) as usize;
        let ops: Vec<Op> = (0..n).map(|_| if rng.below(3) == 0 { Op::Delete } else { Op::Put }).collect();
        let held = rng.below(n as u64) as usize;
        let mut deliver_after = held + 1 + rng.below((n - held) as u64) as usize;
        // A held create (a PUT to an absent key) lands whenever the key is absent again, so a
        // DELETE after it waits out its quarantine (docs/pins.md): the one case that keeps the
        // time bound. The backend is taken to hold no write longer: the create lands before
        // that DELETE is let through.
        let present = ops[..held].last().is_some_and(|op| *op == Op::Put);
        if ops[held] == Op::Put
            && !present
            && let Some(delete) = (held + 1..n).find(|&i| ops[i] == Op::Delete)
        {
            deliver_after = deliver_after.min(delete);
        }
        let restarts = (1..n).filter(|_| rng.below(6) == 0).collect();
        Round { ops, held, deliver_after, restarts }
    }
}

/// What one round saw.
#[derive(Debug)]
struct Seen {
    /// Tokens in the order Apache applied them.
    applied: Vec<u64>,
    /// The file as the last applied write left it.
    expected: Option<Vec<u8>>,
    /// The file as it is.
    file: Option<Vec<u8>>,
    /// Every write's status, the late one's as Apache gave it.
    statuses: Vec<(u64, Op, u16)>,
}

impl Seen {
    fn in_order(&self) -> bool {
        self.applied.windows(2).all(|w| w[0] < w[1]) && self.file == self.expected
    }
}

async fn harness(relay: &Relay, pin: bool) -> Harness {
    let url = relay.url();
    Harness::start_with(|c| {
        c.backend.url = url.parse().unwrap();
        c.backend.request_timeout = TIMEOUT;
        c.fence.quarantine = QUARANTINE;
        // Files only: a DELETE then changes its key alone, so it is pinned too. (Where it may
        // remove a collection it is a subtree write, which keeps the time bound.)
        c.fence.subtree_methods.retain(|m| m != http::Method::DELETE);
        c.fence.rules.push(Rule {
            prefix: "/".into(),
            token_domain: DEFAULT_DOMAIN.into(),
            equal_token: None,
            verify: None,
            lock: None,
            max_jump: None,
            pin: Some(if pin { PinMode::Etag } else { PinMode::Off }),
        });
    })
    .await
}

fn body(token: u64) -> String {
    format!("written with token {token}")
}

/// Sends one write until no quarantine holds it back; returns Apache's status (relayed).
async fn write(h: &Harness, key: &str, op: Op, token: u64) -> u16 {
    let started = std::time::Instant::now();
    loop {
        let t = token.to_string();
        let r = match op {
            Op::Put => h.put(key, token, &body(token)).await,
            Op::Delete => h.send("DELETE", key, &[("fencing-token", t.as_str())], "").await,
        };
        match r.fencegate_error() {
            Some("resource_quarantined") if started.elapsed() < Duration::from_secs(20) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Some("backend_moved") => return 412,
            None => return r.status,
            Some(code) => panic!("{op:?} {key} token {token}: fencegate refused it: {code} {:?}", r.body),
        }
    }
}

/// Runs `round` on `key` through `h`, Apache behind `relay`.
async fn run(h: &mut Harness, apache: &Apache, relay: &Relay, key: &str, round: &Round) -> Seen {
    let mut seen = Seen { applied: Vec::new(), expected: None, file: None, statuses: Vec::new() };
    let effect = |op: Op, token: u64| match op {
        Op::Put => Some(body(token).into_bytes()),
        Op::Delete => None,
    };
    let held_token = round.held as u64 + 1;
    let held_op = round.ops[round.held];
    let mut hold =
        relay.hold_next_gated(method_with_token(if held_op == Op::Put { "PUT" } else { "DELETE" }, held_token), HOLD);
    for (i, &op) in round.ops.iter().enumerate() {
        if round.restarts.contains(&i) {
            h.restart().await;
        }
        let token = i as u64 + 1;
        if i == round.held {
            let t = token.to_string();
            let r = match op {
                Op::Put => h.put(key, token, &body(token)).await,
                Op::Delete => h.send("DELETE", key, &[("fencing-token", t.as_str())], "").await,
            };
            r.assert_refused(504, "backend_timeout");
            hold.held().await;
        } else {
            let status = write(h, key, op, token).await;
            seen.statuses.push((token, op, status));
            match status {
                200..=299 => {
                    seen.applied.push(token);
                    seen.expected = effect(op, token);
                }
                404 | 412 => {}
                other => panic!("{op:?} {key} token {token}: Apache answered {other}"),
            }
        }
        if i + 1 == round.deliver_after {
            hold.release();
            let late = hold.delivered().await;
            let status = late.response.map_or(0, |r| r.status);
            seen.statuses.push((held_token, held_op, status));
            if (200..300).contains(&status) {
                seen.applied.push(held_token);
                seen.expected = effect(held_op, held_token);
            }
        }
    }
    seen.file = apache.file(key);
    seen
}

fn seed() -> u64 {
    std::env::var("FG_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    })
}

#[tokio::test]
async fn pinned_writes_reach_apache_in_token_order_whatever_write_is_delayed() {
    let Some(apache) = start_apache().await else { return };
    let relay = Relay::start(apache.addr).await;
    let seed = seed();
    eprintln!("pins_rounds: FG_SEED={seed}");
    let mut rng = Rng::new(seed);

    // The control: without pins, a held PUT delivered after a newer write lands out of order.
    let mut unpinned = harness(&relay, false).await;
    let mut broken = 0;
    for n in 0..CONTROL_ROUNDS {
        let round = Round { ops: vec![Op::Put, Op::Put], held: 0, deliver_after: 2, restarts: Vec::new() };
        let seen = run(&mut unpinned, &apache, &relay, &format!("/control{n}"), &round).await;
        broken += u64::from(!seen.in_order());
    }
    assert_eq!(broken, CONTROL_ROUNDS, "without pins every control round lands the late PUT last");
    drop(unpinned);

    let rounds: u64 = std::env::var("FG_PIN_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(6);
    let mut h = harness(&relay, true).await;
    let (mut late_applied, mut late_refused) = (0, 0);
    for n in 0..rounds {
        let round = Round::draw(&mut rng);
        let key = format!("/round{n}");
        let seen = run(&mut h, &apache, &relay, &key, &round).await;
        assert!(seen.in_order(), "round {n} ({key}, FG_SEED={seed}): {round:?}\n{seen:?}");
        let late = seen.statuses.iter().find(|(t, ..)| *t == round.held as u64 + 1).map(|(.., s)| *s);
        match late {
            Some(200..=299) => late_applied += 1,
            _ => late_refused += 1,
        }
    }
    eprintln!(
        "pins_rounds: {rounds} rounds in token order; late writes applied in order {late_applied}, \
         refused by Apache {late_refused}"
    );
}
