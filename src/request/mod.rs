//! One request's path through fencegate: [`classify`] it (pure, through the backend's
//! [`protocol`]), then forward it at once, or, for a fenced write, take it through its phases
//! ([`fenced`]: where it is fenced, its proof ([`proof`]), the early check, its turn, and the
//! turn's own steps); every refusal becomes fencegate's own answer, in the words of
//! [`crate::refusal`] and the form of the protocol.

/// `fut` in a new pinned box, built in place (`Box::write`) rather than built and then moved
/// there: a fenced write's futures and an Envoy exchange's are large (kilobytes), and a move is
/// a copy of all of it.
macro_rules! boxed_in_place {
    ($fut:expr) => {
        Box::into_pin(Box::write(Box::new_uninit(), $fut))
    };
}

mod access;
pub mod classify;
pub(crate) mod envoy;
mod fenced;
pub mod holders;
mod lapsed;
mod pinned;
pub mod proof;
pub mod protocol;
pub(crate) mod rules;

use std::sync::Arc;
use std::time::Instant;

use http::header::{CONNECTION, EXPECT, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, Version};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Body as _;
use hyper::body::Incoming;

use crate::refusal::{ERROR_NAME, Refusal, throttle};
use crate::state::{Metrics, Settings, State};
pub use crate::upstream::ResponseBody;
use crate::upstream::{Connection, Hold, Peer, RequestBody, full_body, remove_held};
use classify::{Head, Plan};
use proof::Guess;
use protocol::Protocol as _;

/// Handles one request; every refusal becomes fencegate's own answer, in the backend's
/// protocol.
pub(crate) async fn handle(state: Arc<State>, req: Request<Incoming>, client: Peer) -> Response<ResponseBody> {
    let started = Instant::now();
    let method = req.method().clone();
    // For the refusal's log line: a reference count, not a copy.
    let uri = req.uri().clone();
    // One snapshot of the settings for the whole request, however long it takes.
    let settings = state.settings.get();
    let log = &settings.config.log;
    let mut access = if log.access { access::Entry::start(&req, &client, log.access_format, started) } else { None };
    let protocol = protocol::for_backend(&settings.config.backend);
    // A client that sent `Expect: 100-continue` sends its body only after a 100, which a
    // refusal never gives (a refusal leaves the body unread), so hyper ends the HTTP/1
    // connection after the answer. The refusal says so (below): otherwise a client that pools
    // connections may send its next request on the closing one, and boto3 then reports a 409
    // that no server sent. (hyper drains a body that has arrived and keeps the connection;
    // one read whole to be classified, which gets its 100, closes it too.)
    let closes = req.version() < Version::HTTP_2
        && !req.body().is_end_stream()
        && req.headers().get(EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let req = req.map(RequestBody::Streamed);
    let classified = match protocol.classify(&Head::of(&req), &settings.config) {
        Ok(Plan::ReadBody { limit }) => read_whole(req, limit, protocol, &settings).await,
        Ok(plan) => Ok((req, plan)),
        Err(refusal) => Err(refusal),
    };
    let result = match classified {
        Ok((req, plan)) => {
            if let Some(entry) = access.as_mut() {
                entry.plan(&plan);
            }
            let guess = Guess::of(&plan, &req, &client, &settings, &state);
            match guess.as_ref().map_or(Ok(()), |g| g.admit(&state)) {
                Err(refusal) => Err(refusal),
                Ok(()) => {
                    // The plan carried out: forwarded at once, or fenced first ([`fenced`]).
                    let result = match plan {
                        Plan::Pass { target } => {
                            let out = Outgoing { req, target, client: client.clone(), body_limit: None };
                            forward(&state, &settings, out).await
                        }
                        Plan::Unchecked { target, body_limit } => {
                            forward(&state, &settings, Outgoing { req, target, client: client.clone(), body_limit })
                                .await
                        }
                        Plan::Write(write) => {
                            let (state, settings) = (Arc::clone(&state), Arc::clone(&settings));
                            fenced::fence(state, settings, req, write, client.clone(), protocol).await
                        }
                        // Read and classified again above.
                        Plan::ReadBody { .. } => Err(Refusal::BadRequest("the body was read already".into())),
                    };
                    if let Some(guess) = guess {
                        guess.count(&state, &result);
                    }
                    result
                }
            }
        }
        Err(refusal) => Err(refusal),
    };
    let resp = match result {
        Ok(resp) => {
            state.metrics.request(&method, "forwarded");
            if let Some(entry) = access {
                entry.log("forwarded", Some(resp.status()), Some(resp.status()), resp.body().size_hint().exact());
            }
            resp
        }
        Err(refusal) => {
            let mut resp = refused(&state, &settings, protocol, &method, uri.path(), &client, &refusal);
            if closes {
                resp.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            }
            if let Some(entry) = access {
                entry.log(refusal.code(), Some(refusal.status()), None, resp.body().size_hint().exact());
            }
            resp.map(full_body)
        }
    };
    state.metrics.request_latency.observe(started.elapsed().as_secs_f64());
    resp
}

/// fencegate's own answer to `refusal` of a request (`method` at `path`, from `client`), in
/// the protocol's form, counted and logged; the levels it would name withheld where the key's
/// are.
pub(crate) fn refused(
    state: &State,
    settings: &Settings,
    protocol: protocol::Chosen,
    method: &http::Method,
    path: &str,
    client: &Peer,
    refusal: &Refusal,
) -> Response<Full<bytes::Bytes>> {
    note_refusal(state, settings, method, path, client, refusal);
    let withhold =
        refusal.names_a_level() && refusal.resource().is_some_and(|key| settings.config.fence.withholds(key));
    protocol.refuse(refusal, withhold)
}

/// Counts `refusal` of a request (`method` at `path`, from `client`) and logs it, within
/// `log.refusal_interval`.
pub(crate) fn note_refusal(
    state: &State,
    settings: &Settings,
    method: &http::Method,
    path: &str,
    client: &Peer,
    refusal: &Refusal,
) {
    state.metrics.request(method, refusal.code());
    throttle::log(&state.refusals, settings.config.log.refusal_interval, refusal, method, path, client);
}

/// Reads the body of a request that names its resources there, at most `limit` bytes within
/// the backend's request timeout, and classifies the request with it; what is forwarded is
/// the body as read. Nothing waits for a turn or touches the store meanwhile.
async fn read_whole(
    req: Request<RequestBody>,
    limit: usize,
    protocol: protocol::Chosen,
    settings: &Settings,
) -> Result<(Request<RequestBody>, Plan), Refusal> {
    let (parts, body) = req.into_parts();
    let timeout = settings.config.backend.request_timeout;
    let bytes = match tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<LengthLimitError>() => return Err(Refusal::BodyTooLarge { limit: limit as u64 }),
        Ok(Err(e)) => return Err(Refusal::BadRequest(format!("the request body could not be read: {e}"))),
        Err(_) => return Err(Refusal::BadRequest(format!("the request body did not arrive within {timeout:?}"))),
    };
    let req = Request::from_parts(parts, RequestBody::Read(Full::new(bytes.clone())));
    let plan = protocol.classify_read(&Head::of(&req), &bytes, &settings.config)?;
    Ok((req, plan))
}

