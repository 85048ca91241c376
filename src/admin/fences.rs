//! `max_seen` per resource: `GET /fences/<path>` reads it, `POST /fences/<path>:advance`
//! raises it.
//!
//! Raising `max_seen` by hand cuts off every current lock holder at once: the same effect as a
//! new holder's first write, without a write. It takes the resource's turn like a write, is
//! durable like one ([`crate::fence::Turn::raise`]), and is logged. It never lowers `max_seen`.

use bytes::Bytes;
use http::header::AUTHORIZATION;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::{Value, json};
use subtle::ConstantTimeEq;

use crate::app::State;
use crate::fence::{Coverage, Raised, Touch, keys, path};
use crate::request::refusal::{Refusal, json_response};

/// `max_seen` of the resource `path` names.
pub(super) fn read(state: &State, path: &str) -> Result<Response<Full<Bytes>>, Refusal> {
    let key = fence_key(state, path)?;
    let max_seen = state.fence.max_seen(&key).ok_or_else(|| Refusal::NotFound(key.clone()))?;
    Ok(json_response(StatusCode::OK, &json!({ "resource": key, "max_seen": max_seen })))
}

/// Raises `max_seen` of the resource `path` names to the body's `to`.
pub(super) async fn advance(
    state: &State,
    path: &str,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Refusal> {
    let key = fence_key(state, path)?;
    authorize(state, &req)?;
    let to = requested_token(req).await?;
    let touch = Touch { key: key.clone(), coverage: Coverage::Key };
    let turn = state.fence.acquire(vec![touch], state.settings.get().config.fence.queue_timeout).await?;
    let Raised { previous } = turn.raise::<Refusal>(to).await?;
    Ok(json_response(StatusCode::OK, &json!({ "resource": key, "max_seen": to, "previous": previous })))
}

fn authorize(state: &State, req: &Request<Incoming>) -> Result<(), Refusal> {
    let settings = state.settings.get();
    let Some(expected) = settings.config.admin.token.as_deref() else { return Err(Refusal::AdminWritesDisabled) };
    let given = req.headers().get(AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    // Constant time, so the comparison does not leak how much of a guess was right.
    match given {
        Some(given) if bool::from(given.as_bytes().ct_eq(expected.as_bytes())) => Ok(()),
        _ => Err(Refusal::Unauthorized),
    }
}

async fn requested_token(req: Request<Incoming>) -> Result<u64, Refusal> {
    let body = Limited::new(req.into_body(), 4096).collect().await.map_err(|e| Refusal::BadRequest(e.to_string()))?;
    let v: Value = serde_json::from_slice(&body.to_bytes()).map_err(|e| Refusal::BadRequest(e.to_string()))?;
    v.get("to").and_then(Value::as_u64).ok_or_else(|| Refusal::BadRequest("expected {\"to\": <u64>}".into()))
}

/// The fence key an admin path names, found exactly as for a write to that path, so an
/// operator acts on the key writes use (canonical form, scopes).
fn fence_key(state: &State, path: &str) -> Result<String, Refusal> {
    let config = &state.settings.get().config;
    let canonical = path::canonicalize(path, &config.paths)?;
    Ok(keys::resource_key(&canonical, &config.fence.scopes).to_owned())
}
