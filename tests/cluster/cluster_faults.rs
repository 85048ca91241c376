//! Fault rounds against the shared fence: a three-member etcd, three fencegate instances in
//! front of one recording backend, clients writing to a handful of resources through random
//! instances with tokens from one shared counter, a quarter of the writes held by the backend
//! (a slow backend, so that writes are in flight). Each round injects one fault, seeded, in a
//! window that matters:
//!
//! - a leader stopped (SIGSTOP) past its lease between the commit of its advance and the
//!   request head, or between two chunks of the body, placed with fail points (the `failpoints`
//!   feature: a fail point logs that it was reached and waits, and the test stops the process
//!   on that line); while it is stopped, another instance takes over and accepts a newer write
//!   on every resource, so that a stalled write that went out on waking would reach the backend
//!   after a newer one (the quarantine is set far below the stall, so only the self-fence can
//!   keep the order);
//! - `kill -9` of the leader with a write at the backend that is applied after the next leader
//!   took over (only the quarantine of its marker keeps it ahead of newer writes), and SIGSTOP
//!   of the leader at a random moment past its lease (woken, it must not fence with its old
//!   table);
//! - `kill -9` of etcd's leader with a batch under way, SIGSTOP of etcd's leader past the
//!   election timeout.
//!
//! A round counts only when its fault hit its window, and says which. After each round the
//! checker reads the whole history: per resource the backend applied tokens in strictly
//! increasing order, every acknowledged write was applied, and etcd's `max_seen` is at or
//! above every acknowledged token. At the end a forced takeover is followed by a stale write
//! to every resource through every instance, which must be refused.
//!
//! Without the self-fence (the gate's check before the head and each chunk, `src/upstream/`),
//! the stall rounds fail the order check: the stalled write reaches the backend after the new
//! leader's.
//!
//! A SIGSTOP at a random moment can land between a write's last check and its send: the window
//! no proxy closes (docs/cluster.md). Such a write goes out on waking, after the newer ones; its
//! instance sees the answer come after its permission lapsed and says so, with how long the
//! write was held after its last passed check (`src/request/lapsed.rs`). The self-fenced rounds
//! without pins tolerate a late write only in a round of that fault, and only when its instance
//! named it that way, after a passed check, held at least `lease_margin + fence.quarantine`
//! ([`CROSSING_HELD`]), behind newer writes that came no sooner after that check (the next
//! leader kept the quarantine: [`crossed_window`]); a late write in a stall round (stopped
//! before a check) is never tolerated, nor in any other run, and the stall rounds without the
//! self-fence check that the instances name every late write they send.
//!
//! The world, its checker and the loop of rounds serve the partition rounds too
//! (`partitions`), whose faults are cut links instead of stopped processes.
//!
//! [`DEFAULT_ROUNDS`] counted rounds (about 7 s each), or `FG_CLUSTER_ROUNDS` (`.ci/run` sets
//! 20; a soak, hundreds); `FG_SEED` replays a run's choice and placement of faults (each round's
//! seed is printed; the processes' own interleavings are not replayed); `FG_CLUSTER_BIN` runs
//! the instances from another binary (a soak on a copy while the tree is rebuilt). Skipped with
//! a message where etcd is not installed; `FG_REQUIRE_SERVICES=1` makes that a failure.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::etcd_cluster::{EtcdCluster, start_etcd_cluster};
use common::netns::Net;
use common::rng::Rng;
use common::{RawConn, eventually, raw_request};

pub(crate) const RESOURCES: [&str; 3] = ["/r0", "/r1", "/r2"];
/// The instances' lease (`store.lease_ttl` in `common::cluster`).
pub(crate) const LEASE: Duration = Duration::from_secs(3);
/// Counted rounds without `FG_CLUSTER_ROUNDS`: a local `cargo test` runs a few.
const DEFAULT_ROUNDS: usize = 3;

