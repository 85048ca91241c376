//! The fences API: `max_seen` per resource, read one at a time or a page at a time, and the
//! operator's changes: raise (`:advance`), lower (`:reset`), and end a quarantine (`:lift`).
//!
//! Raising `max_seen` by hand cuts off every current lock holder at once: the same effect as a
//! new holder's first write, without a write ([`crate::fence::Turn::raise`]). Lowering it is the
//! way back from a resource bricked by a huge token, and lets an old holder write again: the
//! request must name the key twice (`confirm`). Every change needs the admin token, takes the
//! turns it needs like a write, is durable before it is answered, and is logged at warn with
//! the caller's address and counted, as is every failed authentication.

use bytes::Bytes;
use http::header::{AUTHORIZATION, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::{Value, json};
use subtle::ConstantTimeEq;

use crate::config::BackendProtocol;
use crate::fence::{Coverage, Lifted, Raised, Reset, Touch, keys};
use crate::listener::Remote;
use crate::refusal::{Refusal, json_response};
use crate::state::State;
use crate::store::{Role, StoreError};

/// Keys a page holds unless asked for fewer, and the most it holds.
const PAGE: usize = 100;
const MAX_PAGE: usize = 1000;

/// What an operator may change, as the path's suffix names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Change {
    Advance,
    Reset,
    Lift,
}

impl Change {
    pub(super) const ALL: [(&'static str, Change); 3] =
        [(":advance", Change::Advance), (":reset", Change::Reset), (":lift", Change::Lift)];

    fn name(self) -> &'static str {
        match self {
            Change::Advance => "advance",
            Change::Reset => "reset",
            Change::Lift => "lift",
        }
    }
}

/// `max_seen` of the resource `path` names. A verified key's level is the token that passes
/// its verification once its holder has written (an etcd lock's create revision), so it is
/// read only with a token.
pub(super) fn read(
    state: &State,
    path: &str,
    req: &Request<Incoming>,
    caller: Remote,
) -> Result<Response<Full<Bytes>>, Refusal> {
    let key = fence_key(state, path)?;
    if !read_as_operator(state, req, caller)? && state.settings.get().config.fence.withholds(&key) {
        // Named in the log and counted, as a failed authentication is.
        authorize(state, req, caller, Access::Read)?;
    }
    leading(state)?;
    let max_seen = state.fence.max_seen(&key).ok_or_else(|| Refusal::NotFound(key.clone()))?;
    Ok(json_response(StatusCode::OK, &json!({ "resource": key, "max_seen": max_seen })))
}

/// A page of fences: `?prefix=…&after=…&limit=…`, values percent-decoded once. Without a
/// token, withheld levels are left out of it.
pub(super) fn list(state: &State, req: &Request<Incoming>, caller: Remote) -> Result<Response<Full<Bytes>>, Refusal> {
    let trusted = read_as_operator(state, req, caller)?;
    leading(state)?;
    let (mut prefix, mut after, mut limit) = (String::new(), None, PAGE);
    for pair in req.uri().query().unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = decode(value)?;
        match name {
            "prefix" => prefix = value,
            "after" => after = Some(value),
            "limit" => {
                limit = value.parse().ok().filter(|n| (1..=MAX_PAGE).contains(n)).ok_or_else(|| {
                    Refusal::BadRequest(format!("limit must be a number from 1 to {MAX_PAGE}, not {value:?}"))
                })?
            }
            other => return Err(Refusal::BadRequest(format!("unknown parameter {other:?}: use prefix, after, limit"))),
        }
    }
    let page = state.fence.page(&prefix, after.as_deref(), limit);
    let next = (page.len() == limit).then(|| page.last().map(|(k, _, _)| k.clone())).flatten();
    let config = &state.settings.get().config;
    let fences: Vec<Value> = page
        .into_iter()
        .map(|(key, max_seen, in_flight)| match trusted || !config.fence.withholds(&key) {
            true => json!({ "resource": key, "max_seen": max_seen, "in_flight": in_flight }),
            false => json!({ "resource": key, "max_seen": null, "withheld": true, "in_flight": in_flight }),
        })
        .collect();
    Ok(json_response(StatusCode::OK, &json!({ "fences": fences, "next": next })))
}

