//! One request's path through fencegate: [`classify`] it (pure), then, for a fenced write,
//! [`verify`] its token's proof where a rule asks for one, fence it (check, wait for the turn,
//! get a backend connection, advance durably), forward it, and answer; every refusal becomes fencegate's own answer through [`refusal`].

mod access;
pub mod classify;
pub mod destination;
pub mod locks;
pub(crate) mod rules;
pub mod verify;

use std::sync::Arc;
use std::time::Instant;

use http::uri::PathAndQuery;
use http::{Request, Response};
use hyper::body::Incoming;

use crate::fence::{Outcome, Policy};
use crate::refusal::{ERROR_HEADER, Refusal, throttle};
use crate::state::{Metrics, Settings, State};
use crate::store::{Role, StoreError};
pub use crate::upstream::ResponseBody;
use crate::upstream::leader;
use crate::upstream::{Connection, Hold, Peer, UpstreamError, full_body};
use classify::{Plan, Write};
use verify::Guess;

/// Handles one request; every refusal becomes fencegate's own JSON response.
pub(crate) async fn handle(state: Arc<State>, req: Request<Incoming>, client: Peer) -> Response<ResponseBody> {
    let started = Instant::now();
    let method = req.method().clone();
    // For the refusal's log line: a reference count, not a copy.
    let uri = req.uri().clone();
    // One snapshot of the settings for the whole request, however long it takes.
    let settings = state.settings.get();
    let mut access =
        if settings.config.log.access { access::Entry::start(&method, req.uri().path(), started) } else { None };
    let result = match classify::classify(&req, &settings.config) {
        Ok(plan) => {
            if let Some(entry) = access.as_mut() {
                entry.plan(&plan);
            }
            let guess = Guess::of(&plan, &req, &client, &settings, &state);
            match guess.as_ref().map_or(Ok(()), |g| g.admit(&state)) {
                Err(refusal) => Err(refusal),
                Ok(()) => {
                    let result = execute(Arc::clone(&state), Arc::clone(&settings), req, plan, client.clone()).await;
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
                entry.log("forwarded", resp.status(), Some(resp.status()));
            }
            resp
        }
        Err(refusal) => {
            state.metrics.request(&method, refusal.code());
            let interval = settings.config.log.refusal_interval;
            throttle::log(&state.refusals, interval, &refusal, &method, uri.path(), &client);
            if let Some(entry) = access {
                entry.log(refusal.code(), refusal.status(), None);
            }
            let withhold =
                refusal.names_a_level() && refusal.resource().is_some_and(|key| settings.config.fence.withholds(key));
            let resp = if withhold { refusal.response_withholding_levels() } else { refusal.response() };
            resp.map(full_body)
        }
    };
    state.metrics.request_latency.observe(started.elapsed().as_secs_f64());
    resp
}

/// Carries out a plan: forwards at once, or fences the write first.
async fn execute(
    state: Arc<State>,
    settings: Arc<Settings>,
    req: Request<Incoming>,
    plan: Plan,
    client: Peer,
) -> Result<Response<ResponseBody>, Refusal> {
    let write = match plan {
        Plan::Pass { target } => return forward(&state, &settings, req, target, client, None).await,
        Plan::Unchecked { target, body_limit } => {
            return forward(&state, &settings, req, target, client, body_limit).await;
        }
        Plan::Write(write) => write,
    };
    // With a shared fence, only its leader fences writes; a follower sends them to it.
    let mut req = req;
    match state.store.role() {
        Role::Writer => {
            req.headers_mut().remove(&leader::FORWARDED_BY);
        }
        Role::Forward(url) if !leader::forwarded(&req) => {
            let Some(peers) = state.peers.as_ref() else {
                return Err(StoreError::Unavailable("this instance cannot reach the leader".into()).into());
            };
            let backend = &settings.config.backend;
            let timeout = backend.pool_timeout + backend.request_timeout + settings.config.fence.queue_timeout;
            return Ok(peers.forward(&url, req, &client, timeout).await?);
        }
        Role::Forward(url) => {
            return Err(StoreError::Unavailable(format!(
                "the fence is led by {url}, not by this instance, which another instance took for the leader; \
                a write sent on once is not sent on again"
            ))
            .into());
        }
        Role::Unavailable(why) => return Err(StoreError::Unavailable(why).into()),
    }
    let Write { token, touches, destination, target, body_limit, equal, max_jump, proof, locks: locks_held } = write;
    // Before anything looks at the token: an unproven one must not even be compared.
    verify::check(&proof, token, &touches, &settings.hmac)?;
    let policy = Policy { equal, max_jump };
    if let Some(d) = destination {
        // What the backend is told to change is what was fenced.
        req.headers_mut().insert(&destination::DESTINATION, d.forwarded);
    }
    let fence = &settings.config.fence;
    // Refuse early, and wait for the turn: both may be abandoned if the client goes away...
    locks::check(&state.locks.load(), &locks_held, token).map_err(Refusal::Lock)?;
    state.fence.precheck(&touches, token, policy)?;
    let waiting = Instant::now();
    // For the proof's second look, at the turn: the first key is what a refusal names (kept
    // only for a write that has a proof, so that the others pay no copy).
    let first = match proof {
        verify::Proof::None => None,
        _ => touches.first().cloned(),
    };
    let turn = state.fence.acquire(touches, fence.queue_timeout).await;
    state.metrics.queue_wait.observe(waiting.elapsed().as_secs_f64());
    let turn = turn?;

    // ...but once the turn is ours, `finish_after` runs the write to its end.
    let quarantine = fence.quarantine;
    // Boxed: the connection's checkout and the forward's state (request, timer) would
    // otherwise make up most of the write's future, which is moved into its box whole. Each is
    // written into a new box (`Box::write`), which lets it be built in place, not copied.
    let prepare = Box::into_pin(Box::write(Box::new_uninit(), async move {
        // Before the advance: without a connection the token is not used up.
        let conn = settings.upstream.connection().await?;
        // The authoritative look at the holder, when the turn has come and the connection is
        // there (waiting for one can take pool_timeout): a holder that lost its lock meanwhile
        // is refused, with its token not used up.
        locks::check(&state.locks.load(), &locks_held, token).map_err(Refusal::Lock)?;
        // The proof again, against the keys in force now: a key a reload withdrew (after a
        // leak), or a signature that expired while the write waited, no longer passes.
        verify::check(&proof, token, first.as_slice(), &state.settings.get().hmac)?;
        // A shared fence's leader sends only while it trusts its lease: checked before the
        // head and each body chunk (docs/cluster.md: self-fencing).
        let gate = state.store.permit(state.store.term());
        Ok(Box::into_pin(Box::write(Box::new_uninit(), async move {
            let _flying = InFlight::new(&state.metrics);
            // Whole: the turn is held until the backend has the whole body, not only until it answers.
            send(&state, &settings, conn, req, target, client, body_limit, Hold { whole: true, gate }).await
        })))
    }));
    turn.finish_after(token, policy, quarantine, prepare, outcome).await
}

/// Whether the backend may still apply a write that got this result.
fn outcome(result: &Result<Response<ResponseBody>, Refusal>) -> Outcome {
    match result {
        Err(Refusal::Upstream(
            UpstreamError::Timeout(_) | UpstreamError::Failed(_) | UpstreamError::BodyTooLarge { .. },
        )) => Outcome::Unknown,
        _ => Outcome::Answered,
    }
}

/// Forwards a request that is not fenced: gets a connection, then sends on it.
async fn forward(
    state: &State,
    settings: &Settings,
    req: Request<Incoming>,
    target: PathAndQuery,
    client: Peer,
    body_limit: Option<u64>,
) -> Result<Response<ResponseBody>, Refusal> {
    let conn = settings.upstream.connection().await?;
    send(state, settings, conn, req, target, client, body_limit, Hold::default()).await
}

/// Sends on `conn`, times the wait for the backend's response head, and keeps the backend
/// from speaking for fencegate.
#[allow(clippy::too_many_arguments)] // one request's parts, passed on whole
async fn send(
    state: &State,
    settings: &Settings,
    conn: Connection,
    req: Request<Incoming>,
    target: PathAndQuery,
    client: Peer,
    body_limit: Option<u64>,
    hold: Hold,
) -> Result<Response<ResponseBody>, Refusal> {
    let started = Instant::now();
    let result = settings.upstream.forward(conn, req, target, &client, body_limit, hold).await;
    state.metrics.backend_latency.observe(started.elapsed().as_secs_f64());
    let mut resp = result?;
    state.metrics.backend_response(resp.status());
    // Only fencegate may say a response is fencegate's own.
    resp.headers_mut().remove(ERROR_HEADER);
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
