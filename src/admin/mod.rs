//! The operators' listener (`[admin] listen`): liveness, readiness, metrics, and `max_seen`
//! per resource, read and raised (`fences`). It runs on the proxy's listener code, so it has
//! the same header-read and keep-alive timeouts, accept back-off and shutdown drain, with a
//! connection limit of its own.

use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use serde_json::json;

use crate::listener::{self, Handler, Listener, Listening, Remote};
use crate::refusal::{Refusal, json_response};
use crate::state::State;
use crate::store::{Condition, Role};

mod fences;
mod livez;
use fences::{Access, Change};

/// Admin connections served at once; more wait in the kernel's accept queue. Fixed rather
/// than `limits.max_connections`: probes and scrapes need a handful, a pool of its own keeps
/// the proxy's clients from starving them (and them from taking the proxy's slots), and 64
/// bounds the descriptors an admin client can hold far below the proxy's 4096 default.
const MAX_CONNECTIONS: usize = 64;

/// Serves the admin API on `listener` until `shutdown` resolves, then stops accepting and lets
/// in-flight requests finish within `server.shutdown_grace`.
pub(crate) async fn serve(state: Arc<State>, listener: Listener, shutdown: impl Future<Output = ()>) {
    let writes = state.settings.get().config.admin.token.is_some();
    tracing::info!(addr = %listener.describe(), writes, "admin API listening");
    // Plain HTTP: `server.tls` is the proxy's.
    let listening = Listening { name: "admin", max_connections: MAX_CONNECTIONS, tls: false };
    listener::serve(Admin(Arc::clone(&state)), listening, state, listener, shutdown).await;
}

/// The admin API as its listener serves it.
#[derive(Clone)]
struct Admin(Arc<State>);

impl Handler for Admin {
    type Client = Remote;
    type Body = Full<Bytes>;

    fn client(&self, remote: Remote) -> Remote {
        remote
    }

    async fn handle(self, req: Request<Incoming>, caller: Remote) -> Response<Full<Bytes>> {
        route(&self.0, req, caller).await.unwrap_or_else(|e| e.response())
    }
}

/// What an admin path names.
enum Endpoint {
    Health,
    /// `/livez`: whether the serving runtime still runs tasks.
    Live,
    Ready,
    Metrics,
    List,
    Fence(String),
    /// `/locks/NAME`: the holder of an etcd lock as verification sees it.
    Lock(String),
    Change(String, Change),
    /// `/failpoints/NAME`: sets a fail point's actions (the `failpoints` feature; tests only).
    #[cfg(feature = "failpoints")]
    Failpoint(String),
}

impl Endpoint {
    fn of(path: &str) -> Option<Endpoint> {
        Some(match path {
            "/healthz" => Endpoint::Health,
            "/livez" => Endpoint::Live,
            "/readyz" => Endpoint::Ready,
            "/metrics" => Endpoint::Metrics,
            "/fences" | "/fences/" => Endpoint::List,
            _ if path.starts_with("/locks/") => Endpoint::Lock(path["/locks".len()..].to_owned()),
            #[cfg(feature = "failpoints")]
            _ if path.starts_with("/failpoints/") => Endpoint::Failpoint(path["/failpoints/".len()..].to_owned()),
            _ => {
                let resource = path.strip_prefix("/fences").filter(|r| r.starts_with('/'))?;
                match Change::ALL.iter().find_map(|(suffix, c)| Some((resource.strip_suffix(suffix)?, *c))) {
                    Some((resource, change)) => Endpoint::Change(resource.to_owned(), change),
                    None => Endpoint::Fence(resource.to_owned()),
                }
            }
        })
    }

    /// The methods it serves, as an `Allow` header lists them: reads take HEAD too (load
    /// balancers' probes use it; hyper leaves the body out).
    fn allow(&self) -> &'static str {
        match self {
            Endpoint::Change(..) => "POST",
            #[cfg(feature = "failpoints")]
            Endpoint::Failpoint(_) => "PUT",
            _ => "GET, HEAD",
        }
    }

    fn serves(&self, method: &str) -> bool {
        self.allow().split(", ").any(|m| m == method)
    }
}

