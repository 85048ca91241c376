//! One request's path through fencegate:
//! accept → canonicalise → check and reserve → persist → forward → release.

pub mod refusal;
pub(crate) mod throttle;

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::header::UPGRADE;
use http::uri::PathAndQuery;
use http::{Method, Request, Response};
use hyper::body::Body;
use hyper::body::Incoming;

use crate::admin::metrics::Metrics;
use crate::app::{Settings, State};
use crate::config::{Config, LimitsConfig, MissingToken};
use crate::fence::path;
use crate::fence::token::{self, TokenError};
use crate::request::refusal::Error;
use crate::request::throttle::RefusalThrottle;
use crate::store::StoreError;
pub use crate::upstream::ResponseBody;
use crate::upstream::{Peer, Upstream, full_body};

/// Forwards and times the wait for the backend's response head.
async fn forward(
    state: &State,
    upstream: &Upstream,
    req: Request<Incoming>,
    target: PathAndQuery,
    client: Peer,
    body_limit: Option<u64>,
) -> Result<Response<ResponseBody>, Error> {
    let started = Instant::now();
    let result = upstream.forward(req, target, &client, body_limit).await;
    state.metrics.backend_latency.observe(started.elapsed().as_secs_f64());
    result
}

/// Handles one request; every failure becomes fencegate's own JSON response.
pub(crate) async fn handle(state: Arc<State>, req: Request<Incoming>, client: Peer) -> Response<ResponseBody> {
    let method = req.method().clone();
    // One snapshot of the settings for the whole request, however long it takes.
    let live = state.settings.get();
    match route(Arc::clone(&state), Arc::clone(&live), req, client.clone()).await {
        Ok(resp) => {
            state.metrics.request(&method, "forwarded");
            resp
        }
        Err(err) => {
            state.metrics.request(&method, err.code());
            log_refusal(&state.refusals, live.config.log.refusal_interval, &err, &method, &client);
            err.response().map(full_body)
        }
    }
}

fn is_fenced(config: &Config, method: &Method) -> bool {
    config.fence.methods.iter().any(|m| m.as_str().eq_ignore_ascii_case(method.as_str()))
}

/// Refuses what no request may carry: tunnels, and heads beyond the configured limits.
fn check_limits(req: &Request<Incoming>, limits: &LimitsConfig) -> Result<(), Error> {
    if req.method() == Method::CONNECT {
        return Err(Error::MethodNotAllowed(req.method().to_string()));
    }
    // The authority counts too (absolute form, HTTP/2's :authority): it becomes Host upstream.
    let authority = req.uri().authority().map_or(0, |a| a.as_str().len());
    let uri = authority + req.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if uri > limits.max_uri_bytes {
        return Err(Error::UriTooLong { size: uri, limit: limits.max_uri_bytes });
    }
    // As it was sent: request line, then "name: value\r\n" per field.
    let head = req.method().as_str().len() + uri + 12;
    let size = head + req.headers().iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum::<usize>();
    if size > limits.max_header_bytes {
        return Err(Error::HeadersTooLarge { size, limit: limits.max_header_bytes });
    }
    Ok(())
}

/// Refuses a fenced write that asks to switch protocols or declares a body over the limit,
/// before it can touch `max_seen`.
fn check_fenced(req: &Request<Incoming>, limits: &LimitsConfig) -> Result<Option<u64>, Error> {
    if let Some(upgrade) = req.headers().get(UPGRADE) {
        return Err(Error::UpgradeRefused(String::from_utf8_lossy(upgrade.as_bytes()).into_owned()));
    }
    let limit = (limits.max_body_bytes > 0).then_some(limits.max_body_bytes);
    let declared = req.body().size_hint().upper();
    if let (Some(limit), Some(declared)) = (limit, declared)
        && declared > limit
    {
        return Err(Error::BodyTooLarge { limit });
    }
    Ok(limit)
}

