//! Real lock services for the interop tests: a single-member etcd and a standalone ZooKeeper,
//! each started by the test on loopback ports of its own with a temporary data dir, and killed
//! and reaped by pid when its guard drops (also when the test panics, when the guard prints the
//! service's log).
//!
//! Where a service is not installed, [`start_etcd`] and [`start_zookeeper`] say so and return
//! `None`, and the test skips; with `FG_REQUIRE_SERVICES=1` (set by `.ci/run`, which installs
//! them) they panic instead, so CI cannot pass by skipping.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::raw::try_raw_request;
use super::wait::DEADLINE;

/// Set to `1` where the services must be there (CI): a missing one fails the test.
pub const REQUIRE: &str = "FG_REQUIRE_SERVICES";

const ETCD: &str = "/usr/bin/etcd";
const ETCDCTL: &str = "/usr/bin/etcdctl";
const JAVA: &str = "/usr/bin/java";
/// Debian's zookeeper package: the server jar, whose manifest names the jars it needs.
const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";
/// Optional: an SLF4J binding, so that ZooKeeper's log reaches its log file.
const SLF4J_SIMPLE_JAR: &str = "/usr/share/java/slf4j-simple.jar";

/// Tries to start a service on new ports this many times: a port found free can be taken by
/// another test before the service binds it.
const ATTEMPTS: usize = 5;

/// Between two looks at a starting service.
const INTERVAL: Duration = Duration::from_millis(25);

/// Whether `paths` all exist; if not, panics under `FG_REQUIRE_SERVICES=1`, else says that
/// the test is skipped.
pub fn installed(service: &str, package: &str, paths: &[&str]) -> bool {
    let missing: Vec<&str> = paths.iter().copied().filter(|p| !Path::new(p).exists()).collect();
    if missing.is_empty() {
        return true;
    }
    let required = std::env::var(REQUIRE).is_ok_and(|v| v == "1");
    assert!(!required, "{REQUIRE}=1 but {service} is missing ({}): apt-get install {package}", missing.join(", "));
    eprintln!("skipping a test against {service}: {} not installed (apt-get install {package})", missing.join(", "));
    false
}

/// `N` distinct loopback ports nothing listens on now (all bound at once, then let go).
fn free_ports<const N: usize>() -> [u16; N] {
    let listeners: [TcpListener; N] = std::array::from_fn(|_| TcpListener::bind("127.0.0.1:0").unwrap());
    listeners.map(|l| l.local_addr().unwrap().port())
}

/// A started service process: killed and reaped on drop.
struct Process {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Process {
    fn spawn(name: &'static str, mut cmd: Command, log: PathBuf) -> Process {
        let out = std::fs::File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        let child = cmd.stdin(Stdio::null()).stdout(out).stderr(err).spawn().unwrap();
        Process { name, child, log }
    }

    fn exited(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `ready` answers true; `false` if the process ends first (a port taken since
    /// it was found free, say). Panics with the log if neither happens within [`DEADLINE`].
    async fn wait_ready(&mut self, mut ready: impl AsyncFnMut() -> bool) -> bool {
        let start = Instant::now();
        loop {
            if ready().await {
                return true;
            }
            if self.exited() {
                return false;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "{} did not answer within {DEADLINE:?}:\n{}",
                self.name,
                self.log_text()
            );
            tokio::time::sleep(INTERVAL).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let text = self.log_text();
            let tail: Vec<&str> = text.lines().rev().take(60).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            eprintln!("--- end of the log of {} (pid {}) ---\n{}\n---", self.name, self.child.id(), tail.join("\n"));
        }
    }
}

/// A single-member etcd cluster on loopback.
pub struct Etcd {
    process: Process,
    /// `127.0.0.1:PORT`, the client address (`--endpoints`, `ETCDCTL_ENDPOINTS`).
    pub endpoint: SocketAddr,
    peer: u16,
    data: PathBuf,
    starts: usize,
    /// Holds the data dir and the log; after `process` in drop order.
    dir: tempfile::TempDir,
}

/// The etcd command for a member with its client and peer ports and data dir.
fn etcd_command(client: u16, peer: u16, data: &Path) -> Command {
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let mut cmd = Command::new(ETCD);
    cmd.arg("--name")
        .arg("default")
        .arg("--data-dir")
        .arg(data)
        .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("default={peer_url}")]);
    cmd
}

/// Whether etcd at `endpoint` has a leader and serves requests.
async fn etcd_healthy(endpoint: SocketAddr) -> bool {
    let r = try_raw_request(endpoint, "GET /health HTTP/1.1\r\nHost: etcd", "").await;
    r.is_some_and(|r| r.status == 200 && String::from_utf8_lossy(&r.body).contains("\"true\""))
}

impl Etcd {
    /// `http://127.0.0.1:PORT`: the client URL, which also serves the JSON gateway (`/v3/...`).
    pub fn url(&self) -> String {
        format!("http://{}", self.endpoint)
    }

