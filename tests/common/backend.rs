//! Stub backends for what the in-memory store does not do. For the common case, a backend
//! that stores what it is sent and records the order it applied writes in, use the
//! library's own `fencegate::demo::MemBackend` (as [`super::Harness`] does).
//!
//! A stub speaks raw HTTP/1.1 over TCP, so it can close a connection at any moment without
//! announcing it, or never answer at all.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// What a stub does with one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// Answers `status` with `body`, and keeps the connection for the next request unless
    /// the client asked to close it.
    Answer(u16, &'static str),
    /// Answers like [`Reply::Answer`], then closes the connection without having said so
    /// (no `Connection: close`).
    AnswerThenClose(u16, &'static str),
    /// Closes the connection without answering.
    Close,
    /// Never answers, and keeps the connection open.
    Hang,
    /// Answers like [`Reply::Answer`] once the test calls [`StubBackend::release`] (at once
    /// after that), keeping the connection busy until then.
    Hold(u16, &'static str),
    /// Sends the head of an answer of `status` with `body` at once, and the body once the test
    /// calls [`StubBackend::release`]: as S3 answers a CompleteMultipartUpload, 200 before it
    /// has finished, keeping the connection until it has.
    HeadThenHold(u16, &'static str),
}

/// A request as a stub received it.
#[derive(Debug, Clone)]
pub struct Seen {
    /// Which connection it came on: 0 for the first the stub accepted.
    pub connection: usize,
    /// Which request on that connection: 0 for the first.
    pub nth: usize,
    /// Request line and headers, as sent.
    pub head: String,
}

#[derive(Debug, Default)]
struct Counts {
    accepted: AtomicUsize,
    closed: AtomicUsize,
    seen: Mutex<Vec<Seen>>,
    /// Set by `release`: held answers go out.
    released: AtomicBool,
    release: tokio::sync::Notify,
}

/// A stub backend on a loopback port; stops (and drops its connections) when dropped.
pub struct StubBackend {
    addr: SocketAddr,
    counts: Arc<Counts>,
    task: JoinHandle<()>,
}

impl StubBackend {
    /// A stub that gives every request `reply`.
    pub async fn start(reply: Reply) -> StubBackend {
        StubBackend::start_with(move |_| reply).await
    }

    /// A stub that asks `reply` what to do with each request.
    pub async fn start_with(reply: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> StubBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let counts = Arc::new(Counts::default());
        let (shared, reply) = (Arc::clone(&counts), Arc::new(reply));
        let task = tokio::spawn(async move {
            // Aborted with the accept loop, when the stub is dropped.
            let mut connections = JoinSet::new();
            while let Ok((sock, _)) = listener.accept().await {
                let connection = shared.accepted.fetch_add(1, Ordering::SeqCst);
                let (counts, reply) = (Arc::clone(&shared), Arc::clone(&reply));
                connections.spawn(async move {
                    if serve(sock, connection, &counts, &*reply).await {
                        counts.closed.fetch_add(1, Ordering::SeqCst);
                    }
                });
            }
        });
        StubBackend { addr, counts, task }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, for a fencegate config.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.counts.accepted.load(Ordering::SeqCst)
    }

    /// Connections the stub has closed (by [`Reply::AnswerThenClose`] or [`Reply::Close`], or
    /// after answering a `Connection: close` request); counted once the socket is closed.
    pub fn closed(&self) -> usize {
        self.counts.closed.load(Ordering::SeqCst)
    }

    /// Every request received, in arrival order.
    pub fn requests(&self) -> Vec<Seen> {
        self.counts.seen.lock().unwrap().clone()
    }

    /// Lets every [`Reply::Hold`] answer (and [`Reply::HeadThenHold`] body) go, the ones waiting and the ones to come.
    pub fn release(&self) {
        self.counts.released.store(true, Ordering::SeqCst);
        self.counts.release.notify_waiters();
    }
}

impl Drop for StubBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves one connection; true if the stub closed it (rather than the client).
async fn serve(
    mut sock: TcpStream,
    connection: usize,
    counts: &Counts,
    reply: &(dyn Fn(&Seen) -> Reply + Sync),
) -> bool {
    let mut buf = vec![0u8; 16 << 10];
    let mut pending = Vec::new();
    let mut nth = 0;
    loop {
        let head = loop {
            if let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                break String::from_utf8_lossy(&pending.drain(..end + 4).collect::<Vec<u8>>()).into_owned();
            }
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => pending.extend_from_slice(&buf[..n]),
            }
        };
        // Skip the body: by Content-Length, or to the end of a chunked one.
        let lower = head.to_ascii_lowercase();
        let length = lower.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse().ok());
        let chunked = lower.lines().any(|l| l.starts_with("transfer-encoding:") && l.trim_end().ends_with("chunked"));
        let client_closes = lower.lines().any(|l| l.starts_with("connection:") && l.contains("close"));
        loop {
            let body_end = match (length, chunked) {
                (_, true) => super::raw::chunked_len(&pending),
                (Some(len), false) => (pending.len() >= len).then_some(len),
                (None, false) => Some(0),
            };
            if let Some(end) = body_end {
                pending.drain(..end);
                break;
            }
            match sock.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => pending.extend_from_slice(&buf[..n]),
            }
        }
        let seen = Seen { connection, nth, head };
        let action = reply(&seen);
        counts.seen.lock().unwrap().push(seen);
        let answer =
            |status: u16, body: &str| format!("HTTP/1.1 {status} Stub\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        let released = async || loop {
            let released = counts.release.notified();
            if counts.released.load(Ordering::SeqCst) {
                break;
            }
            released.await;
        };
        if let Reply::Hold(..) = action {
            released().await;
        }
        match action {
            Reply::HeadThenHold(status, body) => {
                let head = format!("HTTP/1.1 {status} Stub\r\nContent-Length: {}\r\n\r\n", body.len());
                if sock.write_all(head.as_bytes()).await.is_err() {
                    return false;
                }
                released().await;
                if sock.write_all(body.as_bytes()).await.is_err() {
                    return false;
                }
                if client_closes {
                    return true;
                }
            }
            Reply::Answer(status, body) | Reply::Hold(status, body) => {
                if sock.write_all(answer(status, body).as_bytes()).await.is_err() {
                    return false;
                }
                if client_closes {
                    return true;
                }
            }
            Reply::AnswerThenClose(status, body) => {
                let _ = sock.write_all(answer(status, body).as_bytes()).await;
                return true;
            }
            Reply::Close => return true,
            Reply::Hang => std::future::pending::<()>().await,
        }
        nth += 1;
    }
}

