//! The operators' listener (`[admin] listen`): liveness, readiness, metrics, and `max_seen`
//! per resource, read and raised.
//!
//! Raising `max_seen` by hand cuts off every current lock holder at once: the same effect as a
//! new holder's first write, without a write. It takes the resource's turn like a write, is
//! durable like one, and is logged. It never lowers `max_seen`.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;

pub(crate) mod metrics;

use crate::app::State;
use crate::request::refusal::{Error, json_response};

/// Serves the admin API on `listener` until `shutdown` resolves.
pub(crate) async fn serve(state: Arc<State>, listener: TcpListener, shutdown: impl Future<Output = ()>) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, writes = state.settings.get().config.admin.token.is_some(), "admin API listening");
    }
    let builder = auto::Builder::new(TokioExecutor::new());
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            () = &mut shutdown => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((stream, _)) = accepted else { continue };
        let state = Arc::clone(&state);
        let builder = builder.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let state = Arc::clone(&state);
                async move {
                    let resp = route(&state, req).await.unwrap_or_else(|e| e.response());
                    Ok::<_, Infallible>(resp)
                }
            });
            let _ = builder.serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

async fn route(state: &State, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Error> {
    let path = req.uri().path().to_owned();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/healthz") => Ok(json_response(StatusCode::OK, &json!({ "status": "ok" }))),
        (&Method::GET, "/readyz") => Ok(readiness(state).await),
        (&Method::GET, "/metrics") => {
            state.metrics.resources.set(i64::try_from(state.fence.len()).unwrap_or(i64::MAX));
            let mut resp = Response::new(Full::new(Bytes::from(state.metrics.encode())));
            let kind = "application/openmetrics-text; version=1.0.0; charset=utf-8";
            resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(kind));
            Ok(resp)
        }
        (&Method::GET, p) if p.starts_with("/fences/") => {
            let key = fence_key(state, &p["/fences".len()..])?;
            let max_seen = state.fence.max_seen(&key).ok_or_else(|| Error::NotFound(key.clone()))?;
            Ok(json_response(StatusCode::OK, &json!({ "resource": key, "max_seen": max_seen })))
        }
        (&Method::POST, p) if p.starts_with("/fences/") && p.ends_with(":advance") => {
            let key = fence_key(state, &p["/fences".len()..p.len() - ":advance".len()])?;
            authorize(state, &req)?;
            let to = requested_token(req).await?;
            advance(state, key, to).await
        }
        _ => Err(Error::NotFound(path)),
    }
}

/// Ready when the store accepts advances and the backend accepts a connection.
async fn readiness(state: &State) -> Response<Full<Bytes>> {
    let store = state.store.healthy();
    let live = state.settings.get();
    let backend = &live.config.backend;
    let connect = tokio::net::TcpStream::connect(crate::upstream::backend_addr(&backend.url));
    let reachable = matches!(tokio::time::timeout(backend.connect_timeout, connect).await, Ok(Ok(_)));
    let checks = json!({ "store": store, "backend": reachable });
    if store && reachable {
        json_response(StatusCode::OK, &json!({ "status": "ready", "checks": checks }))
    } else {
        json_response(StatusCode::SERVICE_UNAVAILABLE, &json!({ "status": "not_ready", "checks": checks }))
    }
}

fn authorize(state: &State, req: &Request<Incoming>) -> Result<(), Error> {
    let live = state.settings.get();
    let Some(expected) = live.config.admin.token.as_deref() else { return Err(Error::AdminWritesDisabled) };
    let given = req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    // Constant time, so the comparison does not leak how much of a guess was right.
    match given {
        Some(given) if bool::from(given.as_bytes().ct_eq(expected.as_bytes())) => Ok(()),
        _ => Err(Error::Unauthorized),
    }
}

async fn requested_token(req: Request<Incoming>) -> Result<u64, Error> {
    let body = Limited::new(req.into_body(), 4096).collect().await.map_err(|e| Error::BadRequest(e.to_string()))?;
    let v: Value = serde_json::from_slice(&body.to_bytes()).map_err(|e| Error::BadRequest(e.to_string()))?;
    v.get("to").and_then(Value::as_u64).ok_or_else(|| Error::BadRequest("expected {\"to\": <u64>}".into()))
}

/// The fence key an admin path names, found exactly as for a write to that path, so an
/// operator acts on the key writes use (canonical form, scopes).
fn fence_key(state: &State, path: &str) -> Result<String, Error> {
    let config = &state.settings.get().config;
    let canonical = crate::fence::path::canonicalize(path, &config.paths)?;
    Ok(crate::fence::path::resource_key(&canonical, &config.fence.scopes).to_owned())
}

async fn advance(state: &State, key: String, to: u64) -> Result<Response<Full<Bytes>>, Error> {
    let turn = state.fence.acquire(&key, state.settings.get().config.fence.queue_timeout).await?;
    let (store, table) = (Arc::clone(&state.store), Arc::clone(&state.fence));
    // Like a write, it runs to the end once it holds the turn, whoever hangs up.
    let critical = tokio::spawn(async move {
        let previous = table.entry(&key);
        if let Some((max_seen, _)) = previous.filter(|(m, _)| *m > to) {
            return Err(Error::WouldLower { resource: key, max_seen, to });
        }
        if previous.map(|(m, _)| m) != Some(to) {
            store.advance(turn.key(), to).await?;
            // Nothing was forwarded for this advance. But a write that is still in flight
            // (its answer never came) must stay marked, or a restart would not quarantine it.
            if !previous.is_some_and(|(_, in_flight)| in_flight) {
                store.answered(turn.key(), to);
            }
            tracing::warn!(resource = %key, previous = ?previous.map(|(m, _)| m), max_seen = to,
                "max_seen raised by an operator: every holder of a lower token is cut off");
        }
        drop(turn);
        let previous = previous.map(|(m, _)| m);
        Ok(json_response(StatusCode::OK, &json!({ "resource": key, "max_seen": to, "previous": previous })))
    });
    critical.await.map_err(|e| Error::Io(std::io::Error::other(format!("admin task failed: {e}"))))?
}
