//! Network partitions against the shared fence: the cluster fault rounds' world (three
//! fencegate instances, a three-member etcd, one recording backend, clients writing through
//! random instances with tokens from one counter) on a network of namespaces the test makes
//! (`common::netns`): each instance and each etcd member in a namespace of its own, joined by
//! veth pairs to a bridge in a hub namespace, where the test's threads, its backend and its
//! clients live. The processes keep running through every fault; only their links fail, so a
//! cut-off leader's clock goes on, unlike under SIGSTOP.
//!
//! Each round places a write of the leader in flight and then cuts, seeded:
//!
//! - the leader from etcd, not from the backend, both ways (`EtcdCut`), only what it sends
//!   (`LeaderToEtcd`), only what it receives (`EtcdToLeader`); its write's advance is committed
//!   and its body only half sent, the client sends the rest once another instance has taken
//!   over and accepted a newer write on every resource: the zombie must not deliver it;
//! - the leader and one etcd member from the other two members and the other instances
//!   (`Minority`), the same write held;
//! - a slow link on the leader (`Delay`: a token bucket of 6–13 kbit/s with a queue of
//!   2.5–4.5 s, `tc tbf`, since this kernel has no `netem`), counted only when a connect to the
//!   leader took longer than the lease margin, the same write held;
//! - the leader's whole link cut and restored at random (`Flap`), the same write held;
//! - the leader from the backend, not from etcd (`BackendCut`), for 1.6–4 s while the backend
//!   holds one of its writes for 1.5 s, so that the answer is lost in the cut and what the
//!   clients send meanwhile waits.
//!
//! A round counts when its fault hit its window: for the held write, another instance took
//! over and accepted newer writes on every resource while the old leader, still running, held
//! a forwarded write; for `BackendCut`, the backend had the write when the cut began. The
//! checker is the cluster fault rounds' (`cluster_faults::World::violations`). Without the
//! self-fence the `EtcdCut` rounds break the order, which shows they reach the window.
//!
//! Two single tests show the kernel's retransmissions bounded within the quarantine
//! (`TCP_USER_TIMEOUT` on backend connections): an abandoned write on one instance, and a
//! cut-off leader's after a takeover.
//!
//! [`DEFAULT_ROUNDS`] counted rounds (about 12 s each), or `FG_PARTITION_ROUNDS` (`.ci/run`
//! sets 6), of every kind or only `FG_PARTITION_FAULT`'s; `FG_SEED` replays the choice and
//! placement of faults (the processes' own interleavings are not replayed). Skipped with a message without
//! root, `ip`, `tc`, `nft` or etcd; `FG_REQUIRE_SERVICES=1` makes that a failure.

use crate::cluster_faults::{
    Inject, LEASE, Outcome, QUARANTINE, RESOURCES, World, put, run_rounds, seed, token, wanted,
};
use crate::common;

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::RawConn;
use common::cluster::{Cluster, Place};
use common::etcd_cluster::start_placed;
use common::netns::{Net, Peer, Way};
use common::rng::Rng;
use fencegate::demo::MemBackend;

