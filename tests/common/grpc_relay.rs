//! An HTTP/2 relay between fencegate's etcd client and a real etcd that the test controls: a
//! gRPC call etcd takes late, made to order (tests/cluster/etcd_batches.rs).
//!
//! Every call is relayed to etcd as it comes, answers as they come; streams (watches, lease
//! renewals) pass through as streams. A test arms a [`Hold`] for the next unary call a
//! predicate matches: that call is not sent on and never answered, so the client times out
//! and cancels it; the other calls on the connection go on. Once the hold is released, the
//! relay sends the held call, exactly as it arrived, to etcd on a fresh connection of its own
//! and reads the answer, which goes nowhere but into [`Delivered`]: a call stuck in a buffer and
//! taken late.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use super::wait::filled;

/// The gRPC methods that are streams: relayed as such, never held.
const STREAMS: &[&str] = &["/etcdserverpb.Watch/Watch", "/etcdserverpb.Lease/LeaseKeepAlive"];

/// One call as the relay saw it on its way to etcd.
#[derive(Debug, Clone)]
pub struct Call {
    /// Its place among the calls the relay received, from 0.
    pub id: usize,
    /// The gRPC method: `/etcdserverpb.KV/Txn`.
    pub path: String,
    /// A unary call's request, as framed by gRPC; empty for a stream.
    pub body: Bytes,
}

/// What became of a held call once the relay delivered it.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub call: Call,
    /// etcd's answer to it, which nobody else saw; `None` if the connection failed first.
    pub answer: Option<Answer>,
}

/// A unary call's answer.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The `grpc-status` it ended with (0: OK).
    pub grpc_status: Option<u32>,
    /// Its one message, without gRPC's framing.
    pub message: Bytes,
}

type Matcher = Box<dyn Fn(&Call) -> bool + Send + Sync>;
type Outgoing = BoxBody<Bytes, hyper::Error>;

/// A hold armed but not yet taken by a call.
struct Armed {
    matches: Matcher,
    gate: watch::Receiver<bool>,
    held: watch::Sender<Option<Call>>,
    delivered: watch::Sender<Option<Delivered>>,
}

struct Shared {
    backend: SocketAddr,
    client: Client<HttpConnector, Outgoing>,
    received: AtomicUsize,
    armed: Mutex<Vec<Armed>>,
    sent: Mutex<Vec<Call>>,
    answered: Mutex<HashSet<usize>>,
    /// The late deliveries, aborted with the relay.
    deliveries: Mutex<JoinSet<()>>,
}

/// A relay on a loopback port in front of the etcd member at `backend`; stops (and drops
/// every connection and pending delivery) when dropped.
pub struct GrpcRelay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

fn http2_client() -> Client<HttpConnector, Outgoing> {
    Client::builder(TokioExecutor::new()).http2_only(true).build(HttpConnector::new())
}