/// A request on its way to the backend: what is sent, where, for whom, and how much of its body
/// may go.
struct Outgoing {
    req: Request<RequestBody>,
    /// The target that was classified (and fenced), in the form the protocol forwards.
    target: PathAndQuery,
    client: Peer,
    body_limit: Option<u64>,
}

/// Forwards a request that is not fenced: gets a connection, then sends on it.
async fn forward(state: &State, settings: &Settings, out: Outgoing) -> Result<Response<ResponseBody>, Refusal> {
    let conn = settings.upstream.connection().await?;
    send(state, settings, conn, out, Hold::default()).await
}

/// Sends on `conn`, times the wait for the backend's response head, and keeps the backend
/// from speaking for fencegate.
async fn send(
    state: &State,
    settings: &Settings,
    conn: Connection,
    out: Outgoing,
    hold: Hold,
) -> Result<Response<ResponseBody>, Refusal> {
    let Outgoing { req, target, client, body_limit } = out;
    let started = Instant::now();
    let result = settings.upstream.forward(conn, req, target, &client, body_limit, hold).await;
    state.metrics.backend_latency.observe(started.elapsed().as_secs_f64());
    let mut resp = result?;
    state.metrics.backend_response(resp.status());
    // Only fencegate may say a response is fencegate's own.
    remove_held(resp.headers_mut(), &ERROR_NAME);
    Ok(resp)
}

/// Counts a fenced write in `writes_in_flight` while it is at the backend.
struct InFlight(prometheus_client::metrics::gauge::Gauge);

impl InFlight {
    fn new(metrics: &Metrics) -> Self {
        metrics.in_flight.inc();
        InFlight(metrics.in_flight.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}
