//! Fault rounds against the shared fence: a three-member etcd, three fencegate instances in
//! front of one recording backend, clients writing to a handful of resources through random
//! instances with tokens from one shared counter. Each round injects one fault, seeded and
//! replayable, in a window that matters:
//!
//! - a leader stopped (SIGSTOP) past its lease between the commit of its advance and the
//!   request head, or between the head and the body, placed with fail points (the `failpoints`
//!   feature: a fail point logs that it was reached and waits, and the test stops the process
//!   on that line);
//! - `kill -9` of the leader with writes in flight, and SIGSTOP of the leader at a random
//!   moment past its lease;
//! - `kill -9` of etcd's leader, SIGSTOP of an etcd member past the election timeout;
//! - a slow backend.
//!
//! Each round says which window its fault hit, and rounds that hit none do not count. After
//! each round the checker reads the whole history: per resource the backend applied tokens in
//! strictly increasing order (so no token at or below an acknowledged `max_seen` was applied
//! after it), every acknowledged write was applied, and etcd's `max_seen` is at or above every
//! acknowledged token.
//!
//! `FG_CLUSTER_ROUNDS` (default 10) counted rounds; `FG_SEED` replays a run (each round's seed
//! is printed). Skipped with a message where etcd is not installed; `FG_REQUIRE_SERVICES=1`
//! makes that a failure.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::etcd_cluster::{EtcdCluster, start_etcd_cluster};
use common::process::signal;
use common::{eventually, raw_request, try_raw_request};

const RESOURCES: [&str; 3] = ["/r0", "/r1", "/r2"];
const ADMIN_TOKEN: &str = "an-admin-token-for-the-fault-rounds";
/// The instances' lease (`store.lease_ttl` in `common::cluster`).
const LEASE: Duration = Duration::from_secs(3);
/// How long clients write in a round.
const LOAD: Duration = Duration::from_millis(2500);
const CLIENTS: usize = 4;

/// A small, seedable generator (xorshift64*): a round replays from its seed alone.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    StallBeforeHead,
    StallMidBody,
    KillLeader,
    StopLeader,
    KillEtcdLeader,
    StopEtcdMember,
    SlowBackend,
}

const FAULTS: [Fault; 7] = [
    Fault::StallBeforeHead,
    Fault::StallMidBody,
    Fault::KillLeader,
    Fault::StopLeader,
    Fault::KillEtcdLeader,
    Fault::StopEtcdMember,
    Fault::SlowBackend,
];

/// One write as a client saw it.
#[derive(Debug, Clone)]
struct Outcome {
    resource: &'static str,
    token: u64,
    status: Option<u16>,
}

/// What the clients of every round have seen.
#[derive(Default)]
struct History {
    outcomes: Mutex<Vec<Outcome>>,
}

struct World {
    etcd: EtcdCluster,
    cluster: Cluster,
    admins: Vec<Option<SocketAddr>>,
    counter: Arc<AtomicU64>,
    history: Arc<History>,
}

impl World {
    async fn admin(&mut self, i: usize) -> SocketAddr {
        if self.admins[i].is_none() {
            self.admins[i] = Some(self.cluster.instances[i].proxy().admin_addr().await);
        }
        self.admins[i].unwrap()
    }

    /// The running instance that leads, once one does.
    async fn leader(&self) -> usize {
        self.cluster.wait_leader().await
    }

    /// Every instance running and the cluster serving fenced writes again.
    async fn heal(&mut self) {
        let stopped: Vec<u32> = std::mem::take(&mut *self.cluster.instances[0].stopped.lock().unwrap());
        for pid in stopped {
            signal(pid, "CONT");
        }
        for i in 0..self.cluster.instances.len() {
            if self.cluster.instances[i].running.is_none() {
                self.cluster.instances[i].start();
                self.admins[i] = None;
            }
        }
        for i in 0..3 {
            if self.etcd.pid(i).is_none() {
                self.etcd.restart(i);
            }
        }
        self.leader().await;
    }
}

