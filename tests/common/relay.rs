//! A TCP relay between fencegate and its backend that the test controls: the write a backend
//! applies late, made to order (docs/pins.md).
//!
//! Every connection accepted is relayed to the backend byte for byte, answers as they come.
//! On the way in, the relay recognises each request (request line, headers, and a body framed
//! by `Content-Length` or chunked) and keeps a record of it. A test arms a [`Hold`] for the next
//! request a predicate matches: that request is not sent on, so the client (fencegate) gets no
//! answer on that connection, times out and quarantines the resource; nothing else on that
//! connection is sent on either. Once the hold is over, the relay sends the held bytes, exactly
//! as they arrived, to the backend on a fresh connection of its own and reads the answer,
//! which goes nowhere but into [`Delivered`]: a request stuck in a buffer and applied late.
//! Each request is sent on once the whole of it has arrived (so the relay can tell whether to
//! hold it): a client that waits for `100 Continue` before its body would wait for ever.
//!
//! The test awaits [`Hold::held`] and [`Hold::delivered`] instead of sleeping. The hold's
//! duration is counted from the moment the request is held, on the real clock (the relay
//! carries real loopback traffic); a gated hold ([`Relay::hold_next_gated`]) waits in
//! addition for [`Hold::release`], so a test decides what happens before the late delivery
//! instead of racing it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use super::Resp;
use super::raw::{chunked_len, parse_response, response_len};
use super::wait::{DEADLINE, filled};

/// One request as the relay recognised it on its way to the backend.
#[derive(Debug, Clone)]
pub struct Request {
    /// Which client connection it came on: 0 for the first the relay accepted.
    pub connection: usize,
    pub method: String,
    pub target: String,
    /// In order, names as sent.
    pub headers: Vec<(String, String)>,
    /// As framed on the wire (still chunked if it was sent chunked).
    pub body: Vec<u8>,
    /// Every byte of it, head and body, as it arrived.
    pub raw: Vec<u8>,
}

impl Request {
    /// The first value of header `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// Its `Fencing-Token`, if it carries a number there.
    pub fn token(&self) -> Option<u64> {
        self.header("fencing-token")?.trim().parse().ok()
    }
}

/// A predicate for [`Relay::hold_next`]: a `method` request with `Fencing-Token: token`.
pub fn method_with_token(method: &'static str, token: u64) -> impl Fn(&Request) -> bool + Send + Sync + 'static {
    move |r| r.method == method && r.token() == Some(token)
}

/// What became of a held request once the relay delivered it.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub request: Request,
    /// The backend's answer to it, which nobody else saw; `None` if the backend closed the
    /// connection without a whole answer.
    pub response: Option<Resp>,
    /// When the request was held, and when its bytes were written to the backend.
    pub held_at: Instant,
    pub sent_at: Instant,
}

type Matcher = Box<dyn Fn(&Request) -> bool + Send + Sync>;

/// A hold armed but not yet taken by a request.
struct Armed {
    matches: Matcher,
    at_least: Duration,
    gate: Option<watch::Receiver<bool>>,
    held: watch::Sender<Option<(Request, Instant)>>,
    delivered: watch::Sender<Option<Delivered>>,
}

struct Shared {
    backend: SocketAddr,
    accepted: AtomicUsize,
    armed: Mutex<Vec<Armed>>,
    seen: Mutex<Vec<Request>>,
    sent: Mutex<Vec<Request>>,
    /// Per client connection, the whole answers relayed back on it.
    answers: Mutex<HashMap<usize, usize>>,
    /// The late deliveries, aborted with the relay.
    deliveries: Mutex<JoinSet<()>>,
}

/// A relay on a loopback port in front of `backend`; stops (and drops every connection and
/// pending delivery) when dropped.
pub struct Relay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