impl GrpcRelay {
    pub async fn start(backend: SocketAddr) -> GrpcRelay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            backend,
            client: http2_client(),
            received: AtomicUsize::new(0),
            armed: Mutex::new(Vec::new()),
            sent: Mutex::new(Vec::new()),
            answered: Mutex::new(HashSet::new()),
            deliveries: Mutex::new(JoinSet::new()),
        });
        let accepting = Arc::clone(&shared);
        let task = tokio::spawn(async move {
            // Aborted with the accept loop, when the relay is dropped.
            let mut connections = JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                let shared = Arc::clone(&accepting);
                let service = service_fn(move |req| relay(Arc::clone(&shared), req));
                connections.spawn(async move {
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        GrpcRelay { addr, shared, task }
    }

    /// `http://ADDR`, for an etcd client.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every call sent to etcd so far, in the order the relay sent them: the ones relayed as
    /// they came, and each held one when it is delivered.
    pub fn sent(&self) -> Vec<Call> {
        self.shared.sent.lock().unwrap().clone()
    }

    /// Whether etcd's answer to `call` (relayed as it came, not held) has gone back.
    pub fn answered(&self, call: &Call) -> bool {
        self.shared.answered.lock().unwrap().contains(&call.id)
    }

    /// Holds the next unary call `matches` accepts, and delivers it once the test has called
    /// [`Hold::release`]. Holds armed together are tried in the order they were armed; each
    /// takes one call.
    pub fn hold_next_gated(&self, matches: impl Fn(&Call) -> bool + Send + Sync + 'static) -> Hold {
        let (gate_tx, gate) = watch::channel(false);
        let (held_tx, held) = watch::channel(None);
        let (delivered_tx, delivered) = watch::channel(None);
        let armed = Armed { matches: Box::new(matches), gate, held: held_tx, delivered: delivered_tx };
        self.shared.armed.lock().unwrap().push(armed);
        Hold { gate: gate_tx, held, delivered }
    }
}

impl Drop for GrpcRelay {
    fn drop(&mut self) {
        self.task.abort();
        self.shared.deliveries.lock().unwrap().abort_all();
    }
}

/// One armed hold, as the test sees it.
pub struct Hold {
    gate: watch::Sender<bool>,
    held: watch::Receiver<Option<Call>>,
    delivered: watch::Receiver<Option<Delivered>>,
}

impl Hold {
    /// Waits until a call is held, and returns it; panics after [`super::wait::DEADLINE`].
    pub async fn held(&mut self) -> Call {
        filled(&mut self.held, "no call held").await
    }

    /// Lets the hold deliver its call.
    pub fn release(&self) {
        self.gate.send_replace(true);
    }

    /// Waits until the held call has been delivered and answered, and returns what happened;
    /// panics after [`super::wait::DEADLINE`].
    pub async fn delivered(&mut self) -> Delivered {
        filled(&mut self.delivered, "the held call was not delivered").await
    }
}

/// Relays one call: a stream as it flows, a unary call once its request is whole (held, or
/// sent on and answered).
async fn relay(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Incoming>, std::io::Error> {
    let id = shared.received.fetch_add(1, Ordering::SeqCst);
    let path = req.uri().path().to_owned();
    let (mut parts, body) = req.into_parts();
    parts.uri = format!("http://{}{path}", shared.backend).parse().unwrap();
    let (body, call): (Outgoing, Call) = if STREAMS.contains(&path.as_str()) {
        (body.boxed(), Call { id, path, body: Bytes::new() })
    } else {
        let Ok(whole) = body.collect().await else { return Err(gone()) };
        let bytes = whole.to_bytes();
        let call = Call { id, path, body: bytes.clone() };
        if let Some(armed) = take_hold(&shared, &call) {
            deliver_later(&shared, armed, call, parts);
            // Never answered: the client gives up on the call and resets its stream.
            return std::future::pending().await;
        }
        (Full::new(bytes).map_err(|never| match never {}).boxed(), call)
    };
    shared.sent.lock().unwrap().push(call);
    match shared.client.request(Request::from_parts(parts, body)).await {
        Ok(resp) => {
            shared.answered.lock().unwrap().insert(id);
            Ok(resp)
        }
        Err(_) => Err(gone()),
    }
}

/// Why a call the relay could not carry is reset (`RST_STREAM`), as by a lost connection.
fn gone() -> std::io::Error {
    std::io::Error::other("relay: the call could not be carried to etcd")
}

/// Removes and returns the first armed hold that matches `call`.
fn take_hold(shared: &Shared, call: &Call) -> Option<Armed> {
    let mut armed = shared.armed.lock().unwrap();
    let at = armed.iter().position(|a| (a.matches)(call))?;
    Some(armed.remove(at))
}

fn deliver_later(shared: &Arc<Shared>, armed: Armed, call: Call, parts: http::request::Parts) {
    armed.held.send_replace(Some(call.clone()));
    let record = Arc::clone(shared);
    shared.deliveries.lock().unwrap().spawn(async move {
        let mut gate = armed.gate;
        // The `Hold` gone (its test over) means no release will come.
        if gate.wait_for(|open| *open).await.is_err() {
            return;
        }
        record.sent.lock().unwrap().push(call.clone());
        // A connection of its own, as a request stuck elsewhere would arrive on.
        let body = Full::new(call.body.clone()).map_err(|never| match never {}).boxed();
        let answer = match http2_client().request(Request::from_parts(parts, body)).await {
            Ok(resp) => match resp.into_body().collect().await {
                Ok(whole) => {
                    let grpc_status =
                        whole.trailers().and_then(|t| t.get("grpc-status")).and_then(|v| v.to_str().ok()?.parse().ok());
                    let framed = whole.to_bytes();
                    Some(Answer { grpc_status, message: framed.slice(5.min(framed.len())..) })
                }
                Err(_) => None,
            },
            Err(_) => None,
        };
        armed.delivered.send_replace(Some(Delivered { call, answer }));
    });
}