/// Applies `change` to the resource `path` names, for the operator at `caller`.
pub(super) async fn change(
    state: &State,
    path: &str,
    change: Change,
    req: Request<Incoming>,
    caller: Remote,
) -> Result<Response<Full<Bytes>>, Refusal> {
    authorize(state, &req, caller, Access::Change)?;
    leading(state)?;
    let key = fence_key(state, path)?;
    let wait = state.settings.get().config.fence.queue_timeout;
    // Whether anything changed: a lift that found no quarantine did not.
    let mut changed = true;
    let done = match change {
        Change::Advance => {
            let to = requested(req).await?.0;
            let touch = Touch { key: key.clone(), coverage: Coverage::Key };
            let turn = state.fence.acquire(vec![touch], wait).await?;
            let Raised { previous } = turn.raise::<Refusal>(to).await?;
            json!({ "resource": key, "max_seen": to, "previous": previous })
        }
        Change::Reset => {
            let (to, confirm) = requested(req).await?;
            if confirm.as_deref() != Some(key.as_str()) {
                return Err(Refusal::BadRequest(format!(
                    "a reset lowers max_seen and can let an old lock holder's write through: repeat the fence key \
                    as \"confirm\": {key:?}"
                )));
            }
            let Reset { previous, floors, floors_above } = state.fence.reset::<Refusal>(&key, to, wait).await?;
            let pairs = |v: Vec<(String, u64)>| v.into_iter().map(|(p, t)| json!({ "node": p, "was": t })).collect();
            let (floors, above): (Vec<Value>, Vec<Value>) = (pairs(floors), pairs(floors_above));
            json!({ "resource": key, "max_seen": to, "previous": previous, "floors_lowered": floors, "floors_above": above })
        }
        Change::Lift => {
            let Lifted { key: lifted, subtree } = state.fence.lift(&key, wait).await?;
            changed = lifted || subtree;
            json!({ "resource": key, "lifted": lifted, "subtree_lifted": subtree, "changed": changed })
        }
    };
    if changed {
        state.metrics.admin_change(change.name());
        tracing::warn!(%caller, action = %change.name(), resource = %key, result = %done, "admin change");
    } else {
        tracing::info!(%caller, action = %change.name(), resource = %key, "admin request changed nothing");
    }
    Ok(json_response(StatusCode::OK, &done))
}

/// What an admin request needs its bearer token for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Access {
    /// Reading what a verified write could use: a verified key's level, a lock's holder.
    /// `admin.read_token` or `admin.token`.
    Read,
    /// Changing the fence (and setting fail points): `admin.token` only.
    Change,
}

/// Refuses a request whose `Authorization: Bearer` token does not grant `need`.
pub(super) fn authorize(state: &State, req: &Request<Incoming>, caller: Remote, need: Access) -> Result<(), Refusal> {
    let settings = state.settings.get();
    let admin = &settings.config.admin;
    let accepted = match need {
        Access::Change => [admin.token.as_deref(), None],
        Access::Read => [admin.token.as_deref(), admin.read_token.as_deref()],
    };
    if accepted.iter().all(Option::is_none) {
        return Err(match need {
            Access::Change => Refusal::AdminWritesDisabled,
            Access::Read => Refusal::AdminReadsDisabled,
        });
    }
    let given = bearer(req.headers().get(AUTHORIZATION));
    // Constant time, so the comparison does not leak how much of a guess was right; every
    // accepted token is compared, so the time does not say which one matched.
    let matched = given.is_some_and(|given| {
        accepted
            .iter()
            .flatten()
            .fold(false, |hit, expected| hit | bool::from(given.as_bytes().ct_eq(expected.as_bytes())))
    });
    if matched {
        return Ok(());
    }
    state.metrics.admin_auth_failure();
    let why = if given.is_some() { "wrong_token" } else { "no_bearer_token" };
    tracing::warn!(%caller, method = %req.method(), path = %req.uri().path(), reason = %why,
        "admin authentication failed");
    Err(Refusal::Unauthorized)
}