    /// `etcdctl` pointed at this etcd (through `ETCDCTL_ENDPOINTS`, which an `etcdctl` run by
    /// a command under `etcdctl lock` inherits).
    pub fn etcdctl(&self) -> Command {
        let mut cmd = Command::new(ETCDCTL);
        cmd.envs(self.client_env());
        cmd
    }

    /// The environment that points `etcdctl` at this etcd.
    pub fn client_env(&self) -> [(&'static str, String); 2] {
        [("ETCDCTL_API", "3".to_owned()), ("ETCDCTL_ENDPOINTS", self.endpoint.to_string())]
    }

    pub fn pid(&self) -> u32 {
        self.process.child.id()
    }

    /// Kills etcd (SIGKILL) and starts it again on the same ports and data: every client
    /// connection, watches included, is cut.
    pub async fn restart(&mut self) {
        let _ = self.process.child.kill();
        let _ = self.process.child.wait();
        self.starts += 1;
        let log = self.dir.path().join(format!("etcd-restart-{}.log", self.starts));
        let cmd = etcd_command(self.endpoint.port(), self.peer, &self.data);
        self.process = Process::spawn("etcd", cmd, log);
        let endpoint = self.endpoint;
        assert!(self.process.wait_ready(async || etcd_healthy(endpoint).await).await, "etcd did not start again");
    }
}

/// Starts etcd, or returns `None` (the test skips) where it is not installed.
pub async fn start_etcd() -> Option<Etcd> {
    if !installed("etcd", "etcd-server etcd-client", &[ETCD, ETCDCTL]) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    for attempt in 0..ATTEMPTS {
        let [client, peer] = free_ports();
        let data = dir.path().join(format!("data-{attempt}"));
        let cmd = etcd_command(client, peer, &data);
        let mut process = Process::spawn("etcd", cmd, dir.path().join(format!("etcd-{attempt}.log")));
        let endpoint: SocketAddr = format!("127.0.0.1:{client}").parse().unwrap();
        // /health answers true once the member has a leader (itself) and serves requests.
        if process.wait_ready(async || etcd_healthy(endpoint).await).await {
            return Some(Etcd { process, endpoint, peer, data, starts: 0, dir });
        }
        eprintln!("etcd ended before it answered (attempt {attempt}), trying other ports:\n{}", process.log_text());
    }
    panic!("etcd did not start in {ATTEMPTS} attempts");
}

/// A standalone ZooKeeper on loopback.
pub struct ZooKeeper {
    process: Process,
    /// `127.0.0.1:PORT`, the client port.
    pub addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl ZooKeeper {
    /// The connect string for a client.
    pub fn connect_string(&self) -> String {
        self.addr.to_string()
    }

    pub fn pid(&self) -> u32 {
        self.process.child.id()
    }
}

/// ZooKeeper's tick. Session timeouts are negotiated between 2 and 20 ticks, so with 200 ms a
/// session can expire 400 ms after its client goes quiet (with the default tick, 2 s, not
/// before 4 s), and a test that lets one expire takes about a second.
pub const ZK_TICK: Duration = Duration::from_millis(200);

/// Starts ZooKeeper, or returns `None` (the test skips) where it is not installed.
pub async fn start_zookeeper() -> Option<ZooKeeper> {
    if !installed("ZooKeeper", "zookeeperd", &[JAVA, ZOOKEEPER_JAR]) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut classpath = String::from(ZOOKEEPER_JAR);
    if Path::new(SLF4J_SIMPLE_JAR).exists() {
        classpath.push(':');
        classpath.push_str(SLF4J_SIMPLE_JAR);
    }
    for attempt in 0..ATTEMPTS {
        let [port] = free_ports();
        let data = dir.path().join(format!("data-{attempt}"));
        std::fs::create_dir(&data).unwrap();
        let cfg = dir.path().join(format!("zoo-{attempt}.cfg"));
        std::fs::write(
            &cfg,
            format!(
                "tickTime={}\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
                 admin.enableServer=false\n4lw.commands.whitelist=srvr\nmaxClientCnxns=0\n",
                ZK_TICK.as_millis(),
                data.display()
            ),
        )
        .unwrap();
        let mut cmd = Command::new(JAVA);
        cmd.args(["-Xmx64m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Djava.net.preferIPv4Stack=true"])
            .arg("-Dorg.slf4j.simpleLogger.defaultLogLevel=warn")
            // Empty container nodes (Curator's lock parents) are deleted on this check, every
            // minute by default: often enough here for a test to watch one go.
            .arg("-Dznode.container.checkIntervalMs=100")
            .arg("-cp")
            .arg(&classpath)
            .arg("org.apache.zookeeper.server.ZooKeeperServerMain")
            .arg(&cfg);
        let mut process = Process::spawn("ZooKeeper", cmd, dir.path().join(format!("zookeeper-{attempt}.log")));
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        // `srvr` answers with the server's mode once it serves clients.
        if process.wait_ready(async || srvr(addr).await.is_some_and(|s| s.contains("Mode:"))).await {
            return Some(ZooKeeper { process, addr, _dir: dir });
        }
        eprintln!(
            "ZooKeeper ended before it answered (attempt {attempt}), trying another port:\n{}",
            process.log_text()
        );
    }
    panic!("ZooKeeper did not start in {ATTEMPTS} attempts");
}

/// ZooKeeper's `srvr` four-letter command: its answer, or `None` if it does not answer.
async fn srvr(addr: SocketAddr) -> Option<String> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    stream.write_all(b"srvr").await.ok()?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut answer)).await.ok()?.ok()?;
    String::from_utf8(answer).ok()
}

