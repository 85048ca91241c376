//! A real single-member etcd for the interop tests, started on loopback ports of its own with a
//! temporary data dir ([`start_etcd`]), or as an [`EtcdSpec`] says: TLS on its client URL, with
//! client certificates required (`--client-cert-auth`), other flags (`--auth-token-ttl`), and
//! authentication enabled ([`Etcd::enable_auth`]). [`Etcd::add_learner`] starts a second
//! member, a learner, which refuses nearly every request as one that cannot serve now.
//!
//! A member with TLS also listens on a plain client URL of its own: the harness's health checks
//! and `etcdctl` use it, so they need no certificates; what the tests check goes to [`Etcd::url`].

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::raw::try_raw_request;
use super::services::{ATTEMPTS, Process, free_ports, installed};

const ETCD: &str = "/usr/bin/etcd";
const ETCDCTL: &str = "/usr/bin/etcdctl";

/// How to start an etcd.
#[derive(Debug, Clone, Default)]
pub struct EtcdSpec {
    /// Serve [`Etcd::url`] over TLS with these files.
    pub tls: Option<ServerTls>,
    /// More flags, e.g. `--auth-token-ttl 1`.
    pub args: Vec<String>,
}

/// A member's TLS files (PEM).
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Require client certificates signed by this CA (`--client-cert-auth`).
    pub client_ca: Option<PathBuf>,
}

/// A single-member etcd cluster on loopback.
pub struct Etcd {
    process: Process,
    /// `127.0.0.1:PORT`, the plain client address: the only one without TLS, also beside a TLS
    /// one (`--endpoints`, `ETCDCTL_ENDPOINTS`, `/health`, `/metrics`).
    pub endpoint: SocketAddr,
    /// `127.0.0.1:PORT` of [`Etcd::url`]: `endpoint` without TLS.
    pub client: SocketAddr,
    peer: u16,
    data: PathBuf,
    spec: EtcdSpec,
    /// `root:PASSWORD` once authentication is on, for `etcdctl`.
    root: Option<String>,
    starts: usize,
    /// Holds the data dir and the log; after `process` in drop order.
    dir: tempfile::TempDir,
}

/// The etcd command for the member `name` with its client addresses, peer port and data dir.
fn etcd_command(name: &str, plain: u16, tls_port: u16, peer: u16, data: &Path, spec: &EtcdSpec) -> Command {
    let plain_url = format!("http://127.0.0.1:{plain}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let mut cmd = Command::new(ETCD);
    cmd.arg("--name").arg(name).arg("--data-dir").arg(data);
    match &spec.tls {
        None => cmd.args(["--listen-client-urls", &plain_url, "--advertise-client-urls", &plain_url]),
        Some(tls) => {
            let tls_url = format!("https://127.0.0.1:{tls_port}");
            cmd.args(["--listen-client-urls", &format!("{tls_url},{plain_url}"), "--advertise-client-urls", &tls_url]);
            cmd.arg("--cert-file").arg(&tls.cert).arg("--key-file").arg(&tls.key);
            if let Some(ca) = &tls.client_ca {
                cmd.arg("--client-cert-auth").arg("--trusted-ca-file").arg(ca);
            }
            &mut cmd
        }
    };
    cmd.args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url]).args(&spec.args);
    cmd
}

/// Whether etcd at `endpoint` has a leader and serves requests.
pub(super) async fn etcd_healthy(endpoint: SocketAddr) -> bool {
    let r = try_raw_request(endpoint, "GET /health HTTP/1.1\r\nHost: etcd", "").await;
    r.is_some_and(|r| r.status == 200 && String::from_utf8_lossy(&r.body).contains("\"true\""))
}

/// Runs `cmd` to its end and panics with its output if it fails.
pub fn run(mut cmd: Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{what} failed: {text}");
    text
}