/// Counted rounds without `FG_PARTITION_ROUNDS`: a local `cargo test` runs a few.
const DEFAULT_ROUNDS: usize = 3;
/// The instances' `store.lease_margin` (`common::cluster`).
const MARGIN: Duration = Duration::from_secs(1);
const INSTANCES: [&str; 3] = ["fg0", "fg1", "fg2"];
const MEMBERS: [&str; 3] = ["e0", "e1", "e2"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Partition {
    EtcdCut,
    LeaderToEtcd,
    EtcdToLeader,
    Minority,
    Delay,
    Flap,
    BackendCut,
}

/// Every kind, or only `FG_PARTITION_FAULT` (a kind's name) to soak one.
fn cuts() -> Vec<Partition> {
    let only = std::env::var("FG_PARTITION_FAULT").ok();
    let chosen: Vec<Partition> =
        PARTITIONS.into_iter().filter(|c| only.as_ref().is_none_or(|o| *o == format!("{c:?}"))).collect();
    assert!(!chosen.is_empty(), "FG_PARTITION_FAULT={only:?} names none of {PARTITIONS:?}");
    chosen
}

const PARTITIONS: [Partition; 7] = [
    Partition::EtcdCut,
    Partition::LeaderToEtcd,
    Partition::EtcdToLeader,
    Partition::Minority,
    Partition::Delay,
    Partition::Flap,
    Partition::BackendCut,
];

/// One PUT of `token` to `resource` at `addr` whose body's second half is sent only once
/// `release` fires (or is dropped).
async fn put_held(
    addr: SocketAddr,
    resource: &str,
    token: u64,
    release: tokio::sync::oneshot::Receiver<()>,
) -> Option<u16> {
    let body = "h".repeat(64);
    let head = format!(
        "PUT {resource} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    let mut conn = RawConn::try_open(addr).await?;
    if !conn.try_send(format!("{head}{}", &body[..32])).await {
        return None;
    }
    let _ = release.await;
    if !conn.try_send(&body[32..]).await {
        return None;
    }
    tokio::time::timeout(Duration::from_secs(20), conn.try_read_response()).await.ok().flatten().map(|r| r.status)
}

impl Inject for Partition {
    async fn inject(self, world: &mut World, rng: &mut Rng) -> Option<String> {
        tokio::time::sleep(Duration::from_millis(200 + rng.below(500))).await;
        match self {
            Partition::BackendCut => backend_cut(world, rng).await,
            _ => held(world, self, rng).await,
        }
    }
}

fn net(world: &World) -> Arc<Net> {
    Arc::clone(world.net.as_ref().expect("the partition rounds run on a network of namespaces"))
}

/// The addresses of every etcd member.
fn members(net: &Net) -> Vec<Ipv4Addr> {
    MEMBERS.iter().map(|m| net.addr(m)).collect()
}

/// A thread cutting and restoring `name`'s whole link at random until `stop`; it ends with the
/// link restored.
fn flap(net: Arc<Net>, name: &'static str, mut rng: Rng, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mut cuts = 0;
        while !stop.load(Ordering::SeqCst) {
            net.cut(name, &Peer::All, Way::Both);
            cuts += 1;
            std::thread::sleep(Duration::from_millis(400 + rng.below(1100)));
            net.heal(name);
            std::thread::sleep(Duration::from_millis(100 + rng.below(500)));
        }
        cuts
    })
}

/// Applies `cut` to instance `leader` (not `BackendCut`); returns how it was placed and, for
/// `Flap`, the flapping thread and the flag that stops it.
fn apply(net: &Arc<Net>, cut: Partition, leader: usize, rng: &mut Rng) -> (String, Option<Flapping>) {
    let name = INSTANCES[leader];
    match cut {
        Partition::EtcdCut => net.cut(name, &Peer::Hosts(members(net)), Way::Both),
        Partition::LeaderToEtcd => net.cut(name, &Peer::Hosts(members(net)), Way::Out),
        Partition::EtcdToLeader => net.cut(name, &Peer::Hosts(members(net)), Way::In),
        Partition::Minority => {
            let with = rng.below(3) as usize;
            let mut others: Vec<Ipv4Addr> = (0..3).filter(|m| *m != with).map(|m| net.addr(MEMBERS[m])).collect();
            others.extend((0..3).filter(|i| *i != leader).map(|i| net.addr(INSTANCES[i])));
            net.cut(name, &Peer::Hosts(others.clone()), Way::Both);
            net.cut(MEMBERS[with], &Peer::Hosts(others), Way::Both);
            return (format!("with etcd member {with}"), None);
        }
        Partition::Delay => {
            let (kbit, queue_ms) = (6 + rng.below(8), 2500 + rng.below(2000));
            net.slow(name, kbit, queue_ms);
            return (format!("({kbit} kbit/s, queue up to {queue_ms} ms)"), None);
        }
        Partition::Flap => {
            let stop = Arc::new(AtomicBool::new(false));
            let thread = flap(Arc::clone(net), name, Rng::new(rng.next()), Arc::clone(&stop));
            return (String::new(), Some((stop, thread)));
        }
        Partition::BackendCut => unreachable!("placed by backend_cut"),
    }
    (String::new(), None)
}

/// The slowest TCP connect to `addr` (a round trip through its link) of one every 300 ms while
/// `probing`; one that never completes counts as 5 s.
async fn slowest_connect(addr: SocketAddr, probing: Arc<AtomicBool>) -> Duration {
    let mut slowest = Duration::ZERO;
    while probing.load(Ordering::SeqCst) {
        let start = Instant::now();
        let connected = tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(addr)).await;
        let took = if matches!(connected, Ok(Ok(_))) { start.elapsed() } else { Duration::from_secs(5) };
        slowest = slowest.max(took);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    slowest
}

