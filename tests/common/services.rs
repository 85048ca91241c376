//! Real lock services for the interop tests: a single-member etcd (`etcd_server`, re-exported
//! here) and a standalone ZooKeeper, each started by the test on loopback ports of its own with
//! a temporary data dir, and killed and reaped by pid when its guard drops (also when the test
//! panics, when the guard prints the service's log).
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

use super::wait::DEADLINE;

// Each test crate uses its own part of these.
#[allow(unused_imports)]
pub use super::etcd_server::{Etcd, start_etcd};

/// Set to `1` where the services must be there (CI): a missing one fails the test.
pub use super::skips::REQUIRE;

const JAVA: &str = "/usr/bin/java";
/// Debian's zookeeper package: the server jar, whose manifest names the jars it needs.
const ZOOKEEPER_JAR: &str = "/usr/share/java/zookeeper.jar";
/// Optional: an SLF4J binding, so that ZooKeeper's log reaches its log file.
const SLF4J_SIMPLE_JAR: &str = "/usr/share/java/slf4j-simple.jar";

/// Tries to start a service on new ports this many times: a port found free can be taken by
/// another test before the service binds it.
pub const ATTEMPTS: usize = 5;

/// Between two looks at a starting service.
const INTERVAL: Duration = Duration::from_millis(25);

/// Whether `paths` all exist; if not, panics under `FG_REQUIRE_SERVICES=1`, else says that
/// the test is skipped.
pub fn installed(service: &str, package: &str, paths: &[&str]) -> bool {
    let missing: Vec<&str> = paths.iter().copied().filter(|p| !Path::new(p).exists()).collect();
    if missing.is_empty() {
        return true;
    }
    assert!(
        !super::skips::required(),
        "{REQUIRE}=1 but {service} is missing ({}): apt-get install {package}",
        missing.join(", ")
    );
    super::skips::skip(&format!("{service}: {} not installed (apt-get install {package})", missing.join(", ")));
    false
}

/// `N` distinct loopback ports nothing listens on now, for a server started later with its
/// port on the command line or in a config. They come from below the kernel's ephemeral range
/// (32768 and up), so no outgoing connection and no listener bound to port 0 can take one in
/// between; within a test binary each is handed out once.
pub fn free_ports<const N: usize>() -> [u16; N] {
    const LOW: u32 = 10_000;
    const SPAN: u32 = 32_768 - LOW;
    static NEXT: std::sync::OnceLock<std::sync::atomic::AtomicU32> = std::sync::OnceLock::new();
    // Another binary's tests may hold ports from an earlier run: start at a place of our own.
    let next = NEXT.get_or_init(|| std::sync::atomic::AtomicU32::new(std::process::id().wrapping_mul(7919) % SPAN));
    std::array::from_fn(|_| {
        for _ in 0..SPAN {
            let port = (LOW + next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % SPAN) as u16;
            if TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
        panic!("no free loopback port below the ephemeral range")
    })
}

/// A started service process: killed and reaped on drop.
pub struct Process {
    name: &'static str,
    pub child: Child,
    log: PathBuf,
}

impl Process {
    pub fn spawn(name: &'static str, mut cmd: Command, log: PathBuf) -> Process {
        let out = std::fs::File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        let child = cmd.stdin(Stdio::null()).stdout(out).stderr(err).spawn().unwrap();
        Process { name, child, log }
    }

    fn exited(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }

    /// Kills it (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `ready` answers true; `false` if the process ends first (a port taken since
    /// it was found free, say). Panics with the log if neither happens within [`DEADLINE`].
    pub async fn wait_ready(&mut self, mut ready: impl AsyncFnMut() -> bool) -> bool {
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