/// Whether a read comes from an operator: it carries a token, which must then be right (a
/// wrong one is refused, not quietly served less). Without any token configured, there is no
/// operator to be, and a header is ignored.
fn read_as_operator(state: &State, req: &Request<Incoming>, caller: Remote) -> Result<bool, Refusal> {
    let admin = &state.settings.get().config.admin;
    if !req.headers().contains_key(AUTHORIZATION) || (admin.token.is_none() && admin.read_token.is_none()) {
        return Ok(false);
    }
    authorize(state, req, caller, Access::Read).map(|()| true)
}

/// The credentials of an `Authorization` value whose scheme is Bearer, in any case (RFC 9110
/// makes auth schemes case-insensitive), after one or more spaces.
fn bearer(value: Option<&HeaderValue>) -> Option<&str> {
    let (scheme, credentials) = value?.to_str().ok()?.split_once(' ')?;
    let credentials = credentials.trim_matches(' ');
    (scheme.eq_ignore_ascii_case("bearer") && !credentials.is_empty()).then_some(credentials)
}

/// Refuses a read or change of the fence on an instance that does not hold it: a follower of
/// a shared fence holds no levels, and its changes would not reach the leader's table.
fn leading(state: &State) -> Result<(), Refusal> {
    match state.store.role() {
        Role::Fences => Ok(()),
        Role::Forward(leader) => Err(Refusal::NotLeader { leader }),
        Role::Unavailable(why) => Err(Refusal::Store(StoreError::Unavailable(why))),
    }
}

/// The body's `to`, and its `confirm` if any.
async fn requested(req: Request<Incoming>) -> Result<(u64, Option<String>), Refusal> {
    let body = Limited::new(req.into_body(), 4096).collect().await.map_err(|e| Refusal::BadRequest(e.to_string()))?;
    let v: Value = serde_json::from_slice(&body.to_bytes()).map_err(|e| Refusal::BadRequest(e.to_string()))?;
    let to =
        v.get("to").and_then(Value::as_u64).ok_or_else(|| Refusal::BadRequest("expected {\"to\": <u64>}".into()))?;
    Ok((to, v.get("confirm").and_then(Value::as_str).map(str::to_owned)))
}

/// A query value with its `%XX` escapes decoded.
fn decode(value: &str) -> Result<String, Refusal> {
    let bad = || Refusal::BadRequest(format!("query value {value:?} is not percent-encoded UTF-8"));
    let (bytes, mut out, mut i) = (value.as_bytes(), Vec::with_capacity(value.len()), 0);
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok()).ok_or_else(bad)?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// The fence key an admin path names, found exactly as for a write to that path, so an
/// operator acts on the key writes use (canonical form, scopes; an S3 object's path-style
/// `/bucket/key`).
fn fence_key(state: &State, path: &str) -> Result<String, Refusal> {
    let config = &state.settings.get().config;
    Ok(match config.backend.protocol {
        BackendProtocol::Http => keys::fence_key(path, &config.paths, &config.fence.scopes)?,
        BackendProtocol::S3 => keys::object_key(path, &config.fence.scopes)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_read_in_any_case() {
        let value = |v: &'static str| HeaderValue::from_static(v);
        for v in ["Bearer abc", "bearer abc", "BEARER abc", "bEaReR  abc", "Bearer abc "] {
            assert_eq!(bearer(Some(&value(v))), Some("abc"), "{v:?}");
        }
        for v in ["Basic abc", "Bearer", "Bearer ", "Bearerabc", "Token abc"] {
            assert_eq!(bearer(Some(&value(v))), None, "{v:?}");
        }
        assert_eq!(bearer(None), None);
    }

    #[test]
    fn query_values_are_decoded_once() {
        assert_eq!(decode("/a%20b%2Fc").unwrap(), "/a b/c");
        assert_eq!(decode("%2541").unwrap(), "%41");
        assert!(decode("%4").is_err() && decode("%zz").is_err() && decode("%ff").is_err());
    }
}