async fn route(
    state: Arc<State>,
    live: Arc<Settings>,
    req: Request<Incoming>,
    client: Peer,
) -> Result<Response<ResponseBody>, Error> {
    let config = &live.config;
    check_limits(&req, &config.limits)?;
    if !is_fenced(config, req.method()) {
        let target = req.uri().path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        return forward(&state, &live.upstream, req, target, client, None).await;
    }
    let body_limit = check_fenced(&req, &config.limits)?;

    // Canonicalise: the key and the forwarded path come from the same canonical string.
    let canonical = path::canonicalize(req.uri().path(), &config.paths)?;
    let key = path::resource_key(&canonical, &config.fence.scopes).to_owned();
    let target = match req.uri().query() {
        Some(q) => format!("{canonical}?{q}"),
        None => canonical,
    };
    let target =
        PathAndQuery::try_from(target).map_err(|e| Error::InvalidPath(path::PathError::Unparseable(e.to_string())))?;

    let token = match token::from_headers(req.headers(), &config.fence.header) {
        Ok(token) => token,
        Err(TokenError::Missing) if config.fence.missing_token == MissingToken::Forward => {
            return forward(&state, &live.upstream, req, target, client, body_limit).await;
        }
        Err(TokenError::Missing) => {
            return Err(Error::MissingToken { header: config.fence.header.to_string() });
        }
        Err(e) => return Err(e.into()),
    };

    // Check and reserve. Waiting for the turn may be abandoned if the client goes away...
    state.fence.precheck(&key, token, config.fence.equal_token)?;
    let waiting = Instant::now();
    let turn = state.fence.acquire(&key, config.fence.queue_timeout).await;
    state.metrics.queue_wait.observe(waiting.elapsed().as_secs_f64());
    let mut turn = turn?;

    // ...but once the turn is ours, the write runs to completion in its own task. Were it
    // cancelled mid-forward, the backend could still apply it after the next write was sent.
    let critical = tokio::spawn(async move {
        turn.check(token, live.config.fence.equal_token)?;
        // Persist: durable, and the table raised, before a byte goes to the backend.
        state.store.advance(turn.key(), token).await?;
        let _flying = InFlight::new(&state.metrics);
        // Boxed: the forward's state (request, pool checkout, timer) would otherwise make up
        // most of this task's future, which the spawn copies several times.
        let result = Box::pin(forward(&state, &live.upstream, req, target, client, body_limit)).await;
        match &result {
            // The backend may have (part of) the write and apply it late: keep the next one
            // out. It stays in flight in the log too, so a restart quarantines it again.
            Err(Error::BackendTimeout(_) | Error::BackendFailed(_) | Error::BodyTooLarge { .. }) => {
                turn.quarantine(live.config.fence.quarantine)
            }
            _ => state.store.answered(turn.key(), token),
        }
        result
        // `turn` drops here: the next write to this resource may go.
    });
    critical.await.map_err(|e| Error::Io(std::io::Error::other(format!("write task failed: {e}"))))?
}

/// One line per refusal, at most one per resource (or reason) and interval: a zombie
/// retrying in a loop must not flood the log.
fn log_refusal(refusals: &RefusalThrottle, interval: Duration, err: &Error, method: &Method, client: &Peer) {
    let key = match err {
        Error::StaleToken { resource, .. }
        | Error::QueueTimeout { resource, .. }
        | Error::Quarantined { resource, .. } => resource.as_str(),
        other => other.code(),
    };
    let Some(suppressed) = refusals.admit(key, interval) else { return };
    match err {
        Error::StaleToken { resource, token, max_seen } => {
            tracing::warn!(%resource, token, max_seen, %client, %method, suppressed, "refused stale token");
        }
        Error::Store(StoreError::Full(_)) => {
            tracing::warn!(error = %err, %client, %method, suppressed, "refused a write to a new resource");
        }
        Error::Store(_) | Error::BackendUnreachable(_) | Error::BackendFailed(_) | Error::BackendTimeout(_) => {
            tracing::error!(error = %err, %client, %method, suppressed, "request failed");
        }
        _ => tracing::info!(code = err.code(), error = %err, %client, %method, suppressed, "refused request"),
    }
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
