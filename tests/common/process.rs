//! Running the real `fencegate` binary.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::try_raw_request;

pub const BIN: &str = env!("CARGO_BIN_EXE_fencegate");

/// Writes a config for a proxy on port 0 in front of `backend`, data in `dir/data`, with
/// `store_extra` appended to the `[store]` section.
pub fn write_config(dir: &Path, backend: &str, store_extra: &str) -> PathBuf {
    let path = dir.join("fencegate.toml");
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[backend]\nurl = \"{backend}\"\n[store]\ndir = {:?}\n{store_extra}\n",
        data_dir(dir).display().to_string()
    );
    std::fs::write(&path, text).unwrap();
    path
}

pub fn data_dir(dir: &Path) -> PathBuf {
    dir.join("data")
}

/// A running `fencegate run` process, the address it reported, and its log lines.
pub struct Running {
    child: Child,
    pub addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
}

impl Running {
    pub fn start(config: &Path) -> Running {
        let mut cmd = Command::new(BIN);
        cmd.args(["run", "--config"]).arg(config);
        Running::spawn(cmd)
    }

    /// Spawns `cmd` (which must end up exec'ing `fencegate run`) and waits for its address.
    pub fn spawn(mut cmd: Command) -> Running {
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        let lines = Arc::clone(&log);
        // Keep draining stderr after the address is found so the child never blocks on it.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("fencegate listening") {
                    // Text logs say addr=IP:PORT, JSON logs "addr":"IP:PORT".
                    let text = line.split("addr=").nth(1).and_then(|s| s.split_whitespace().next());
                    let json = line.split("\"addr\":\"").nth(1).and_then(|s| s.split('"').next());
                    if let Some(addr) = text.or(json).and_then(|a| a.parse::<SocketAddr>().ok()) {
                        let _ = tx.send(addr);
                    }
                }
                lines.lock().unwrap().push(line);
            }
        });
        let addr = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_else(|_| {
            panic!("fencegate did not report its address; log:\n{}", log.lock().unwrap().join("\n"))
        });
        Running { child, addr, log }
    }

    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        self.log.lock().unwrap().iter().filter(|l| l.contains(needle)).cloned().collect()
    }

    pub fn log_contains(&self, needle: &str) -> bool {
        self.log.lock().unwrap().iter().any(|l| l.contains(needle))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill9(self) {
        drop(self); // SIGKILL on Unix, then reaped
    }
}

impl Drop for Running {
    /// Also when a test panics: never leave a proxy running behind.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fenced PUT; 0 when no response came back (the proxy died).
pub async fn put(addr: SocketAddr, path: &str, token: u64) -> u16 {
    put_response(addr, path, token).await.map_or(0, |r| r.status)
}

pub async fn put_response(addr: SocketAddr, path: &str, token: u64) -> Option<super::Resp> {
    let head = format!("PUT {path} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}");
    try_raw_request(addr, &head, "v").await
}
