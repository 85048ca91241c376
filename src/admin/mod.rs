//! The operators' listener (`[admin] listen`): liveness, readiness, metrics, and `max_seen`
//! per resource, read and raised (`fences`).

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::json;
use tokio::net::TcpListener;

pub(crate) mod metrics;
use crate::app::State;
use crate::request::refusal::{Refusal, json_response};

mod fences;

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

async fn route(state: &State, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Refusal> {
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
        (&Method::GET, p) if p.starts_with("/fences/") => fences::read(state, &p["/fences".len()..]),
        (&Method::POST, p) if p.starts_with("/fences/") && p.ends_with(":advance") => {
            fences::advance(state, &p["/fences".len()..p.len() - ":advance".len()], req).await
        }
        _ => Err(Refusal::NotFound(path)),
    }
}

/// Ready when the store accepts advances and the backend accepts a connection.
async fn readiness(state: &State) -> Response<Full<Bytes>> {
    let store = state.store.healthy();
    let settings = state.settings.get();
    let backend = &settings.config.backend;
    let connect = tokio::net::TcpStream::connect(crate::upstream::backend_addr(&backend.url));
    let reachable = matches!(tokio::time::timeout(backend.connect_timeout, connect).await, Ok(Ok(_)));
    let checks = json!({ "store": store, "backend": reachable });
    if store && reachable {
        json_response(StatusCode::OK, &json!({ "status": "ready", "checks": checks }))
    } else {
        json_response(StatusCode::SERVICE_UNAVAILABLE, &json!({ "status": "not_ready", "checks": checks }))
    }
}