/// A process group the test started (a command and whatever it runs), killed with SIGKILL as
/// a whole and its leader reaped on drop: stopping only the leader would leave its children
/// running.
pub struct Group {
    child: Child,
    name: String,
}

impl Group {
    /// Spawns `cmd` as the leader of a new process group.
    pub fn spawn(name: &str, mut cmd: Command) -> Group {
        use std::os::unix::process::CommandExt;
        let child = cmd.process_group(0).spawn().unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        Group { child, name: name.to_owned() }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` to the leader only (SIGSTOP to `etcdctl lock`, say, which stops its lease
    /// keep-alive and nothing else).
    pub fn signal_leader(&self, signal: rustix::process::Signal) {
        rustix::process::kill_process(self.rustix_pid(), signal).unwrap();
    }

    /// The leader's exit status, once it has ended.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }

    /// Waits (polling) until the leader has ended, and returns its exit status.
    pub async fn wait(&mut self) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.exited() {
                return status;
            }
            assert!(start.elapsed() < DEADLINE, "{} did not end within {DEADLINE:?}", self.name);
            tokio::time::sleep(INTERVAL).await;
        }
    }

    fn rustix_pid(&self) -> rustix::process::Pid {
        rustix::process::Pid::from_raw(self.child.id() as i32).expect("a child's pid is positive")
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        // The group's id is the leader's pid, and no new process gets that pid while any member
        // of the group runs; once all have ended the kill finds no group.
        let _ = rustix::process::kill_process_group(self.rustix_pid(), rustix::process::Signal::KILL);
        let _ = self.child.wait();
    }
}

/// A three-member etcd cluster on loopback, its data on tmpfs (`/dev/shm`) where there is one:
/// members killed, stopped and restarted one by one.
pub struct EtcdCluster {
    members: Vec<Option<Process>>,
    /// Each member's client address.
    pub endpoints: Vec<SocketAddr>,
    peers: Vec<u16>,
    data: Vec<PathBuf>,
    starts: usize,
    dir: tempfile::TempDir,
}

fn member_command(i: usize, clients: &[SocketAddr], peers: &[u16], data: &Path, state: &str) -> Command {
    let client_url = format!("http://{}", clients[i]);
    let peer_url = format!("http://127.0.0.1:{}", peers[i]);
    let initial: Vec<String> = peers.iter().enumerate().map(|(j, p)| format!("m{j}=http://127.0.0.1:{p}")).collect();
    let mut cmd = Command::new(ETCD);
    cmd.arg("--name")
        .arg(format!("m{i}"))
        .arg("--data-dir")
        .arg(data)
        .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &initial.join(","), "--initial-cluster-state", state])
        .args([
            "--initial-cluster-token",
            "fencegate-test",
            "--election-timeout",
            "1000",
            "--heartbeat-interval",
            "100",
        ]);
    cmd
}

impl EtcdCluster {
    /// The client URLs, for `[etcd] endpoints`.
    pub fn urls(&self) -> Vec<String> {
        self.endpoints.iter().map(|e| format!("http://{e}")).collect()
    }

    /// The pid of member `i`, while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].as_ref().map(|p| p.child.id())
    }

    /// The member etcd's members name their leader, if they agree on one that runs.
    pub async fn leader(&self) -> Option<usize> {
        for (i, e) in self.endpoints.iter().enumerate() {
            if self.members[i].is_none() {
                continue;
            }
            let body = r#"{}"#;
            let head = format!(
                "POST /v3/maintenance/status HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\nContent-Length: {}",
                body.len()
            );
            let Some(r) = try_raw_request(*e, &head, body).await else { continue };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&r.body) else { continue };
            let (Some(leader), Some(me)) = (v["leader"].as_str(), v["header"]["member_id"].as_str()) else { continue };
            if leader == me {
                return Some(i);
            }
        }
        None
    }

    /// Kills member `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        self.members[i] = None;
    }

