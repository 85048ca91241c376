//! Real S3 servers that check SigV4 signatures, two independent ones so that fencegate is not
//! tuned to one server's quirks: moto's server mode (PyPI) and s3s-fs (crates.io); fencegate in
//! front of one in S3 mode; and boto3 driving both (`client.py` beside this file), each started
//! by the test on loopback.
//!
//! Where a server or boto3 is not installed the test says so and skips; with
//! `FG_REQUIRE_SERVICES=1` (`.ci/run`, which installs them) it fails instead.

use std::net::SocketAddr;
use std::process::Command;

use fencegate::Config;
use fencegate::app::Proxy;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use super::services::{ATTEMPTS, Process, REQUIRE, free_ports};

/// The boto3 scenarios.
pub const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/common/s3/client.py");

/// Whether `found`; if not, panics under `FG_REQUIRE_SERVICES=1`, else says that the test is
/// skipped and how to install `what`.
fn installed(found: bool, what: &str, install: &str) -> bool {
    if found {
        return true;
    }
    let required = std::env::var(REQUIRE).is_ok_and(|v| v == "1");
    assert!(!required, "{REQUIRE}=1 but {what} is missing: {install}");
    eprintln!("skipping a test against an S3 server: {what} is not installed ({install})");
    false
}

/// Whether python3 has moto's server and boto3.
fn python_has_moto_and_boto3() -> bool {
    Command::new("python3").args(["-c", "import moto.server, boto3"]).output().is_ok_and(|out| out.status.success())
}

/// The s3s-fs binary: on `PATH`, or where `cargo install` puts it.
fn s3s_fs() -> Option<std::path::PathBuf> {
    let mut dirs: Vec<std::path::PathBuf> =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    if let Some(home) = std::env::var_os("CARGO_HOME")
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cargo").into()))
    {
        dirs.push(std::path::Path::new(&home).join("bin"));
    }
    dirs.into_iter().map(|d| d.join("s3s-fs")).find(|p| p.is_file())
}

/// A running S3 server that checks signatures, and a key it takes.
pub struct S3Server {
    /// `moto` or `s3s`, as `client.py` names it.
    pub kind: &'static str,
    _process: Process,
    pub url: String,
    pub access_key: String,
    pub secret: String,
    _dir: tempfile::TempDir,
}

/// Starts s3s-fs on a temporary directory with one key (and `s3.test` as its virtual-host
/// domain), or returns `None` (the test skips) where it or boto3 is not installed.
pub async fn start_s3s() -> Option<S3Server> {
    let bin = s3s_fs();
    let install = "cargo install s3s-fs@0.14.1 --locked --features binary; pip install boto3";
    if !installed(bin.is_some() && python_has_moto_and_boto3(), "s3s-fs or boto3", install) {
        return None;
    }
    let bin = bin?;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let (access_key, secret) = ("AKIDFENCEGATETEST".to_owned(), "fencegate-test-secret-key".to_owned());
    for attempt in 0..ATTEMPTS {
        let [port] = free_ports();
        let mut cmd = Command::new(&bin);
        cmd.args(["--host", "127.0.0.1", "--port", &port.to_string(), "--access-key", &access_key])
            .args(["--secret-key", &secret, "--domain", "s3.test"])
            .arg(&root);
        let mut process = Process::spawn("s3s-fs", cmd, dir.path().join(format!("s3s-{attempt}.log")));
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        if process.wait_ready(async || tokio::net::TcpStream::connect(addr).await.is_ok()).await {
            let url = format!("http://{addr}");
            return Some(S3Server { kind: "s3s", _process: process, url, access_key, secret, _dir: dir });
        }
        eprintln!("s3s-fs ended before it answered (attempt {attempt}), trying another port");
    }
    panic!("s3s-fs did not start in {ATTEMPTS} attempts");
}