/// `fence.quarantine` in these rounds: above any write's time at the backend, as it must be,
/// and below a stall, which lasts until another instance has accepted newer writes after its
/// quarantine: the gate, not the quarantine, is what keeps a stalled leader's write from
/// landing late.
pub(crate) const QUARANTINE: &str = "5s";
/// A write the backend holds longer than a takeover takes, and less than the quarantine: in
/// flight when its leader dies, it is applied after the next leader took over, which only the
/// quarantine of its marker keeps ahead of newer writes.
const LATE_MS: u64 = 4000;
const CLIENTS: usize = 4;
const BARRIER: &str = "settling it with a barrier";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    StallBeforeHead,
    StallMidBody,
    KillLeader,
    StopLeader,
    KillEtcdLeader,
    StopEtcdLeader,
}

const FAULTS: [Fault; 6] = [
    Fault::StallBeforeHead,
    Fault::StallMidBody,
    Fault::KillLeader,
    Fault::StopLeader,
    Fault::KillEtcdLeader,
    Fault::StopEtcdLeader,
];

/// One write as a client saw it.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    pub(crate) resource: &'static str,
    pub(crate) token: u64,
    pub(crate) status: Option<u16>,
}

/// A kind of fault the rounds inject: `inject` waits for its window, injects it, ends it, and
/// says which window it hit (`None`: none, the round is not counted).
pub(crate) trait Inject: Copy + std::fmt::Debug {
    async fn inject(self, world: &mut World, rng: &mut Rng) -> Option<String>;
}

impl Inject for Fault {
    async fn inject(self, world: &mut World, rng: &mut Rng) -> Option<String> {
        world.inject(self, rng).await
    }
}

/// Each write of `applied` (token, when applied) that came after a higher one: its token,
/// when it was applied, and when the first higher one was. The first write above a token is a
/// record high (all before it are at or below that token), so the record highs, whose tokens
/// climb, are searched: a soak's history holds tens of thousands of writes a resource.
fn late_arrivals(applied: &[(u64, Instant)]) -> Vec<(u64, Instant, Instant)> {
    let mut highs: Vec<(u64, Instant)> = Vec::new();
    let mut late = Vec::new();
    for &(t, at) in applied {
        match highs.last() {
            Some(&(high, _)) if t < high => {
                let first = highs.partition_point(|&(h, _)| h <= t);
                late.push((t, at, highs[first].1));
            }
            Some(&(high, _)) if t == high => {}
            _ => highs.push((t, at)),
        }
    }
    late
}

pub(crate) fn acked(o: &Outcome) -> bool {
    o.status.is_some_and(|s| (200..300).contains(&s))
}

/// Fields drop in order: the instances before etcd, both before their network.
pub(crate) struct World {
    pub(crate) cluster: Cluster,
    pub(crate) etcd: EtcdCluster,
    pub(crate) counter: Arc<AtomicU64>,
    pub(crate) outcomes: Arc<Mutex<Vec<Outcome>>>,
    /// The instances run without the self-fence (`upstream::no_self_fence`).
    pub(crate) unfenced: bool,
    /// The namespaces the processes run in, for the partition rounds (`partitions`).
    pub(crate) net: Option<Arc<Net>>,
    /// Whether a late write that crossed the window no proxy closes ([`CROSSING`]) is tolerated:
    /// the self-fenced rounds without pins, whose leader can be stopped at any moment, also
    /// between a write's last check and its send.
    tolerate_window: bool,
    /// Whether this round's fault is a SIGSTOP of the leader at a random moment: the only fault
    /// that can land in the window. A stall at a fail point stops the leader before a check, so
    /// a late write there is the self-fence's failure, never tolerated.
    random_stop: bool,
    /// Every crossing the instances' logs named (held ms, checks passed), kept across their
    /// restarts.
    crossings: Mutex<BTreeMap<(String, u64), (u64, u64)>>,
    /// The late writes tolerated so far.
    tolerated: Mutex<BTreeSet<(String, u64)>>,
}

/// The least a late write that crossed the window was held after its last check: its permit
/// ran out `lease_margin` (1 s in these rounds) before the old lease could expire, and the next
/// leader sent nothing to its resource until `fence.quarantine` after taking over. Less is a
/// quarantine or a lease that failed.
const CROSSING_HELD: Duration = Duration::from_secs(1 + 5);