impl Etcd {
    /// The value of the first metric whose line starts with `series` (its name, and as many
    /// of its labels as etcd writes first), read from `/metrics` on the plain endpoint; 0 while
    /// etcd has written none.
    pub async fn metric(&self, series: &str) -> u64 {
        let r = super::raw_request(self.endpoint, "GET /metrics HTTP/1.1\r\nHost: etcd", "").await;
        let text = String::from_utf8_lossy(&r.body).into_owned();
        let line = text.lines().find(|l| l.starts_with(series));
        line.and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).map_or(0, |n| n as u64)
    }

    /// `http://127.0.0.1:PORT`, or `https://` with TLS: the client URL, which also serves the
    /// JSON gateway (`/v3/...`).
    pub fn url(&self) -> String {
        let scheme = if self.spec.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.client)
    }

    /// `etcdctl` pointed at this etcd (through `ETCDCTL_ENDPOINTS`, which an `etcdctl` run by
    /// a command under `etcdctl lock` inherits), as root once authentication is on.
    pub fn etcdctl(&self) -> Command {
        let mut cmd = Command::new(ETCDCTL);
        cmd.envs(self.client_env());
        if let Some(root) = &self.root {
            cmd.env("ETCDCTL_USER", root);
        }
        cmd
    }

    /// The environment that points `etcdctl` at this etcd.
    pub fn client_env(&self) -> [(&'static str, String); 2] {
        [("ETCDCTL_API", "3".to_owned()), ("ETCDCTL_ENDPOINTS", self.endpoint.to_string())]
    }

    /// Runs `etcdctl ARGS` to its end; its output.
    pub fn ctl(&self, args: &[&str]) -> String {
        let mut cmd = self.etcdctl();
        cmd.args(args);
        run(cmd, &format!("etcdctl {}", args.join(" ")))
    }

    /// Adds the user `root` with `password` and turns authentication on.
    pub fn enable_auth(&mut self, password: &str) {
        self.ctl(&["user", "add", "root", "--new-user-password", password]);
        self.ctl(&["auth", "enable"]);
        self.root = Some(format!("root:{password}"));
    }

    /// Adds `user` with `password`, allowed to read and write the keys under `prefix` only.
    pub fn add_user(&self, user: &str, password: &str, prefix: &str) {
        let role = format!("{user}-role");
        self.ctl(&["role", "add", &role]);
        self.ctl(&["role", "grant-permission", &role, "readwrite", "--prefix=true", prefix]);
        self.ctl(&["user", "add", user, "--new-user-password", password]);
        self.ctl(&["user", "grant-role", user, &role]);
    }

    /// Sets the password of `user` (to the one it has, too): etcd invalidates every token the
    /// user holds.
    pub fn passwd(&self, user: &str, password: &str) {
        use std::io::Write;
        use std::process::Stdio;
        let mut cmd = self.etcdctl();
        cmd.args(["user", "passwd", user, "--interactive=false"]).stdin(Stdio::piped());
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        child.stdin.take().unwrap().write_all(format!("{password}\n").as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "etcdctl user passwd: {}", String::from_utf8_lossy(&out.stderr));
    }

    pub fn pid(&self) -> u32 {
        self.process.child.id()
    }

    /// Kills etcd (SIGKILL) and starts it again on the same ports and data: every client
    /// connection, watches included, is cut, and every simple token is gone.
    pub async fn restart(&mut self) {
        self.process.kill();
        self.starts += 1;
        let log = self.dir.path().join(format!("etcd-restart-{}.log", self.starts));
        let cmd = self.command();
        self.process = Process::spawn("etcd", cmd, log);
        let endpoint = self.endpoint;
        assert!(self.process.wait_ready(async || etcd_healthy(endpoint).await).await, "etcd did not start again");
    }

    fn command(&self) -> Command {
        let mut cmd =
            etcd_command("default", self.endpoint.port(), self.client.port(), self.peer, &self.data, &self.spec);
        cmd.args(["--initial-cluster", &format!("default=http://127.0.0.1:{}", self.peer)]);
        cmd
    }

    /// Starts a second member, a learner of this one, on plain HTTP, and waits until it serves
    /// its health check; the learner is stopped when the returned process drops.
    pub async fn add_learner(&self) -> Learner {
        let [client, peer] = free_ports();
        let peer_url = format!("http://127.0.0.1:{peer}");
        self.ctl(&["member", "add", "learner", "--learner", &format!("--peer-urls={peer_url}")]);
        let data = self.dir.path().join("learner-data");
        let mut cmd = etcd_command("learner", client, client, peer, &data, &EtcdSpec::default());
        let cluster = format!("default=http://127.0.0.1:{},learner={peer_url}", self.peer);
        cmd.args(["--initial-cluster", &cluster, "--initial-cluster-state", "existing"]);
        let mut process = Process::spawn("etcd learner", cmd, self.dir.path().join("learner.log"));
        let endpoint: SocketAddr = format!("127.0.0.1:{client}").parse().unwrap();
        assert!(process.wait_ready(async || etcd_healthy(endpoint).await).await, "the learner did not start");
        Learner { _process: process, url: format!("http://{endpoint}") }
    }
}

/// A learner member, stopped on drop.
pub struct Learner {
    _process: Process,
    /// Its client URL.
    pub url: String,
}

/// Starts etcd, or returns `None` (the test skips) where it is not installed.
pub async fn start_etcd() -> Option<Etcd> {
    start_etcd_with(EtcdSpec::default()).await
}

/// Starts etcd as `spec` says, or returns `None` where it is not installed.
pub async fn start_etcd_with(spec: EtcdSpec) -> Option<Etcd> {
    if !installed("etcd", "etcd-server etcd-client", &[ETCD, ETCDCTL]) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    for attempt in 0..ATTEMPTS {
        let [plain, tls, peer] = free_ports();
        let tls = if spec.tls.is_some() { tls } else { plain };
        let data = dir.path().join(format!("data-{attempt}"));
        let endpoint: SocketAddr = format!("127.0.0.1:{plain}").parse().unwrap();
        let client: SocketAddr = format!("127.0.0.1:{tls}").parse().unwrap();
        let mut cmd = etcd_command("default", plain, tls, peer, &data, &spec);
        cmd.args(["--initial-cluster", &format!("default=http://127.0.0.1:{peer}")]);
        let mut process = Process::spawn("etcd", cmd, dir.path().join(format!("etcd-{attempt}.log")));
        // /health answers true once the member has a leader (itself) and serves requests.
        if process.wait_ready(async || etcd_healthy(endpoint).await).await {
            return Some(Etcd { process, endpoint, client, peer, data, spec, root: None, starts: 0, dir });
        }
        eprintln!("etcd ended before it answered (attempt {attempt}), trying other ports:\n{}", process.log_text());
    }
    panic!("etcd did not start in {ATTEMPTS} attempts");
}