/// A backend that answers each request as soon as it has read the head, then reads the body.
/// It logs `head T` and `body T` for the token T of each request, in the order it sees them. A
/// `HEAD` (a pinned write's) is answered `200` with `ETag: "v1"` and logged `HEAD`.
pub async fn early_answering_backend() -> (SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    early_answering_backend_with("201 Created", "").await
}

/// [`early_answering_backend`], answering `status` (`"409 Conflict"`) with `body`, which it
/// sends only once it has read the request's body: until then its answer is not complete.
pub async fn early_answering_backend_with(
    status: &'static str,
    body: &'static str,
) -> (SocketAddr, Arc<std::sync::Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = Arc::clone(&log);
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            let log = Arc::clone(&seen);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let head_end = loop {
                        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut chunk = [0u8; 4096];
                        match tcp.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                    let field = |name: &str| {
                        head.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_owned()).unwrap_or_default()
                    };
                    let (token, length) = (field("fencing-token:"), field("content-length:").parse().unwrap_or(0));
                    buf.drain(..head_end);
                    if head.starts_with("head ") {
                        log.lock().unwrap().push("HEAD".to_owned());
                        let tagged = b"HTTP/1.1 200 OK\r\netag: \"v1\"\r\ncontent-length: 0\r\n\r\n";
                        if tcp.write_all(tagged).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    log.lock().unwrap().push(format!("head {token}"));
                    let answer = format!("HTTP/1.1 {status}\r\ncontent-length: {}\r\n\r\n", body.len());
                    if tcp.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    while buf.len() < length {
                        let mut chunk = [0u8; 4096];
                        match tcp.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..length);
                    log.lock().unwrap().push(format!("body {token}"));
                    if tcp.write_all(body.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, log)
}