type Flapping = (Arc<AtomicBool>, std::thread::JoinHandle<usize>);

/// A write of the leader forwarded with half its body, then `cut`; the client sends the rest
/// once another instance took over and accepted newer writes on every resource (or the
/// takeover did not come), with the cut still in place.
async fn held(world: &mut World, cut: Partition, rng: &mut Rng) -> Option<String> {
    let leader = world.leader().await;
    let resource = RESOURCES[rng.below(RESOURCES.len() as u64) as usize];
    let (addr, held) = (world.cluster.instances[leader].addr, token(&world.counter));
    let (release, released) = tokio::sync::oneshot::channel();
    let outcomes = Arc::clone(&world.outcomes);
    let writer = tokio::spawn(async move {
        let status = put_held(addr, resource, held, released).await;
        outcomes.lock().unwrap().push(Outcome { resource, token: held, status });
        status
    });
    // Forwarded: its advance and marker committed, its head and half its body on their way.
    let start = Instant::now();
    while world.cluster.in_flight_token(resource).await != Some(held) {
        if start.elapsed() > Duration::from_secs(5) || writer.is_finished() {
            let _ = release.send(());
            let _ = writer.await;
            println!("{cut:?}: the held write to {resource} was not forwarded");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let net = net(world);
    let (placed, flapping) = apply(&net, cut, leader, rng);
    let cut_at = Instant::now();
    let admin = world.cluster.instances[leader].proxy().admin_addr().await;
    let probing = Arc::new(AtomicBool::new(true));
    let probe = tokio::spawn(slowest_connect(admin, Arc::clone(&probing)));
    let moved = world.newer_writes_elsewhere(leader).await;
    probing.store(false, Ordering::SeqCst);
    let slowest = probe.await.unwrap_or_default();
    // Partition past its lease in any case, however quick the takeover.
    if let Some(rest) = LEASE.checked_sub(cut_at.elapsed()) {
        tokio::time::sleep(rest + Duration::from_millis(200)).await;
    }
    let _ = release.send(());
    let status = tokio::time::timeout(Duration::from_secs(25), writer).await.ok().and_then(Result::ok).flatten();
    let flaps = flapping.map(|(stop, thread)| {
        stop.store(true, Ordering::SeqCst);
        tokio::task::block_in_place(|| thread.join().unwrap())
    });
    let flaps = flaps.map(|n| format!(" ({n} cuts)")).unwrap_or_default();
    let held_ms = cut_at.elapsed().as_millis();
    let slowest_ms = slowest.as_millis();
    // A slow link counts only when it delayed the leader's packets beyond the lease margin.
    let delayed = cut != Partition::Delay || slowest > MARGIN;
    if !delayed {
        println!("{cut:?} {placed}: the slowest connect to the leader took {slowest_ms} ms, within the margin");
    }
    (moved && delayed).then(|| {
        let rtt = if cut == Partition::Delay {
            format!(" (connects to it took up to {slowest_ms} ms)")
        } else {
            String::new()
        };
        format!(
            "{cut:?} {placed}{flaps}: instance {leader} held {resource} token {held} for {held_ms} ms \
             while another took over and accepted newer writes{rtt}; it answered {status:?}"
        )
    })
}

/// A write of the leader held at the backend for 1.5 s, then the leader cut from the backend
/// (not from etcd) for 1.6–4 s: the answer is lost in the cut, and writes sent meanwhile wait.
async fn backend_cut(world: &mut World, rng: &mut Rng) -> Option<String> {
    const HELD_MS: u64 = 1500;
    let leader = world.leader().await;
    let resource = RESOURCES[rng.below(RESOURCES.len() as u64) as usize];
    let (addr, late) = (world.cluster.instances[leader].addr, token(&world.counter));
    let outcomes = Arc::clone(&world.outcomes);
    tokio::spawn(async move {
        let status = put(addr, resource, late, HELD_MS).await;
        outcomes.lock().unwrap().push(Outcome { resource, token: late, status });
    });
    let start = Instant::now();
    while !world.cluster.backend.requests().iter().any(|r| r.path == resource && r.token() == Some(late)) {
        if start.elapsed() > Duration::from_secs(5) {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let net = net(world);
    let backend = world.cluster.backend.addr();
    let std::net::IpAddr::V4(ip) = backend.ip() else { unreachable!("the backend is on the bridge") };
    let ms = HELD_MS + 100 + rng.below(2400);
    net.cut(INSTANCES[leader], &Peer::Service(ip, backend.port()), Way::Both);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    net.heal(INSTANCES[leader]);
    Some(format!(
        "BackendCut: instance {leader} cut from the backend for {ms} ms with {resource} token {late} held there"
    ))
}

/// The world on a fresh network: instance `i` at 10.77.0.1{i}, member `m` at 10.77.0.1{3+m},
/// the backend on the hub; `None` (skipped) without root, `ip`, `nft` or etcd. Run on a
/// runtime whose threads are in the hub ([`on_the_hub`]).
async fn partitioned_world(net: Arc<Net>, unfenced: bool) -> Option<World> {
    let at = |name: &str, port: u16| SocketAddr::new(net.addr(name).into(), port);
    let endpoints = MEMBERS.iter().map(|m| at(m, 2379)).collect();
    let peers = MEMBERS.iter().map(|m| at(m, 2380)).collect();
    let prefixes = MEMBERS.iter().map(|m| net.prefix(m)).collect();
    let etcd = start_placed(endpoints, peers, prefixes).await?;
    let backend = MemBackend::start_on(SocketAddr::new(net.hub_addr().into(), 0)).await.unwrap();
    let places =
        INSTANCES.iter().map(|i| Place { listen: at(i, 8080), admin: at(i, 9090), prefix: net.prefix(i) }).collect();
    let cluster = Cluster::build_placed(&etcd.urls(), places, backend, QUARANTINE, "");
    Some(World::start(cluster, etcd, unfenced, Some(net)).await)
}

/// Runs `body` on a runtime of two workers whose threads, and the calling one, are in the
/// hub of a new network (every socket the test opens is on the bridge); `None` where the
/// network cannot be made (skipped).
fn on_the_hub<T>(body: impl AsyncFnOnce(Arc<Net>) -> T) -> Option<T> {
    let net = Arc::new(Net::create(&[INSTANCES[0], INSTANCES[1], INSTANCES[2], MEMBERS[0], MEMBERS[1], MEMBERS[2]])?);
    let enter = net.enter_hub();
    enter();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_start(enter)
        .build()
        .unwrap();
    Some(runtime.block_on(body(net)))
}

#[test]
fn partitions_never_break_the_order_across_instances() {
    on_the_hub(async |net| {
        let Some(world) = partitioned_world(net, false).await else { return };
        let wanted = wanted("FG_PARTITION_ROUNDS", DEFAULT_ROUNDS);
        let (broken, _) = run_rounds(world, &cuts(), wanted, true, seed()).await;
        assert!(broken.is_empty(), "{}", broken.join("\n"));
    });
}

/// With the self-fence off (`upstream::no_self_fence`), a leader cut from etcd delivers its
/// held write after the new leader's newer ones: the rounds reach the window the self-fence
/// closes. One counted round.
#[test]
fn a_leader_cut_from_etcd_breaks_the_order_without_the_self_fence() {
    on_the_hub(async |net| {
        let Some(world) = partitioned_world(net, true).await else { return };
        let (broken, _) = run_rounds(world, &[Partition::EtcdCut], 1, false, seed()).await;
        assert!(
            broken.iter().any(|b| b.contains("not in increasing order")),
            "without the self-fence, a leader cut from etcd must deliver its held write out of order: {broken:?}"
        );
    });
}

/// A write whose bytes are cut off on the way to the backend, and then abandoned (its answer
/// does not come within `backend.request_timeout`, so its resource is quarantined), never
/// reaches the backend after the quarantine: the kernel stops retransmitting a backend
/// connection's bytes within it (`TCP_USER_TIMEOUT`). Without that bound Linux retransmits for
/// minutes, and the link's return delivers the abandoned write after newer ones (the soak's
/// violation in docs/faults.md). One instance, a file store; about 16 s.
#[test]
fn an_abandoned_writes_bytes_stop_travelling_within_its_quarantine() {
    let Some(net) = Net::create(&["fg"]) else { return };
    let enter = net.enter_hub();
    enter();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let backend = MemBackend::start_on(SocketAddr::new(net.hub_addr().into(), 0)).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        fencegate::app::init_data_dir(&data, 0).unwrap();
        let listen = SocketAddr::new(net.addr("fg").into(), 8080);
        let config = dir.path().join("fencegate.toml");
        let text = format!(
            "[server]\nlisten = \"{listen}\"\n[backend]\nurl = \"http://{}\"\nrequest_timeout = \"1s\"\n\
             [store]\ndir = \"{}\"\n[fence]\nquarantine = \"3s\"\n",
            backend.addr(),
            data.display()
        );
        std::fs::write(&config, text).unwrap();
        let mut cmd = net.command("fg", common::process::BIN);
        cmd.arg("run").arg("--config").arg(&config);
        let _proxy = common::process::Running::spawn(cmd);
        let put = async |token: u64| common::raw::put_response(listen, "/r", token).await.map(|r| r.status);
        assert!(put(1).await.is_some_and(|s| (200..300).contains(&s)), "the backend connection is open");
        // What fencegate sends the backend is dropped; the write's outcome becomes unknown.
        net.cut("fg", &Peer::Service(net.hub_addr(), backend.addr().port()), Way::Out);
        let sent = Instant::now();
        assert_eq!(put(2).await, Some(504), "no answer within request_timeout");
        // Past the quarantine, the link comes back and a newer write goes.
        tokio::time::sleep(Duration::from_secs(4).saturating_sub(sent.elapsed())).await;
        net.heal("fg");
        assert!(put(3).await.is_some_and(|s| (200..300).contains(&s)), "the quarantine is over");
        // Linux's retransmissions of the first bytes would come 6.2 and 12.6 s after they left.
        tokio::time::sleep(Duration::from_secs(14).saturating_sub(sent.elapsed())).await;
        let applied: Vec<u64> = backend.applied().iter().filter(|r| r.path == "/r").filter_map(|r| r.token()).collect();
        assert_eq!(applied, [1, 3], "the abandoned write's bytes reached the backend after the quarantine");
    });
}

/// The cluster form of the abandoned write: the leader forwards a write whose bytes are
/// dropped on their way to the backend, and is then cut from etcd; another instance takes over
/// and, once the marker's quarantine is over, accepts a newer write on every resource. The
/// links come back in time for Linux's next retransmission of the first write's bytes (12.6 s
/// after they left), which must not come: the old leader's kernel gave them up within three
/// quarters of the quarantine (`TCP_USER_TIMEOUT`). Without that bound it is the soak's
/// violation (docs/faults.md). About 25 s.
#[test]
fn a_cut_off_leaders_abandoned_write_stays_out_after_the_takeover() {
    on_the_hub(async |net| {
        let Some(world) = partitioned_world(Arc::clone(&net), false).await else { return };
        let leader = world.leader().await;
        let (addr, resource) = (world.cluster.instances[leader].addr, RESOURCES[0]);
        let first = token(&world.counter);
        assert!(put(addr, resource, first, 0).await.is_some_and(|s| (200..300).contains(&s)), "a backend connection");
        let backend = world.cluster.backend.addr();
        let std::net::IpAddr::V4(ip) = backend.ip() else { unreachable!("the backend is on the bridge") };
        net.cut(INSTANCES[leader], &Peer::Service(ip, backend.port()), Way::Out);
        let late = token(&world.counter);
        let writer = tokio::spawn(put(addr, resource, late, 0));
        let start = Instant::now();
        while world.cluster.in_flight_token(resource).await != Some(late) {
            assert!(start.elapsed() < Duration::from_secs(5), "the write was forwarded");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let sent = Instant::now();
        net.cut(INSTANCES[leader], &Peer::Hosts(members(&net)), Way::Both);
        assert!(world.newer_writes_elsewhere(leader).await, "another instance took over and wrote");
        net.heal(INSTANCES[leader]);
        tokio::time::sleep(Duration::from_secs(14).saturating_sub(sent.elapsed())).await;
        writer.abort();
        let applied = world.cluster.applied_tokens(resource);
        assert!(applied.windows(2).all(|w| w[0] < w[1]), "{resource} applied {applied:?}: {late} came late");
        assert!(!applied.contains(&late), "{resource} applied {applied:?}");
    });
}
