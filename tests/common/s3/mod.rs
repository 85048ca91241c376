//! A real S3 server that checks SigV4 signatures (moto's server mode, from PyPI), fencegate in
//! front of it in S3 mode, and boto3 driving both (`client.py` beside this file), each started
//! by the test on loopback.
//!
//! Where moto or boto3 is not installed the test says so and skips; with
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

/// Whether python3 has moto's server and boto3; if not, panics under `FG_REQUIRE_SERVICES=1`,
/// else says that the test is skipped.
fn installed() -> bool {
    let found = Command::new("python3")
        .args(["-c", "import moto.server, boto3"])
        .output()
        .is_ok_and(|out| out.status.success());
    if found {
        return true;
    }
    let required = std::env::var(REQUIRE).is_ok_and(|v| v == "1");
    assert!(!required, "{REQUIRE}=1 but moto or boto3 is missing: pip install 'moto[server]' boto3");
    eprintln!("skipping a test against an S3 server: moto or boto3 not installed (pip install 'moto[server]' boto3)");
    false
}

/// moto's S3 server, with SigV4 checked on every request after the first three (the IAM user
/// and its key are made in those), and the key's credentials.
pub struct Moto {
    _process: Process,
    pub url: String,
    pub access_key: String,
    pub secret: String,
    _dir: tempfile::TempDir,
}

/// Starts moto, or returns `None` (the test skips) where it is not installed.
pub async fn start_moto() -> Option<Moto> {
    if !installed() {
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
            assert!(out.status.success(), "setting up moto's user: {}", String::from_utf8_lossy(&out.stderr));
            let text = String::from_utf8(out.stdout).unwrap();
            let (access_key, secret) = text.trim().split_once(' ').unwrap();
            let (access_key, secret) = (access_key.to_owned(), secret.to_owned());
            return Some(Moto { _process: process, url, access_key, secret, _dir: dir });
        }
        eprintln!("moto ended before it answered (attempt {attempt}), trying another port");
    }
    panic!("moto did not start in {ATTEMPTS} attempts");
}

/// fencegate in S3 mode in front of an S3 server, in-process on port 0.
pub struct S3Proxy {
    pub addr: SocketAddr,
    pub proxy: Proxy,
    _stop: oneshot::Sender<()>,
    _dir: tempfile::TempDir,
}

impl S3Proxy {
    /// fencegate in front of `backend`, with `extra` TOML appended to its config.
    pub async fn start(backend: &str, extra: &str) -> S3Proxy {
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\n[backend]\nurl = \"{backend}\"\nprotocol = \"s3\"\n\
             [store]\ndir = {:?}\n{extra}\n",
            dir.path().join("data").display().to_string()
        );
        let config = Config::from_toml_str(&text).unwrap();
        fencegate::app::init_data_dir(&config.store.dir, 0).unwrap();
        let proxy = Proxy::open(config).await.unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(proxy.clone().serve(listener, async {
            let _ = stopped.await;
        }));
        S3Proxy { addr, proxy, _stop: stop, _dir: dir }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Runs the boto3 scenario `name` through `proxy` against `moto`; panics with its output if
/// an assertion in it failed.
pub async fn scenario(name: &str, proxy: &S3Proxy, moto: &Moto) {
    let args = [name, &proxy.url(), &moto.url, &moto.access_key, &moto.secret].map(str::to_owned);
    let run = move || Command::new("python3").arg(CLIENT).args(args).output();
    let out = tokio::task::spawn_blocking(run).await.unwrap().unwrap();
    assert!(
        out.status.success(),
        "scenario {name} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