async fn route(state: &State, req: Request<Incoming>, caller: Remote) -> Result<Response<Full<Bytes>>, Refusal> {
    let path = req.uri().path();
    let endpoint = Endpoint::of(path).ok_or_else(|| Refusal::NotFound(path.to_owned()))?;
    if !endpoint.serves(req.method().as_str()) {
        let (method, path) = (req.method().to_string(), path.to_owned());
        return Err(Refusal::WrongMethod { method, path, allow: endpoint.allow() });
    }
    match endpoint {
        Endpoint::Health => Ok(json_response(StatusCode::OK, &json!({ "status": "ok" }))),
        Endpoint::Live => Ok(livez::liveness(state.serving.as_ref(), livez::BOUND).await),
        Endpoint::Ready => Ok(readiness(state).await),
        Endpoint::Metrics => {
            state.metrics.resources.set(i64::try_from(state.fence.len()).unwrap_or(i64::MAX));
            let (table, limit) = state.fence.table_bytes();
            state.metrics.table(table.keys, table.floors, table.held, limit);
            state.metrics.log_dropped(crate::logging::dropped_lines());
            state.metrics.batches_overtaken(state.store.batches_overtaken());
            state.metrics.process();
            state.metrics.quarantined(state.fence.quarantined());
            state.metrics.lock_views(state.locks.load().ages());
            state.metrics.role(match state.store.role() {
                Role::Fences => "writer",
                Role::Forward(_) => "follower",
                Role::Unavailable(_) => "unavailable",
            });
            let mut resp = Response::new(Full::new(Bytes::from(state.metrics.encode())));
            let kind = "application/openmetrics-text; version=1.0.0; charset=utf-8";
            resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(kind));
            Ok(resp)
        }
        Endpoint::List => fences::list(state, &req, caller),
        Endpoint::Fence(resource) => fences::read(state, &resource, &req, caller),
        Endpoint::Lock(name) => {
            // The holder's revision is the token that passes: only for an operator's token.
            fences::authorize(state, &req, caller, Access::Read)?;
            Ok(lock(state, &name))
        }
        Endpoint::Change(resource, change) => fences::change(state, &resource, change, req, caller).await,
        #[cfg(feature = "failpoints")]
        Endpoint::Failpoint(name) => {
            fences::authorize(state, &req, caller, Access::Change)?;
            let body =
                http_body_util::BodyExt::collect(req.into_body()).await.map(|b| b.to_bytes()).unwrap_or_default();
            let actions = String::from_utf8_lossy(&body).into_owned();
            fail::cfg(name.clone(), &actions).map_err(Refusal::BadRequest)?;
            tracing::warn!(failpoint = %name, actions = %actions, "fail point set");
            Ok(json_response(StatusCode::OK, &json!({ "failpoint": name, "actions": actions })))
        }
    }
}

/// The holder of the etcd lock `name` as the mirrors show it: what a verified write's token
/// is compared with. The name is as clients lock it, percent-encoding and all.
fn lock(state: &State, name: &str) -> Response<Full<Bytes>> {
    match state.locks.load().holder(name.as_bytes()) {
        Ok(holder) => json_response(StatusCode::OK, &json!({ "lock": name, "holder": holder, "fresh": true })),
        Err(why) => json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({ "lock": name, "holder": null, "fresh": false, "reason": why.to_string() }),
        ),
    }
}

/// Ready when the store accepts advances without a stall and the backend accepts a connection.
/// `checks` holds one boolean a check; `problems` says what is wrong, for people.
async fn readiness(state: &State) -> Response<Full<Bytes>> {
    let settings = state.settings.get();
    let store = match state.store.condition() {
        Condition::Ready => None,
        Condition::Busy(took) if took < settings.config.store.stall_after => None,
        Condition::Busy(took) => Some(format!(
            "store stalled: a write or sync of the fence log has taken {took:.1?} so far (store.stall_after = {:?}); \
            fenced writes wait for it",
            settings.config.store.stall_after
        )),
        Condition::Full(why) => Some(format!("store full: {why}")),
        Condition::RoomFailed(why) => {
            Some(format!("store cannot make room: {why}; fenced writes are refused until the disk takes the write"))
        }
        Condition::Failed(why) => Some(format!("store failed: {why}; fenced writes are refused until a restart")),
        Condition::Unavailable(why) => {
            Some(format!("store unavailable: {why}; fenced writes are refused until it comes back, reads go on"))
        }
    };
    let backend = &settings.config.backend;
    let unreachable = crate::upstream::reachable(&backend.url, backend.connect_timeout).await.err();
    // A follower sends fenced writes on to the leader: one that cannot reach it is not ready
    // for them (reads go on).
    let leader = match state.store.role() {
        Role::Forward(url) => crate::upstream::leader_reachable(&url, backend.connect_timeout).await.err(),
        _ => None,
    };
    let checks = json!({ "store": store.is_none(), "backend": unreachable.is_none(), "leader": leader.is_none() });
    let mut problems: Vec<String> = store.into_iter().collect();
    problems.extend(unreachable);
    problems.extend(leader);
    match problems.is_empty() {
        true => json_response(StatusCode::OK, &json!({ "status": "ready", "checks": checks })),
        false => json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({ "status": "not_ready", "checks": checks, "problems": problems }),
        ),
    }
}