impl Relay {
    pub async fn start(backend: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            backend,
            accepted: AtomicUsize::new(0),
            armed: Mutex::new(Vec::new()),
            seen: Mutex::new(Vec::new()),
            sent: Mutex::new(Vec::new()),
            answers: Mutex::new(HashMap::new()),
            deliveries: Mutex::new(JoinSet::new()),
        });
        let accepting = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            // Aborted with the accept loop, when the relay is dropped.
            let mut connections = JoinSet::new();
            while let Ok((client, _)) = listener.accept().await {
                let connection = accepting.accepted.fetch_add(1, Ordering::SeqCst);
                connections.spawn(relay(client, connection, Arc::clone(&accepting)));
            }
        });
        Relay { addr, shared, task }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, for a fencegate config.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every request recognised so far, held ones included, in arrival order.
    pub fn requests(&self) -> Vec<Request> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// Every request written to the backend so far, in the order the relay wrote them: the
    /// ones relayed as they came, and each held one when it is delivered.
    pub fn sent(&self) -> Vec<Request> {
        self.shared.sent.lock().unwrap().clone()
    }

    /// Whether the backend's whole answer to `request` (relayed as it came, not held) has gone
    /// back to the client: a client sends its next request on a connection only after the
    /// answer to the last one.
    pub fn answered(&self, request: &Request) -> bool {
        let on_it: Vec<Request> = self.requests().into_iter().filter(|r| r.connection == request.connection).collect();
        let Some(nth) = on_it.iter().position(|r| r.raw == request.raw) else { return false };
        self.shared.answers.lock().unwrap().get(&request.connection).is_some_and(|&n| n > nth)
    }

    /// Holds the next request `matches` accepts, and delivers it `duration` after it was
    /// held. Holds armed together are tried in the order they were armed; each takes one
    /// request.
    pub fn hold_next(&self, matches: impl Fn(&Request) -> bool + Send + Sync + 'static, duration: Duration) -> Hold {
        self.arm(Box::new(matches), duration, false)
    }

    /// Like [`Relay::hold_next`], but delivers it only once the test has called
    /// [`Hold::release`] and at least `at_least` has passed since it was held.
    pub fn hold_next_gated(
        &self,
        matches: impl Fn(&Request) -> bool + Send + Sync + 'static,
        at_least: Duration,
    ) -> Hold {
        self.arm(Box::new(matches), at_least, true)
    }

    fn arm(&self, matches: Matcher, at_least: Duration, gated: bool) -> Hold {
        let (gate_tx, gate_rx) = watch::channel(false);
        let (held_tx, held) = watch::channel(None);
        let (delivered_tx, delivered) = watch::channel(None);
        self.shared.armed.lock().unwrap().push(Armed {
            matches,
            at_least,
            gate: gated.then_some(gate_rx),
            held: held_tx,
            delivered: delivered_tx,
        });
        Hold { gate: gate_tx, held, delivered }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
        self.shared.deliveries.lock().unwrap().abort_all();
    }
}

/// One armed hold, as the test sees it.
pub struct Hold {
    gate: watch::Sender<bool>,
    held: watch::Receiver<Option<(Request, Instant)>>,
    delivered: watch::Receiver<Option<Delivered>>,
}

impl Hold {
    /// Waits until a request is held, and returns it; panics after [`DEADLINE`].
    pub async fn held(&mut self) -> Request {
        filled(&mut self.held, "no request held").await.0
    }

    /// Whether a request is held (or was, and has been delivered since).
    pub fn is_held(&self) -> bool {
        self.held.borrow().is_some()
    }

    /// Whether the held request has been delivered.
    pub fn is_delivered(&self) -> bool {
        self.delivered.borrow().is_some()
    }

    /// Lets a gated hold deliver its request (once its minimum duration is over). No effect on
    /// a hold that is not gated.
    pub fn release(&self) {
        self.gate.send_replace(true);
    }

    /// Waits until the held request has been delivered and answered, and returns what
    /// happened; panics after [`DEADLINE`].
    pub async fn delivered(&mut self) -> Delivered {
        filled(&mut self.delivered, "the held request was not delivered").await
    }
}

/// Relays one client connection until either side ends it.
async fn relay(client: TcpStream, connection: usize, shared: Arc<Shared>) {
    let Ok(backend) = TcpStream::connect(shared.backend).await else {
        return; // the client sees its connection close, as from a dead backend
    };
    let (mut client_rx, client_tx) = client.into_split();
    let (mut backend_rx, mut backend_tx) = backend.into_split();
    // Answers flow back untouched.
    let counting = Arc::clone(&shared);
    let answers = tokio::spawn(async move { copy_answers(&mut backend_rx, client_tx, connection, &counting).await });
    let mut pending = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    let held = 'connection: loop {
        while let Some(len) = request_len(&pending) {
            let raw: Vec<u8> = pending.drain(..len).collect();
            let request = parse_request(connection, raw);
            shared.seen.lock().unwrap().push(request.clone());
            if let Some(armed) = take_hold(&shared, &request) {
                deliver_later(&shared, armed, request);
                break 'connection true;
            }
            shared.sent.lock().unwrap().push(request.clone());
            if backend_tx.write_all(&request.raw).await.is_err() {
                break 'connection false;
            }
        }
        match client_rx.read(&mut buf).await {
            Ok(0) | Err(_) => break false,
            Ok(n) => pending.extend_from_slice(&buf[..n]),
        }
    };
    if held {
        // The connection forwards nothing more, and answers nothing more: fencegate gives up
        // on it. What the client still sends is read and dropped until it closes.
        while matches!(client_rx.read(&mut buf).await, Ok(n) if n > 0) {}
        answers.abort();
    } else {
        // The client is done sending: so is the relay, and the answers still coming go back.
        let _ = backend_tx.shutdown().await;
        let _ = answers.await;
    }
}