    /// Starts member `i` again on its ports and data.
    pub fn restart(&mut self, i: usize) {
        self.starts += 1;
        let log = self.dir.path().join(format!("etcd-m{i}-{}.log", self.starts));
        let cmd = member_command(i, &self.endpoints, &self.peers, &self.data[i], "existing");
        self.members[i] = Some(Process::spawn("etcd member", cmd, log));
    }
}

/// Starts a three-member etcd cluster, or returns `None` (the test skips) where etcd is not
/// installed. Resolves once every member is healthy.
pub async fn start_etcd_cluster() -> Option<EtcdCluster> {
    if !installed("etcd", "etcd-server etcd-client", &[ETCD, ETCDCTL]) {
        return None;
    }
    let shm = Path::new("/dev/shm");
    let dir = if shm.is_dir() { tempfile::tempdir_in(shm).unwrap() } else { tempfile::tempdir().unwrap() };
    let ports: [u16; 6] = free_ports();
    let endpoints: Vec<SocketAddr> = ports[..3].iter().map(|p| format!("127.0.0.1:{p}").parse().unwrap()).collect();
    let peers = ports[3..].to_vec();
    let data: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("m{i}"))).collect();
    let mut members = Vec::new();
    for i in 0..3 {
        let cmd = member_command(i, &endpoints, &peers, &data[i], "new");
        members.push(Some(Process::spawn("etcd member", cmd, dir.path().join(format!("etcd-m{i}.log")))));
    }
    let mut cluster = EtcdCluster { members, endpoints, peers, data, starts: 0, dir };
    for i in 0..3 {
        let endpoint = cluster.endpoints[i];
        let member = cluster.members[i].as_mut().unwrap();
        assert!(member.wait_ready(async || etcd_healthy(endpoint).await).await, "etcd member {i} did not start");
    }
    Some(cluster)
}