/// Clients writing for `LOAD`: random resource, the next token of the shared counter, a random
/// instance; `slow` adds a backend delay to every write.
fn load(world: &World, seed: u64, slow: bool) -> tokio::task::JoinHandle<()> {
    let addrs: Vec<SocketAddr> = world.cluster.instances.iter().map(|i| i.addr).collect();
    let (counter, history) = (Arc::clone(&world.counter), Arc::clone(&world.history));
    tokio::spawn(async move {
        let until = Instant::now() + LOAD;
        let mut clients = Vec::new();
        for c in 0..CLIENTS {
            let (addrs, counter, history) = (addrs.clone(), Arc::clone(&counter), Arc::clone(&history));
            let mut rng = Rng::new(seed ^ (c as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            clients.push(tokio::spawn(async move {
                while Instant::now() < until {
                    let resource = RESOURCES[rng.below(RESOURCES.len() as u64) as usize];
                    let token = counter.fetch_add(1, Ordering::SeqCst) + 1;
                    let addr = addrs[rng.below(addrs.len() as u64) as usize];
                    let delay = if slow || rng.below(4) == 0 { "\r\nx-memstore-delay-ms: 150" } else { "" };
                    let head = format!("PUT {resource} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}{delay}");
                    let body = "v".repeat(64);
                    let answer =
                        tokio::time::timeout(Duration::from_secs(15), try_raw_request(addr, &head, &body)).await;
                    let status = answer.ok().flatten().map(|r| r.status);
                    history.outcomes.lock().unwrap().push(Outcome { resource, token, status });
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

/// Sets `name` on the leader, waits for the fail point to stop it, holds it past its lease
/// while another instance takes over, and lets it go. Counted when it was held up past its lease.
async fn stall_at(world: &mut World, name: &str) -> Option<String> {
    let leader = world.leader().await;
    let admin = world.admin(leader).await;
    let body = "1*return(400)";
    let head = format!(
        "PUT /failpoints/{name} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: {}",
        body.len()
    );
    assert_eq!(raw_request(admin, &head, body).await.status, 200);
    let pid = world.cluster.instances[leader].proxy().pid();
    let start = Instant::now();
    while !world.cluster.instances[0].stopped.lock().unwrap().contains(&pid) {
        if start.elapsed() > LOAD {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Past the lease, and until another instance has taken over.
    tokio::time::sleep(LEASE + Duration::from_millis(500)).await;
    let others: Vec<usize> = (0..3).filter(|i| *i != leader).collect();
    let taken = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(url) = world.cluster.leader_url().await
                && others.iter().any(|i| world.cluster.instances[*i].url() == url)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .is_ok();
    world.cluster.instances[0].stopped.lock().unwrap().retain(|p| *p != pid);
    signal(pid, "CONT");
    let passed = "failpoint passed";
    eventually("the stalled leader goes on", async || world.cluster.instances[leader].proxy().log_contains(passed))
        .await;
    let line = world.cluster.instances[leader].proxy().log_lines(passed).pop().unwrap_or_default();
    let stalled: u64 = line
        .split("stalled_ms=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (taken && stalled >= LEASE.as_millis() as u64)
        .then(|| format!("{name}: the leader held {stalled} ms, another took over"))
}

async fn inject(world: &mut World, fault: Fault, rng: &mut Rng) -> Option<String> {
    tokio::time::sleep(Duration::from_millis(200 + rng.below(500))).await;
    match fault {
        Fault::StallBeforeHead => stall_at(world, "upstream::before_head").await,
        Fault::StallMidBody => stall_at(world, "upstream::mid_body").await,
        Fault::KillLeader => {
            let leader = world.leader().await;
            let seen = "in flight when fencegate stopped or stepped down";
            let before: usize = world
                .cluster
                .instances
                .iter()
                .filter_map(|i| i.running.as_ref())
                .map(|r| r.log_lines(seen).len())
                .sum();
            world.cluster.instances[leader].kill9();
            let next = world.leader().await;
            let after = world.cluster.instances[next].proxy().log_lines(seen).len();
            (after > before || after > 0).then(|| "kill -9 of the leader with writes in flight".to_owned())
        }
        Fault::StopLeader => {
            let leader = world.leader().await;
            let pid = world.cluster.instances[leader].proxy().pid();
            signal(pid, "STOP");
            tokio::time::sleep(LEASE + Duration::from_millis(700)).await;
            let moved = world.cluster.leader_url().await.is_some_and(|u| u != world.cluster.instances[leader].url());
            signal(pid, "CONT");
            moved.then(|| "SIGSTOP of the leader past its lease; another took over".to_owned())
        }
        Fault::KillEtcdLeader => {
            let member = world.etcd.leader().await?;
            world.etcd.kill(member);
            tokio::time::sleep(Duration::from_millis(1500)).await;
            world.etcd.restart(member);
            Some(format!("kill -9 of etcd's leader (member {member})"))
        }
        Fault::StopEtcdMember => {
            let member = rng.below(3) as usize;
            let leader = world.etcd.leader().await;
            let pid = world.etcd.pid(member)?;
            signal(pid, "STOP");
            tokio::time::sleep(Duration::from_millis(1500)).await;
            signal(pid, "CONT");
            let role = if leader == Some(member) { "leader" } else { "follower" };
            Some(format!("SIGSTOP of etcd member {member} ({role}) past the election timeout"))
        }
        Fault::SlowBackend => Some("a slow backend (150 ms per write)".to_owned()),
    }
}

/// The checker, over the whole history.
async fn check(world: &World) {
    let applied = world.cluster.backend.applied();
    let outcomes = world.history.outcomes.lock().unwrap().clone();
    let mut order: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for r in &applied {
        if let Some(token) = r.token() {
            order.entry(RESOURCES.iter().find(|x| **x == r.path).copied().unwrap_or("other")).or_default().push(token);
        }
    }
    for (resource, tokens) in &order {
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "{resource}: the backend applied {tokens:?}, not in increasing order"
        );
    }
    for o in outcomes.iter().filter(|o| o.status.is_some_and(|s| (200..300).contains(&s))) {
        let tokens = order.get(o.resource).map(Vec::as_slice).unwrap_or_default();
        assert!(tokens.contains(&o.token), "{} token {} was acknowledged but never applied", o.resource, o.token);
    }
    for resource in RESOURCES {
        let acked = outcomes
            .iter()
            .filter(|o| o.resource == resource && o.status.is_some_and(|s| (200..300).contains(&s)))
            .map(|o| o.token)
            .max();
        if let Some(acked) = acked {
            let in_etcd = world.cluster.max_seen_in_etcd(resource).await.unwrap_or(0);
            assert!(in_etcd >= acked, "{resource}: etcd holds max_seen {in_etcd} below the acknowledged {acked}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_never_break_the_order_across_instances() {
    let Some(etcd) = start_etcd_cluster().await else { return };
    let wanted: usize = std::env::var("FG_CLUSTER_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let seed: u64 = std::env::var("FG_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    println!("cluster fault rounds: seed {seed} (FG_SEED={seed} replays them), {wanted} counted rounds");
    let extra = format!("[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"{ADMIN_TOKEN}\"\n");
    let cluster = Cluster::start(&etcd.urls(), 3, &extra).await;
    let mut world = World {
        etcd,
        cluster,
        admins: vec![None; 3],
        counter: Arc::new(AtomicU64::new(0)),
        history: Arc::new(History::default()),
    };
    world.leader().await;
    let (mut counted, mut round) = (0, 0u64);
    let mut hits: BTreeMap<String, usize> = BTreeMap::new();
    while counted < wanted {
        assert!(round < (wanted as u64) * 3 + 5, "only {counted} of {round} rounds hit their window");
        let round_seed = seed.wrapping_add(round.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut rng = Rng::new(round_seed);
        let fault = FAULTS[rng.below(FAULTS.len() as u64) as usize];
        let clients = load(&world, round_seed, fault == Fault::SlowBackend);
        let window = inject(&mut world, fault, &mut rng).await;
        let _ = clients.await;
        world.heal().await;
        check(&world).await;
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
    let outcomes = world.history.outcomes.lock().unwrap().clone();
    let acked = outcomes.iter().filter(|o| o.status.is_some_and(|s| (200..300).contains(&s))).count();
    println!("{counted} counted rounds of {round}: {hits:?}; {} writes, {acked} acknowledged", outcomes.len());
    assert!(acked >= counted, "too few writes were acknowledged ({acked}) for the rounds to mean anything");
}
