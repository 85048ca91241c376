//! fencegate under a supervisor: the service manager's notifications (sd_notify), read from a
//! datagram socket the test binds as systemd would, from the real binary; a stop during
//! start-up; and `/livez`, which notices a wedged serving runtime.

use crate::common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::builder::Deployment;
use common::process::Running;
use common::wait::DEADLINE;
use common::{Harness, poll_until, raw_request};
use tokio::net::UnixDatagram;

/// The notification socket a test listens on, as systemd's for a `Type=notify` service.
struct Manager {
    socket: UnixDatagram,
    path: std::path::PathBuf,
    _dir: tempfile::TempDir,
    /// `WATCHDOG=1` pings received so far.
    pings: usize,
}

impl Manager {
    fn bind() -> Manager {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let socket = UnixDatagram::bind(&path).unwrap();
        Manager { socket, path, _dir: dir, pings: 0 }
    }

    /// The next datagram, watchdog pings counted and left out.
    async fn next(&mut self) -> String {
        loop {
            let mut buf = vec![0u8; 4096];
            let n = tokio::time::timeout(DEADLINE, self.socket.recv(&mut buf))
                .await
                .unwrap_or_else(|_| panic!("no notification within {DEADLINE:?}"))
                .unwrap();
            let message = String::from_utf8(buf[..n].to_vec()).unwrap();
            if message == "WATCHDOG=1" {
                self.pings += 1;
                continue;
            }
            return message;
        }
    }
}

/// The value of `KEY=` in a notification.
fn field<'a>(message: &'a str, key: &str) -> Option<&'a str> {
    message.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
}

/// `CLOCK_MONOTONIC` in microseconds, as the test reads it.
fn monotonic_usec() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    now.tv_sec as u64 * 1_000_000 + now.tv_nsec as u64 / 1_000
}

#[tokio::test]
async fn the_service_manager_hears_ready_reloading_and_stopping_and_watchdog_pings() {
    let mut manager = Manager::bind();
    let mut d = Deployment::builder().config_extra("[admin]\nlisten = \"127.0.0.1:0\"").build().await;
    let mut cmd = d.command();
    // Pings every 100 ms.
    cmd.env("NOTIFY_SOCKET", &manager.path).env("WATCHDOG_USEC", "200000");
    d.running = Some(Running::spawn(cmd));

    // The first word is READY, and by then the addresses it names accept connections.
    let ready = manager.next().await;
    assert_eq!(field(&ready, "READY"), Some("1"), "{ready:?}");
    let status = field(&ready, "STATUS").unwrap_or_else(|| panic!("no STATUS in {ready:?}"));
    assert!(status.contains(&format!("serving on {}", d.addr())), "{status}");
    let admin: SocketAddr = status.split("admin API on ").nth(1).unwrap().parse().unwrap();
    assert_eq!(raw_request(admin, "GET /livez HTTP/1.1\r\nHost: x", "").await.status, 200);
    assert_eq!(common::raw::put(d.addr(), "/doc", 5).await, 200);

    // SIGHUP: RELOADING=1 with the monotonic clock's time, then READY=1 once applied.
    let before = monotonic_usec();
    d.proxy().signal("HUP");
    let reloading = manager.next().await;
    let after = monotonic_usec();
    assert_eq!(field(&reloading, "RELOADING"), Some("1"), "{reloading:?}");
    let at: u64 = field(&reloading, "MONOTONIC_USEC").expect("MONOTONIC_USEC").parse().unwrap();
    assert!((before..=after).contains(&at), "MONOTONIC_USEC={at} is not between {before} and {after}");
    let reloaded = manager.next().await;
    assert_eq!(field(&reloaded, "READY"), Some("1"), "{reloaded:?}");
    assert!(field(&reloaded, "STATUS").is_some_and(|s| s.contains("configuration reloaded")), "{reloaded:?}");

    // The watchdog: pings keep coming while the proxy serves.
    let (seen, start) = (manager.pings, std::time::Instant::now());
    while manager.pings < seen + 2 {
        assert!(start.elapsed() < DEADLINE, "no watchdog pings within {DEADLINE:?}");
        let other = tokio::time::timeout(Duration::from_millis(50), manager.next()).await;
        assert!(other.is_err(), "an unexpected notification: {other:?}");
    }

    // SIGTERM: STOPPING=1 as the drain starts, and a clean exit.
    d.proxy().signal("TERM");
    let stopping = manager.next().await;
    assert_eq!(field(&stopping, "STOPPING"), Some("1"), "{stopping:?}");
    assert!(field(&stopping, "STATUS").is_some_and(|s| s.contains("draining")), "{stopping:?}");
    let proxy = d.running.as_mut().unwrap();
    poll_until("the proxy exits", || proxy.exited().is_some()).await;
    assert!(proxy.exited().unwrap().success(), "{:?}", proxy.exited());
}

/// The stop handler is in place before the listener is bound and the store opened: a SIGTERM
/// during start-up is a drain once the proxy is up, not death by signal half-open.
#[tokio::test]
async fn sigterm_during_start_up_drains_once_the_proxy_is_up() {
    let mut d = Deployment::builder().build().await;
    let mut sent = false;
    // Spawning waits until the proxy listens: it fails if the signal ended the process.
    d.start_with(move |line, pid| {
        if !sent && line.contains("opening the fence store") {
            sent = true;
            common::process::signal(pid, "TERM");
        }
    });
    let proxy = d.running.as_mut().unwrap();
    poll_until("the proxy exits", || proxy.exited().is_some()).await;
    assert!(proxy.exited().unwrap().success(), "{:?}", proxy.exited());
    assert!(proxy.log_contains("fence store closed"));
}

/// A blocking GET on a connection of its own, from a thread that is not the test's runtime.
fn blocking_get(addr: SocketAddr, path: &str) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    answer
}

/// `/healthz` is answered by the admin API's own thread whatever the serving threads do;
/// `/livez` asks the serving runtime, and says when it does not run a task.
#[tokio::test]
async fn livez_says_when_the_serving_runtime_is_wedged() {
    // This test's runtime has one thread, and serves the proxy.
    let h = Harness::start().await;
    let admin = h.start_admin().await;
    let r = raw_request(admin, "GET /livez HTTP/1.1\r\nHost: x", "").await;
    assert_eq!((r.status, r.json()["status"].as_str()), (200, Some("ok")));

    // Wedge it: its only thread waits, blocked, for the answers.
    let answers = std::thread::spawn(move || (blocking_get(admin, "/healthz"), blocking_get(admin, "/livez")));
    let (health, live) = answers.join().unwrap();
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(live.starts_with("HTTP/1.1 503") && live.contains("wedged"), "{live}");

    let r = raw_request(admin, "GET /livez HTTP/1.1\r\nHost: x", "").await;
    assert_eq!(r.status, 200, "live again once it runs");
}