/// Copies answers back as they come, counting each whole one in [`Shared::answers`].
async fn copy_answers(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    mut to: OwnedWriteHalf,
    connection: usize,
    shared: &Shared,
) {
    let mut buf = vec![0u8; 64 << 10];
    let mut pending = Vec::new();
    while let Ok(n) = from.read(&mut buf).await {
        if n == 0 || to.write_all(&buf[..n]).await.is_err() {
            break;
        }
        pending.extend_from_slice(&buf[..n]);
        while let Some(len) = response_len(&pending, false) {
            pending.drain(..len);
            *shared.answers.lock().unwrap().entry(connection).or_default() += 1;
        }
    }
    let _ = to.shutdown().await;
}

/// Removes and returns the first armed hold that matches `request`.
fn take_hold(shared: &Shared, request: &Request) -> Option<Armed> {
    let mut armed = shared.armed.lock().unwrap();
    let at = armed.iter().position(|a| (a.matches)(request))?;
    Some(armed.remove(at))
}

fn deliver_later(shared: &Arc<Shared>, armed: Armed, request: Request) {
    let held_at = Instant::now();
    armed.held.send_replace(Some((request.clone(), held_at)));
    let backend = shared.backend;
    let record = Arc::clone(shared);
    shared.deliveries.lock().unwrap().spawn(async move {
        tokio::time::sleep(armed.at_least).await;
        if let Some(mut gate) = armed.gate {
            // The `Hold` gone (its test over) means no release will come.
            if gate.wait_for(|open| *open).await.is_err() {
                return;
            }
        }
        let mut stream =
            TcpStream::connect(backend).await.unwrap_or_else(|e| panic!("relay: connect to {backend}: {e}"));
        let sent_at = Instant::now();
        record.sent.lock().unwrap().push(request.clone());
        stream.write_all(&request.raw).await.unwrap_or_else(|e| panic!("relay: late delivery to {backend}: {e}"));
        let response = read_response(&mut stream).await;
        armed.delivered.send_replace(Some(Delivered { request, response, held_at, sent_at }));
    });
}

/// Reads one whole response, or `None` if the connection ends without one.
async fn read_response(stream: &mut TcpStream) -> Option<Resp> {
    let mut raw = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        if let Some(len) = response_len(&raw, false) {
            return parse_response(&raw[..len]);
        }
        let n = tokio::time::timeout(DEADLINE, stream.read(&mut buf)).await.ok()?.ok()?;
        if n == 0 {
            return parse_response(&raw[..response_len(&raw, true)?]);
        }
        raw.extend_from_slice(&buf[..n]);
    }
}

/// The length of the first request in `raw` once all of it has arrived.
fn request_len(raw: &[u8]) -> Option<usize> {
    let head_end = raw.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&raw[..head_end]).to_ascii_lowercase();
    let header = |name: &str| {
        head.split("\r\n")
            .skip(1)
            .find_map(|l| l.split_once(':').filter(|(k, _)| k.trim() == name).map(|(_, v)| v.trim()))
    };
    if header("transfer-encoding").is_some_and(|v| v.ends_with("chunked")) {
        Some(head_end + chunked_len(&raw[head_end..])?)
    } else {
        let len: usize = header("content-length").map_or(0, |v| v.parse().expect("relay: a numeric Content-Length"));
        (raw.len() >= head_end + len).then_some(head_end + len)
    }
}

/// `raw` is one whole request ([`request_len`]).
fn parse_request(connection: usize, raw: Vec<u8>) -> Request {
    let head_end = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a whole request") + 4;
    let head = String::from_utf8_lossy(&raw[..head_end - 4]).into_owned();
    let mut lines = head.split("\r\n");
    let mut line = lines.next().unwrap_or_default().split(' ');
    let method = line.next().unwrap_or_default().to_owned();
    let target = line.next().unwrap_or_default().to_owned();
    let headers =
        lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned())).collect();
    let body = raw[head_end..].to_vec();
    Request { connection, method, target, headers, body, raw }
}
