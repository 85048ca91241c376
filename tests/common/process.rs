//! Running the real `fencegate` binary. [`super::builder::Deployment`] sets one up with its
//! backend, data dir and config.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStderr, Command, ExitStatus, Stdio};
use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

use super::logs::Log;

pub const BIN: &str = env!("CARGO_BIN_EXE_fencegate");

/// A running `fencegate run` process, the address it reported, and its log. If the test
/// panics, dropping it prints the log, so a failure shows what the proxy said.
pub struct Running {
    child: Child,
    pub addr: SocketAddr,
    log: Log,
}

impl Running {
    /// Spawns `cmd` (which must end up exec'ing `fencegate run`) and waits for its address.
    pub fn spawn(cmd: Command) -> Running {
        Running::spawn_with(cmd, |_, _| {})
    }

    /// Like [`Running::spawn`]; `on_line(line, pid)` sees each log line the moment it is
    /// read, from start-up on (to signal the process at a given point of its start, say).
    pub fn spawn_with(mut cmd: Command, mut on_line: impl FnMut(&str, u32) + Send + 'static) -> Running {
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let pid = child.id();
        let (tx, rx) = std::sync::mpsc::channel();
        let log = Log::capture(child.stderr.take().unwrap(), move |line| {
            on_line(line, pid);
            if line.contains("fencegate listening")
                && let Some(addr) = logged_addr(line)
            {
                let _ = tx.send(addr);
            }
        });
        // From here on, dropping it (also on the panics below) kills the process and shows its log.
        let mut running = Running { child, addr: "0.0.0.0:0".parse().unwrap(), log };
        running.addr = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(addr) => addr,
            // Its log ended: it exited.
            Err(RecvTimeoutError::Disconnected) => panic!("fencegate ended before it listened: {:?}", running.exited()),
            Err(RecvTimeoutError::Timeout) => panic!("fencegate did not report its address within 30 s"),
        };
        running
    }

    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        self.log.lines(needle)
    }

    pub fn log_contains(&self, needle: &str) -> bool {
        self.log.contains(needle)
    }

    /// Waits until `needle` has appeared in `count` log lines in all.
    pub async fn wait_for_log(&self, needle: &str, count: usize) {
        self.log.wait_for(needle, count).await
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The admin API's address (`admin.listen` set to port 0), once it has logged it.
    pub async fn admin_addr(&self) -> SocketAddr {
        self.wait_for_log("admin API listening", 1).await;
        let line = self.log_lines("admin API listening").remove(0);
        logged_addr(&line).unwrap_or_else(|| panic!("no address in {line:?}"))
    }

    /// Sends the signal `name` ("HUP", "TERM", ...).
    pub fn signal(&self, name: &str) {
        signal(self.pid(), name);
    }

    /// Stops the process with SIGTERM, as an operator would, and waits until it has exited
    /// and its last log lines are in.
    pub fn terminate(&mut self) -> ExitStatus {
        self.signal("TERM");
        let status = self.child.wait().unwrap();
        self.log.wait_for_end();
        status
    }

    /// The exit status, once the process has ended.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
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
        if std::thread::panicking() {
            self.log.wait_for_end();
            eprintln!("--- log of fencegate (pid {}) ---\n{}\n--- end of log ---", self.child.id(), self.log.text());
        }
    }
}

/// Sends the signal `name` to process `pid`.
pub fn signal(pid: u32, name: &str) {
    let status = Command::new("kill").args(["-s", name, &pid.to_string()]).status().unwrap();
    assert!(status.success(), "kill -s {name} {pid}: {status}");
}

/// The address a "... listening" line names: text logs say addr=IP:PORT, JSON logs
/// "addr":"IP:PORT".
fn logged_addr(line: &str) -> Option<SocketAddr> {
    let text = line.split("addr=").nth(1).and_then(|s| s.split_whitespace().next());
    let json = line.split("\"addr\":\"").nth(1).and_then(|s| s.split('"').next());
    text.or(json).and_then(|a| a.parse().ok())
}

/// The scheduling policy (`SCHED_*`, from /proc) of each of process `pid`'s threads named
/// `name`.
pub fn thread_policies(pid: u32, name: &str) -> Vec<u32> {
    let mut policies = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else { continue };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        if &stat[open + 1..close] == name {
            // Field 41 of stat: the 39th after the command name's closing parenthesis.
            policies.push(stat[close + 2..].split(' ').nth(38).unwrap().parse().unwrap());
        }
    }
    policies
}

/// The descriptors process `pid` has open now, by number.
pub fn open_fds(pid: u32) -> Vec<u32> {
    let entries = std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap();
    entries.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect()
}

/// A `fencegate run` process (with `admin.listen` set) whose stderr is read only until it
/// says where it listens, and from then on never: the pipe stays open and fills, as when
/// whatever collects the log stalls.
pub struct Unread {
    child: Child,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    /// The lines read before the reading stopped, shown if the test panics.
    head: Vec<String>,
    /// The rest of the pipe, held open and unread.
    _stderr: BufReader<ChildStderr>,
}

impl Unread {
    /// Spawns `cmd` (which must end up exec'ing `fencegate run`) and reads its log until both
    /// the proxy and the admin API listen.
    pub fn spawn(mut cmd: Command) -> Unread {
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (mut addr, mut admin, mut head) = (None, None, Vec::new());
            let mut line = String::new();
            while addr.is_none() || admin.is_none() {
                line.clear();
                if stderr.read_line(&mut line).unwrap_or(0) == 0 {
                    let _ = tx.send(Err(head));
                    return;
                }
                let line = line.trim_end().to_owned();
                if line.contains("fencegate listening") {
                    addr = logged_addr(&line);
                } else if line.contains("admin API listening") {
                    admin = logged_addr(&line);
                }
                head.push(line);
            }
            let _ = tx.send(Ok((addr.unwrap(), admin.unwrap(), head, stderr)));
        });
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok((addr, admin, head, stderr))) => Unread { child, addr, admin, head, _stderr: stderr },
            Ok(Err(head)) => {
                let _ = child.wait();
                panic!("fencegate ended before it listened:\n{}", head.join("\n"))
            }
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("fencegate did not report both addresses within 30 s")
            }
        }
    }
}

impl Drop for Unread {
    /// Also when a test panics: never leave a proxy running behind.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- start of the log of fencegate (pid {}) ---\n{}", self.child.id(), self.head.join("\n"));
        }
    }
}