/// Whether a late write crossed the window no proxy closes, by what its instance said of it
/// (`held` after the last of `checks` passed checks) and when the backend applied it (`late`)
/// and the first newer write it came after (`newer`). Its last check came at most `held` before
/// `late` (the instance's end of the write follows the backend's apply), so a next leader that
/// kept the quarantine sent the newer write at least [`CROSSING_HELD`] after that: a newer write
/// sooner than that means the quarantine failed, however long the late write was held.
fn crossed_window(held: Duration, checks: u64, late: Instant, newer: Instant) -> bool {
    checks > 0 && held >= CROSSING_HELD && newer + held >= late + CROSSING_HELD
}

/// What an instance says of a write the backend answered after its permission to send lapsed
/// (`src/request/lapsed.rs`), with the resource, the token and how long the write was held
/// after its last check.
const CROSSING: &str = "after this instance's permission to send it lapsed";

/// One PUT of `token` to `resource` at `addr`, its body in two chunks a moment apart (so that a
/// fail point between chunks has something on either side).
pub(crate) async fn put(addr: SocketAddr, resource: &str, token: u64, delay_ms: u64) -> Option<u16> {
    let delay = if delay_ms > 0 { format!("\r\nx-memstore-delay-ms: {delay_ms}") } else { String::new() };
    let body = "v".repeat(64);
    let head = format!(
        "PUT {resource} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}{delay}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let exchange = async {
        let mut conn = RawConn::try_open(addr).await?;
        if !conn.try_send(format!("{head}{}", &body[..32])).await {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        if !conn.try_send(&body[32..]).await {
            return None;
        }
        conn.try_read_response().await.map(|r| r.status)
    };
    tokio::time::timeout(Duration::from_secs(20), exchange).await.ok().flatten()
}

/// The next token of the shared counter.
pub(crate) fn token(counter: &AtomicU64) -> u64 {
    counter.fetch_add(1, Ordering::SeqCst) + 1
}

/// Clients writing until `stop`: random resource, the next token, a random instance.
fn load(world: &World, seed: u64, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<()> {
    let addrs: Vec<SocketAddr> = world.cluster.instances.iter().map(|i| i.addr).collect();
    let (counter, outcomes) = (Arc::clone(&world.counter), Arc::clone(&world.outcomes));
    tokio::spawn(async move {
        let mut clients = Vec::new();
        for c in 0..CLIENTS {
            let (addrs, counter, outcomes, stop) =
                (addrs.clone(), Arc::clone(&counter), Arc::clone(&outcomes), Arc::clone(&stop));
            let mut rng = Rng::new(seed ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            clients.push(tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let resource = RESOURCES[rng.below(RESOURCES.len() as u64) as usize];
                    let addr = addrs[rng.below(addrs.len() as u64) as usize];
                    let token = token(&counter);
                    let status = put(addr, resource, token, if rng.below(4) == 0 { 150 } else { 0 }).await;
                    outcomes.lock().unwrap().push(Outcome { resource, token, status });
                    if status.is_none_or(|s| s == 503) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }));
        }
        for c in clients {
            let _ = c.await;
        }
    })
}

impl World {
    /// The running instance that leads, once one does.
    pub(crate) async fn leader(&self) -> usize {
        self.cluster.wait_leader().await
    }

    /// Lines saying `needle` in every running instance's log.
    fn lines(&self, needle: &str) -> usize {
        self.cluster.instances.iter().filter_map(|i| i.running.as_ref()).map(|r| r.log_lines(needle).len()).sum()
    }

    /// Waits until another instance than `old` leads, then has it accept a newer write on
    /// every resource (retried through the quarantine): after this, a write of `old` reaching
    /// the backend would come after a newer one.
    pub(crate) async fn newer_writes_elsewhere(&self, old: usize) -> bool {
        let deadline = Instant::now() + Duration::from_secs(15);
        let new = loop {
            if Instant::now() > deadline {
                return false;
            }
            if let Some(url) = self.cluster.leader_url().await
                && let Some(i) = (0..3).find(|i| *i != old && self.cluster.instances[*i].url() == url)
                && self.cluster.is_writer(i).await
            {
                break i;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        for resource in RESOURCES {
            loop {
                if Instant::now() > deadline {
                    return false;
                }
                let token = token(&self.counter);
                let status = put(self.cluster.instances[new].addr, resource, token, 0).await;
                self.outcomes.lock().unwrap().push(Outcome { resource, token, status });
                if status.is_some_and(|s| (200..300).contains(&s)) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        true
    }

    /// Every link whole, every instance and member running, every fail point off, and a leader
    /// serving.
    pub(crate) async fn heal(&mut self) {
        if let Some(net) = &self.net {
            net.heal_all();
        }
        // What the instances' logs named, before a restart replaces a log.
        self.crossings();
        let stopped: Vec<u32> = std::mem::take(&mut *self.cluster.instances[0].stopped.lock().unwrap());
        for pid in stopped {
            common::process::signal(pid, "CONT");
        }
        for i in 0..3 {
            if self.etcd.pid(i).is_none() {
                self.etcd.restart(i);
            }
        }
        self.etcd.wait_healthy().await;
        for i in 0..self.cluster.instances.len() {
            if self.cluster.instances[i].running.is_none() {
                tokio::task::block_in_place(|| {
                    self.cluster.instances[i].start();
                });
            }
            for name in ["upstream::before_head", "upstream::mid_body"] {
                self.cluster.failpoint(i, name, "off").await;
            }
            if self.unfenced {
                self.cluster.failpoint(i, "upstream::no_self_fence", "return").await;
            }
        }
        self.leader().await;
    }

    /// Arms `name` on the leader, waits for it to stop the leader, has another instance take
    /// over and accept newer writes on every resource, and lets the stalled leader go on.
    /// Counted when the leader was held past its lease while the newer writes were accepted.
    async fn stall_at(&mut self, name: &str) -> Option<String> {
        let leader = self.leader().await;
        let pid = self.cluster.instances[leader].proxy().pid();
        let passed = "failpoint passed";
        let before = self.cluster.instances[leader].proxy().log_lines(passed).len();
        // The leader can be the one a previous round's takeover is still settling: a round
        // whose fault could not be armed hit no window and is not counted.
        if !self.cluster.failpoint(leader, name, "1*return(400)").await {
            println!("{name} could not be armed on instance {leader}");
            return None;
        }
        let start = Instant::now();
        while !self.cluster.instances[0].stopped.lock().unwrap().contains(&pid) {
            if start.elapsed() > Duration::from_secs(5) {
                self.cluster.failpoint(leader, name, "off").await;
                return None;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let held = Instant::now();
        let newer = self.newer_writes_elsewhere(leader).await;
        // At least past the lease, however quick the takeover.
        if let Some(rest) = LEASE.checked_sub(held.elapsed()) {
            tokio::time::sleep(rest + Duration::from_millis(200)).await;
        }
        self.cluster.instances[0].stopped.lock().unwrap().retain(|p| *p != pid);
        common::process::signal(pid, "CONT");
        let proxy = self.cluster.instances[leader].proxy();
        proxy.wait_for_log(passed, before + 1).await;
        let line = proxy.log_lines(passed).get(before).cloned().unwrap_or_default();
        let stalled: u64 = line
            .split("stalled_ms=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        (newer && stalled >= LEASE.as_millis() as u64)
            .then(|| format!("{name}: the leader held {stalled} ms while another accepted newer writes"))
    }

    async fn inject(&mut self, fault: Fault, rng: &mut Rng) -> Option<String> {
        self.random_stop = fault == Fault::StopLeader;
        tokio::time::sleep(Duration::from_millis(200 + rng.below(500))).await;
        match fault {
            Fault::StallBeforeHead => self.stall_at("upstream::before_head").await,
            Fault::StallMidBody => self.stall_at("upstream::mid_body").await,
            Fault::KillLeader => {
                let leader = self.leader().await;
                // A write the backend applies after the next leader has taken over.
                let resource = RESOURCES[rng.below(RESOURCES.len() as u64) as usize];
                let (addr, late) = (self.cluster.instances[leader].addr, token(&self.counter));
                let outcomes = Arc::clone(&self.outcomes);
                tokio::spawn(async move {
                    let status = put(addr, resource, late, LATE_MS).await;
                    outcomes.lock().unwrap().push(Outcome { resource, token: late, status });
                });
                let start = Instant::now();
                while !self.cluster.backend.requests().iter().any(|r| r.path == resource && r.token() == Some(late)) {
                    if start.elapsed() > Duration::from_secs(5) {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                let marked = self.cluster.in_flight_in_etcd(resource).await;
                self.crossings();
                tokio::task::block_in_place(|| self.cluster.instances[leader].kill9());
                self.leader().await;
                marked.then(|| {
                    format!("kill -9 of the leader with a write to {resource} at the backend for {LATE_MS} ms")
                })
            }
            Fault::StopLeader => {
                let leader = self.leader().await;
                let pid = self.cluster.instances[leader].proxy().pid();
                common::process::signal(pid, "STOP");
                let held = Instant::now();
                let moved = self.newer_writes_elsewhere(leader).await;
                if let Some(rest) = LEASE.checked_sub(held.elapsed()) {
                    tokio::time::sleep(rest + Duration::from_millis(200)).await;
                }
                common::process::signal(pid, "CONT");
                // Woken, it still holds its old table: the clients' writes through it must be
                // refused or forwarded, never fenced against what it knew.
                moved.then(|| {
                    "SIGSTOP of the leader past its lease; another took over and accepted newer writes".to_owned()
                })
            }
            Fault::KillEtcdLeader => {
                let member = self.etcd.leader().await?;
                let before = self.lines(BARRIER);
                self.etcd.kill(member);
                tokio::time::sleep(Duration::from_millis(1500)).await;
                self.etcd.restart(member);
                let settled = self.lines(BARRIER) > before;
                settled.then(|| format!("kill -9 of etcd's leader (member {member}) with a batch under way"))
            }
            Fault::StopEtcdLeader => {
                let member = self.etcd.leader().await?;
                let pid = self.etcd.pid(member)?;
                common::process::signal(pid, "STOP");
                let start = Instant::now();
                let mut elected = false;
                while start.elapsed() < Duration::from_secs(5) && !elected {
                    elected = self.etcd.leader().await.is_some_and(|l| l != member);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                common::process::signal(pid, "CONT");
                elected.then(|| format!("SIGSTOP of etcd's leader (member {member}) past the election timeout"))
            }
        }
    }

    /// The checker, over the whole history.
    async fn check(&self) {
        let broken = self.violations().await;
        assert!(broken.is_empty(), "{}", broken.join("\n"));
    }

    /// What the whole history breaks: per resource the backend applied tokens in strictly
    /// increasing order, every acknowledged write was applied, and etcd's `max_seen` is at or
    /// above every acknowledged token.
    ///
    /// A write applied after a newer one on its resource (a late write) crossed the window no
    /// proxy closes when its instance said the backend answered it after the permission to send
    /// it lapsed, at least [`CROSSING_HELD`] after its last passed check, and the first newer
    /// write came at least that long after the check too ([`crossed_window`]): its check passed
    /// before the instance was stopped, it went out on waking, and the next leader kept the
    /// quarantine. Where `tolerate_window` says so, a late write that crossed in a round of a
    /// random SIGSTOP is tolerated (and printed); any other late write breaks the order, and the
    /// break says which of its late writes crossed.
    pub(crate) async fn violations(&self) -> Vec<String> {
        let applied = self.cluster.backend.applied();
        let outcomes = self.outcomes.lock().unwrap().clone();
        let mut broken = Vec::new();
        // Per resource, the tokens the backend applied and when, in its order.
        let mut arrivals: BTreeMap<&str, Vec<(u64, Instant)>> = BTreeMap::new();
        for r in &applied {
            if let (Some(resource), Some(token)) = (RESOURCES.iter().find(|x| **x == r.path), r.token()) {
                arrivals.entry(resource).or_default().push((token, r.at));
            }
        }
        // A late write's warning comes as the backend answers it: its log line may trail.
        let late: BTreeMap<&str, Vec<(u64, Instant, Instant)>> =
            arrivals.iter().map(|(resource, applied)| (*resource, late_arrivals(applied))).collect();
        let named = |crossings: &BTreeMap<(String, u64), (u64, u64)>| {
            late.iter()
                .all(|(resource, ts)| ts.iter().all(|(t, ..)| crossings.contains_key(&(resource.to_string(), *t))))
        };
        let mut crossings = self.crossings();
        for _ in 0..20 {
            if named(&crossings) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            crossings = self.crossings();
        }
        let mut tolerated = self.tolerated.lock().unwrap().clone();
        for (resource, applied) in &arrivals {
            let (mut said, mut unexplained) = (Vec::new(), Vec::new());
            for &(t, at, newer) in &late[resource] {
                let key = (resource.to_string(), t);
                let named = crossings.get(&key).copied();
                let after = at.duration_since(newer).as_millis();
                said.push(match named {
                    Some((held, checks)) => format!(
                        "{t}: named, held {held} ms after the last of {checks} passed checks, applied {after} ms \
                         after the first newer write"
                    ),
                    None => format!("{t}: not named"),
                });
                let crossed =
                    named.is_some_and(|(held, checks)| crossed_window(Duration::from_millis(held), checks, at, newer));
                if tolerated.contains(&key) {
                    continue;
                }
                if self.tolerate_window && self.random_stop && crossed {
                    println!("{resource}: late write {t} crossed the window no proxy closes ({said:?})");
                    tolerated.insert(key);
                    continue;
                }
                unexplained.push(t);
            }
            if !unexplained.is_empty() {
                let tokens: Vec<u64> = applied.iter().map(|&(t, _)| t).collect();
                broken.push(format!(
                    "{resource}: the backend applied {tokens:?}, not in increasing order; late writes: {said:?}"
                ));
            }
        }
        *self.tolerated.lock().unwrap() = tolerated;
        for o in outcomes.iter().filter(|o| acked(o)) {
            if !arrivals.get(o.resource).is_some_and(|applied| applied.iter().any(|&(t, _)| t == o.token)) {
                broken.push(format!("{} token {} was acknowledged but never applied", o.resource, o.token));
            }
        }
        for resource in RESOURCES {
            if let Some(acked) = outcomes.iter().filter(|o| o.resource == resource && acked(o)).map(|o| o.token).max() {
                let in_etcd = self.cluster.max_seen_in_etcd(resource).await.unwrap_or(0);
                if in_etcd < acked {
                    broken.push(format!("{resource}: etcd holds max_seen {in_etcd} below the acknowledged {acked}"));
                }
            }
        }
        broken
    }

    /// The crossings every running instance's log names, with those named before.
    fn crossings(&self) -> BTreeMap<(String, u64), (u64, u64)> {
        let mut known = self.crossings.lock().unwrap();
        for running in self.cluster.instances.iter().filter_map(|i| i.running.as_ref()) {
            for line in running.log_lines(CROSSING) {
                let field = |name: &str| line.split(&format!(" {name}=")).nth(1)?.split_whitespace().next();
                let number = |name: &str| field(name).and_then(|n| n.parse::<u64>().ok());
                if let (Some(path), Some(token), Some(held), Some(checks)) =
                    (field("path"), number("token"), number("held_ms"), number("checks"))
                {
                    known.insert((path.to_owned(), token), (held, checks));
                }
            }
        }
        known.clone()
    }

    /// After a forced takeover, the highest acknowledged token of each resource is refused as
    /// stale through every instance: the new leader's fence remembers what was acknowledged.
    async fn probe_after_takeover(&mut self) {
        let leader = self.leader().await;
        self.crossings();
        tokio::task::block_in_place(|| self.cluster.instances[leader].kill9());
        self.heal().await;
        let outcomes = self.outcomes.lock().unwrap().clone();
        for resource in RESOURCES {
            let Some(top) = outcomes.iter().filter(|o| o.resource == resource && acked(o)).map(|o| o.token).max()
            else {
                continue;
            };
            for i in 0..3 {
                let addr = self.cluster.instances[i].addr;
                eventually("a stale write is refused, once the quarantine is over", async || {
                    let head = format!("PUT {resource} HTTP/1.1\r\nHost: x\r\nFencing-Token: {top}");
                    let r = raw_request(addr, &head, "stale").await;
                    assert!(
                        !(200..300).contains(&r.status),
                        "{resource} accepted the stale token {top} through instance {i}"
                    );
                    r.status == 409
                })
                .await;
            }
        }
    }
}

/// Which faults a run injects, and how the instances run.
struct Run {
    faults: &'static [Fault],
    /// Appended to each instance's config.
    extra: &'static str,
    /// The self-fence off (`upstream::no_self_fence`).
    unfenced: bool,
    /// Counted rounds.
    wanted: usize,
    /// Whether every round's history is checked at once (otherwise only returned at the end).
    checked: bool,
    /// Whether order breaks that crossed the window no proxy closes are tolerated.
    tolerate_window: bool,
}

/// Runs `run`'s rounds on a fresh cluster; returns what the history breaks, and the counted
/// rounds by the window they hit.
async fn rounds(etcd: EtcdCluster, run: Run, seed: u64) -> (Vec<String>, BTreeMap<String, usize>) {
    let Run { faults, extra, unfenced, wanted, checked, tolerate_window } = run;
    let cluster = Cluster::build_with(&etcd.urls(), 3, QUARANTINE, extra).await;
    let mut world = World::start(cluster, etcd, unfenced, None).await;
    world.tolerate_window = tolerate_window;
    run_rounds(world, faults, wanted, checked, seed).await
}

impl World {
    /// Initialises the fence of `cluster`, starts every instance, and waits for a leader.
    pub(crate) async fn start(cluster: Cluster, etcd: EtcdCluster, unfenced: bool, net: Option<Arc<Net>>) -> World {
        cluster.init().await;
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let counter = Arc::new(AtomicU64::new(0));
        let mut world = World {
            cluster,
            etcd,
            counter,
            outcomes,
            unfenced,
            net,
            tolerate_window: false,
            random_stop: false,
            crossings: Mutex::default(),
            tolerated: Mutex::default(),
        };
        for i in 0..world.cluster.instances.len() {
            tokio::task::block_in_place(|| {
                world.cluster.instances[i].start();
            });
        }
        world.heal().await;
        world
    }
}

/// Runs counted rounds of `faults` on `world` under clients' load (each round one fault, then
/// everything healed); returns what the history breaks, and the counted rounds by the window
/// they hit. `checked`: the history is checked after every round, and by a stale write to every
/// resource after a forced takeover at the end.
pub(crate) async fn run_rounds<F: Inject>(
    mut world: World,
    faults: &[F],
    wanted: usize,
    checked: bool,
    seed: u64,
) -> (Vec<String>, BTreeMap<String, usize>) {
    println!("fault rounds: seed {seed} (FG_SEED={seed} replays the faults), {wanted} counted rounds");
    let (mut counted, mut round) = (0, 0u64);
    let mut hits: BTreeMap<String, usize> = BTreeMap::new();
    while counted < wanted {
        assert!(round < (wanted as u64) * 4 + 10, "only {counted} of {round} rounds hit their window");
        let round_seed = seed.wrapping_add(round.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut rng = Rng::new(round_seed);
        let fault = faults[rng.below(faults.len() as u64) as usize];
        let stop = Arc::new(AtomicBool::new(false));
        let clients = load(&world, round_seed, Arc::clone(&stop));
        let window = fault.inject(&mut world, &mut rng).await;
        // The clients go on past the fault's end, so that what was held up meets newer writes.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        stop.store(true, Ordering::SeqCst);
        let _ = clients.await;
        world.heal().await;
        if checked {
            world.check().await;
        }
        // Only the round of the fault: later late writes are judged on their own round.
        world.random_stop = false;
        match &window {
            Some(w) => {
                counted += 1;
                *hits.entry(format!("{fault:?}")).or_default() += 1;
                println!("round {round} (seed {round_seed}): {w}");
            }
            None => println!("round {round} (seed {round_seed}): {fault:?} hit no window; not counted"),
        }
        round += 1;
    }
    if checked {
        world.probe_after_takeover().await;
    }
    let broken = world.violations().await;
    let outcomes = world.outcomes.lock().unwrap().clone();
    let acked = outcomes.iter().filter(|o| acked(o)).count();
    println!("{counted} counted rounds of {round}: {hits:?}; {} writes, {acked} acknowledged", outcomes.len());
    assert!(acked >= counted, "too few writes were acknowledged ({acked}) for the rounds to mean anything");
    (broken, hits)
}

pub(crate) fn seed() -> u64 {
    std::env::var("FG_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    })
}

pub(crate) fn wanted(var: &str, default: usize) -> usize {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_never_break_the_order_across_instances() {
    let Some(etcd) = start_etcd_cluster().await else { return };
    let run = Run {
        faults: &FAULTS,
        extra: "",
        unfenced: false,
        wanted: wanted("FG_CLUSTER_ROUNDS", DEFAULT_ROUNDS),
        checked: true,
        tolerate_window: true,
    };
    let (broken, _) = rounds(etcd, run, seed()).await;
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// Pins (docs/pins.md) on a backend that honours preconditions: with the self-fence turned off,
/// a leader stalled past its lease that wakes and sends is refused by the backend itself, since
/// another leader's newer write changed the resource. Without pins the same stall rounds break
/// the order, which shows the rounds reach the window. Rounds: `FG_CLUSTER_PIN_ROUNDS` (2 by
/// default), the stall faults only, and every fault kind once more with pins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pins_keep_a_stalled_leaders_write_out_without_the_self_fence() {
    const STALLS: [Fault; 2] = [Fault::StallBeforeHead, Fault::StallMidBody];
    const PINNED: &str = "[[fence.rules]]\nprefix = \"/\"\npin = \"etag\"\n";
    let n = wanted("FG_CLUSTER_PIN_ROUNDS", 2);
    let Some(etcd) = start_etcd_cluster().await else { return };
    let unpinned =
        Run { faults: &STALLS, extra: "", unfenced: true, wanted: n, checked: false, tolerate_window: false };
    let (broken, _) = rounds(etcd, unpinned, seed()).await;
    assert!(
        broken.iter().any(|b| b.contains("not in increasing order")),
        "without the self-fence and without pins, a stalled leader's write must land out of order: {broken:?}"
    );
    // The instance saw each of those writes end after its lease lapsed, and said so (from
    // when it let the write go: with the self-fence off no check passes, and a write whose
    // advance committed while the leader was stopped is let go only on waking).
    assert!(!broken.iter().any(|b| b.contains("not named")), "{broken:?}");
    let Some(etcd) = start_etcd_cluster().await else { return };
    let pinned =
        Run { faults: &STALLS, extra: PINNED, unfenced: true, wanted: n, checked: true, tolerate_window: false };
    let (broken, _) = rounds(etcd, pinned, seed()).await;
    assert!(broken.is_empty(), "{}", broken.join("\n"));
    let Some(etcd) = start_etcd_cluster().await else { return };
    let every =
        Run { faults: &FAULTS, extra: PINNED, unfenced: true, wanted: n, checked: true, tolerate_window: false };
    let (broken, _) = rounds(etcd, every, seed()).await;
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

#[test]
fn a_late_write_crossed_the_window_only_behind_a_kept_quarantine() {
    let check = Instant::now();
    let ms = Duration::from_millis;
    // Checked at 0, stopped, woken at 8 s: applied at 8 s, after a newer write the next leader
    // sent at 7 s (its takeover past the lease, then the quarantine).
    let late = check + ms(8_000);
    assert!(crossed_window(ms(8_000), 3, late, check + ms(7_000)));
    // The same late write behind a newer write sent 2 s after the check: the next leader did
    // not keep the quarantine, however long the late write was held.
    assert!(!crossed_window(ms(8_000), 3, late, check + ms(2_000)));
    // Held less than the window, or never checked: a lease or a check that failed.
    assert!(!crossed_window(ms(5_000), 3, check + ms(5_000), check + ms(4_500)));
    assert!(!crossed_window(ms(8_000), 0, late, check + ms(7_000)));
}

#[test]
fn late_writes_are_found_behind_the_first_higher_token() {
    let t0 = Instant::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let applied = [(1, at(0)), (5, at(1)), (3, at(2)), (7, at(3)), (5, at(4)), (6, at(5)), (8, at(6))];
    assert_eq!(late_arrivals(&applied), [(3, at(2), at(1)), (5, at(4), at(3)), (6, at(5), at(3))]);
    // A token sent again at the top is not late; below it, it is, behind its first arrival.
    let applied = [(7, at(0)), (7, at(1)), (5, at(2)), (9, at(3)), (7, at(4))];
    assert_eq!(late_arrivals(&applied), [(5, at(2), at(0)), (7, at(4), at(3))]);
}