/// Starts moto, with SigV4 checked on every request after the first three (the IAM user and
/// its key are made in those), or returns `None` (the test skips) where it is not installed.
pub async fn start_moto() -> Option<S3Server> {
    if !installed(python_has_moto_and_boto3(), "moto or boto3", "pip install 'moto[server]' boto3") {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    for attempt in 0..ATTEMPTS {
        let [port] = free_ports();
        let mut cmd = Command::new("python3");
        cmd.args(["-c", "import sys; from moto.server import main; main(sys.argv[1:])"])
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .env("INITIAL_NO_AUTH_ACTION_COUNT", "3");
        let mut process = Process::spawn("moto", cmd, dir.path().join(format!("moto-{attempt}.log")));
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        if process.wait_ready(async || tokio::net::TcpStream::connect(addr).await.is_ok()).await {
            let url = format!("http://{addr}");
            let out = Command::new("python3").arg(CLIENT).args(["setup", &url]).output().unwrap();
            if !out.status.success() {
                // Another process that took the port between its pick and moto's bind answers
                // here; so, once, did a moto still starting.
                let why = String::from_utf8_lossy(&out.stderr);
                eprintln!("setting up moto's user failed (attempt {attempt}), trying another port: {why}");
                continue;
            }
            let text = String::from_utf8(out.stdout).unwrap();
            let (access_key, secret) = text.trim().split_once(' ').unwrap();
            let (access_key, secret) = (access_key.to_owned(), secret.to_owned());
            return Some(S3Server { kind: "moto", _process: process, url, access_key, secret, _dir: dir });
        }
        eprintln!("moto ended before it answered (attempt {attempt}), trying another port");
    }
    panic!("moto did not start in {ATTEMPTS} attempts");
}

/// fencegate in S3 mode in front of an S3 server, in-process on port 0.
pub struct S3Proxy {
    pub addr: SocketAddr,
    pub proxy: Proxy,
    config: Config,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), fencegate::Error>>>,
    _dir: tempfile::TempDir,
}

impl S3Proxy {
    /// fencegate in front of `backend`, with `extra` TOML appended to its config.
    pub async fn start(backend: &str, extra: &str) -> S3Proxy {
        S3Proxy::start_as(backend, extra, fencegate::config::ServerMode::Proxy).await
    }

    /// Like [`S3Proxy::start`], serving `mode`: with `ServerMode::ExtProc`, Envoy's external
    /// processor for an Envoy in front of `backend`.
    pub async fn start_as(backend: &str, extra: &str, mode: fencegate::config::ServerMode) -> S3Proxy {
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[backend]\nurl = \"{backend}\"\nprotocol = \"s3\"\n\
             [store]\ndir = {:?}\n{extra}\n",
            dir.path().join("data").display().to_string()
        );
        let mut config = Config::from_toml_str(&text).unwrap();
        config.server.mode = mode;
        fencegate::app::init_data_dir(&config.store.dir, 0).unwrap();
        let proxy = super::open_proxy(config.clone()).await;
        let mut started =
            S3Proxy { addr: "127.0.0.1:0".parse().unwrap(), proxy, config, stop: None, task: None, _dir: dir };
        started.serve().await;
        started
    }

    async fn serve(&mut self) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        self.addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        self.stop = Some(stop);
        self.task = Some(tokio::spawn(self.proxy.clone().serve(listener, async {
            let _ = stopped.await;
        })));
    }

    /// Shuts down gracefully (the store closed) and starts again on the same data directory,
    /// at a new address: every pin and connection is gone, `max_seen` is kept.
    pub async fn restart(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap().unwrap();
        }
        self.proxy = super::open_proxy(self.config.clone()).await;
        self.serve().await;
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Runs the boto3 scenario `name` through `proxy` against `server`; panics with its output if
/// an assertion in it failed.
pub async fn scenario(name: &str, proxy: &S3Proxy, server: &S3Server) {
    scenario_at(name, &proxy.url(), server, &[]).await;
}

/// Runs the boto3 scenario `name` through the fencegate at `url` against `server`, with `env`
/// set for it; panics with its output if an assertion in it failed, and returns what it
/// printed.
pub async fn scenario_at(name: &str, url: &str, server: &S3Server, env: &[(&str, &str)]) -> String {
    let args = [name, server.kind, url, &server.url, &server.access_key, &server.secret].map(str::to_owned);
    let env: Vec<(String, String)> = env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    let run = move || Command::new("python3").arg(CLIENT).args(args).envs(env).output();
    let out = tokio::task::spawn_blocking(run).await.unwrap().unwrap();
    succeeded(name, server, &out)
}

/// What the scenario `name` against `server` printed; panics with its output unless it
/// succeeded.
pub fn succeeded(name: &str, server: &S3Server, out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "scenario {name} against {} failed:\n{}{}",
        server.kind,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub mod tap;

/// Runs `script`, a Python file beside this one, with `args` and returns its output, waited
/// for off the runtime's threads.
pub async fn python(script: &str, args: Vec<String>) -> std::process::Output {
    let path = format!("{}/tests/common/s3/{script}", env!("CARGO_MANIFEST_DIR"));
    let run = move || Command::new("python3").arg(path).args(args).output();
    tokio::task::spawn_blocking(run).await.unwrap().unwrap()
}
