//! The real `fencegate` binary: crash with `kill -9` and restart, one instance per data dir,
//! and the `check` and `demo` commands.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{raw_request, try_raw_request};
use fencegate::memstore::MemStore;

const BIN: &str = env!("CARGO_BIN_EXE_fencegate");

fn write_config(dir: &Path, backend: &str) -> PathBuf {
    let path = dir.join("fencegate.toml");
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[backend]\nurl = \"{backend}\"\n[store]\ndir = {:?}\n",
        dir.join("data").display().to_string()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// A running `fencegate run` process and the address it reported.
struct Running {
    child: Child,
    addr: SocketAddr,
}

impl Running {
    fn start(config: &Path) -> Running {
        let mut child = Command::new(BIN)
            .args(["run", "--config"])
            .arg(config)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        // Keep draining stderr after the address is found so the child never blocks on it.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("fencegate listening")
                    && let Some(addr) = line.split("addr=").nth(1).and_then(|s| s.split_whitespace().next())
                {
                    let _ = tx.send(addr.parse::<SocketAddr>().unwrap());
                }
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(30)).expect("fencegate reported its address");
        Running { child, addr }
    }

    fn kill9(mut self) {
        self.child.kill().unwrap(); // SIGKILL on Unix
        self.child.wait().unwrap();
    }
}

/// A fenced PUT; 0 when no response came back (the proxy died).
async fn put(addr: SocketAddr, path: &str, token: u64) -> u16 {
    let head = format!("PUT {path} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}");
    try_raw_request(addr, &head, "v").await.map_or(0, |r| r.status)
}

#[tokio::test]
async fn kill_9_at_any_moment_loses_no_advance_that_was_forwarded() {
    let backend = Arc::new(MemStore::start().await.unwrap());
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &backend.url());
    let resources: Vec<String> = (0..8).map(|i| format!("/r{i}")).collect();
    let mut next_token = 1u64;
    for round in 0..3u64 {
        let proxy = Running::start(&config);
        // Writers across all resources, still running when the process is killed.
        let writers: Vec<_> = resources
            .iter()
            .cloned()
            .map(|path| {
                let addr = proxy.addr;
                let first = next_token;
                tokio::spawn(async move {
                    for t in first.. {
                        if !matches!(put(addr, &path, t).await, 200) {
                            break;
                        }
                    }
                })
            })
            .collect();
        next_token += 1_000_000;
        tokio::time::sleep(Duration::from_millis(150 + 70 * round)).await;
        proxy.kill9();
        for w in writers {
            let _ = w.await; // each stops at its first failed request
        }

        // Every write that reached the backend, applied or not.
        let mut highest: HashMap<String, u64> = HashMap::new();
        for r in backend.requests() {
            let t = r.token().unwrap();
            let e = highest.entry(r.path.clone()).or_default();
            *e = (*e).max(t);
        }
        assert_eq!(highest.len(), resources.len(), "round {round}: every resource saw writes");

        let proxy = Running::start(&config);
        for (path, max) in &highest {
            assert_eq!(put(proxy.addr, path, *max).await, 409, "round {round}: {path} forgot {max}");
        }
        let (path, max) = highest.iter().next().unwrap();
        // The proxy may have made a later advance durable without forwarding it, so the next
        // holder's token is one clearly above anything this round wrote.
        assert_eq!(put(proxy.addr, path, max + 500_000).await, 200, "the fence still admits the next holder");
        proxy.kill9();
    }
}

#[tokio::test]
async fn kill_9_while_a_write_is_at_the_backend_keeps_its_advance() {
    let backend = Arc::new(MemStore::start().await.unwrap());
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &backend.url());
    let proxy = Running::start(&config);
    let addr = proxy.addr;
    // The backend holds the write for 10 s: the proxy dies while it is in flight.
    let held = tokio::spawn(async move {
        let head = format!("PUT /doc HTTP/1.1\r\nHost: x\r\nFencing-Token: 77\r\n{}: 10000", common::DELAY_HEADER);
        raw_request(addr, &head, "v").await
    });
    while backend.requests().is_empty() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.kill9();
    held.abort();
    let proxy = Running::start(&config);
    assert_eq!(put(proxy.addr, "/doc", 77).await, 409, "the forwarded token's advance survived kill -9");
    assert_eq!(put(proxy.addr, "/doc", 78).await, 200);
    proxy.kill9();
}

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[tokio::test]
async fn a_second_instance_on_the_same_data_dir_exits_at_once_with_a_clear_message() {
    let backend = MemStore::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &backend.url());
    let first = Running::start(&config);
    let second = run(&["run", "--config", config.to_str().unwrap()], &[]);
    assert!(!second.status.success());
    let msg = String::from_utf8_lossy(&second.stderr);
    assert!(msg.contains("in use by another fencegate"), "{msg}");
    first.kill9();
}

#[test]
fn check_prints_the_effective_settings_of_a_valid_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "http://127.0.0.1:9000");
    let out = run(&["check", "--config", config.to_str().unwrap()], &[("FENCEGATE_FENCE__EQUAL_TOKEN", "accept")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    for expected in ["equal_token = \"accept\"", "request_timeout = \"30s\"", "header = \"fencing-token\""] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }
}

#[test]
fn check_names_the_bad_key_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    for (body, key) in [
        ("[backend]\nurl = \"http://127.0.0.1:9000\"\n[fence]\nequal_tokens = \"accept\"\n", "equal_tokens"),
        ("[backend]\nurl = \"http://127.0.0.1:9000\"\nconect_timeout = \"1s\"\n", "conect_timeout"),
        ("[backend]\nurl = \"http://127.0.0.1:9000\"\n[fence]\nqueue_timeout = \"-1\"\n", "fence.queue_timeout"),
        ("[fence]\nheader = \"x\"\n", "backend"),
    ] {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, body).unwrap();
        let out = run(&["check", "--config", path.to_str().unwrap()], &[]);
        assert!(!out.status.success(), "{body:?} was accepted");
        let msg = String::from_utf8_lossy(&out.stderr);
        assert!(msg.contains(key), "{body:?}: {msg}");
    }
    let out = run(&["check", "--config", "/nonexistent/fencegate.toml"], &[]);
    assert!(!out.status.success());
}

#[test]
fn the_shipped_sample_config_is_valid() {
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/config/fencegate.toml");
    let out = run(&["check", "--config", sample], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn demo_replays_the_race_shows_it_defeated_and_exits_zero() {
    let out = run(&["demo"], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("t4  Client2 PUT /accounts/42 token=34  -> 200 OK"), "{text}");
    assert!(text.contains("t6  Client1 PUT /accounts/42 token=33  -> 409 Conflict"), "{text}");
    assert!(text.contains("\"balance=200 (client2)\""), "{text}");
    assert!(!text.contains("UNEXPECTED"), "{text}");
}
