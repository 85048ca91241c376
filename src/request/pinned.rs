//! A pinned write's two steps under its turn (docs/pins.md): before the advance, the key's
//! state is learnt (by a `HEAD` when the fence knows none), the client's own preconditions
//! are judged against it, and the write is given the precondition that names it; after the
//! answer, the key's pin is set from it, and a `412` becomes fencegate's `backend_moved`.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{ETAG, HeaderMap, HeaderName, HeaderValue, IF_MATCH, IF_NONE_MATCH};
use http::uri::PathAndQuery;
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::{BodyExt, Full};

use super::Outgoing;
use super::classify::Pinned;
use super::protocol::{Chosen, Protocol as _};
use crate::fence::{FenceError, Pin, PinSlot, QuarantineCause};
use crate::refusal::Refusal;
use crate::state::metrics::PinHeadLabels;
use crate::state::{Metrics, Settings};
use crate::upstream::{Connection, Hold, Peer, RequestBody, ResponseBody};

/// What a pinned write was sent with, for reading its answer.
pub(super) struct Pinning {
    slot: PinSlot,
    kind: Pinned,
    /// The state the precondition sent names (`If-Match: "t"`, or `If-None-Match: *` for
    /// absent); `None` when the key's state could not be asked for
    /// ([`Protocol::learning_head`]) and the write went unpinned, or when the client sent
    /// conditions of its own, whose `412` is the client's to read.
    sent: Option<Pin>,
}

/// Whether `name` is a request's condition: an `If-…` field, or WebDAV's `If`.
pub(super) fn is_condition(name: &HeaderName) -> bool {
    name.as_str() == "if" || name.as_str().starts_with("if-")
}

/// The precondition that names `pin`, as a refusal says it.
fn precondition(pin: &Pin) -> String {
    match pin {
        Pin::Tag(tag) => format!("If-Match: {tag}"),
        Pin::Absent => "If-None-Match: *".to_owned(),
    }
}

/// The refusal of a write that must wait out the key's quarantine for `retry_after`: a write
/// pinned to a tag may still apply late.
fn waits(slot: &PinSlot, retry_after: std::time::Duration) -> Refusal {
    let cause = QuarantineCause::UnknownPinnedOutcome;
    FenceError::Quarantined { resource: slot.key().to_owned(), retry_after, cause }.into()
}

/// Under the write's turn, before its advance: the key's pin (learnt with a `HEAD` on `conn`
/// when the fence knows none), the request's own `If-Match` and `If-None-Match` judged
/// against it, and the precondition naming it set on the request. Returns the connection to
/// send the write on. A refusal here has sent nothing and advanced nothing.
pub(super) async fn pin(
    settings: &Settings,
    metrics: &Metrics,
    protocol: Chosen,
    conn: Connection,
    out: &mut Outgoing,
    slot: PinSlot,
    kind: Pinned,
) -> Result<(Connection, Pinning), Refusal> {
    let mut unused = Some(conn);
    let asked = HeadFrom { uri: out.req.uri(), target: &out.target, headers: out.req.headers(), client: &out.client };
    let (pinning, precondition) = choose(metrics, protocol, &asked, slot, kind, async |key: &str| {
        // Taken once: `choose` learns at most once.
        let Some(conn) = unused.take() else { return Ok(None) };
        learn(settings, protocol, conn, &asked, key).await
    })
    .await?;
    if let Some((name, value)) = precondition {
        out.req.headers_mut().insert(name, value);
    }
    // The HEAD's connection is back in the pool once its answer ended.
    let conn = match unused {
        Some(conn) => conn,
        None => settings.upstream.connection().await?,
    };
    Ok((conn, pinning))
}

/// What a `HEAD` learning a key's state is made from: the write's target as the client sent it
/// and as it is forwarded, its headers, and its client.
pub(super) struct HeadFrom<'a> {
    pub(super) uri: &'a Uri,
    pub(super) target: &'a PathAndQuery,
    pub(super) headers: &'a HeaderMap,
    pub(super) client: &'a Peer,
}

/// The key's state for the write `asked`, under its turn and before its advance: the pin the
/// fence keeps, or one `learn` finds (by a `HEAD`; `None` when the
/// protocol cannot ask). Judges the write's own `If-Match` and `If-None-Match` against it, and
/// returns the precondition naming it that the write is sent with, if the backend honours one.
pub(super) async fn choose(
    metrics: &Metrics,
    protocol: Chosen,
    asked: &HeadFrom<'_>,
    slot: PinSlot,
    kind: Pinned,
    learn: impl AsyncFnOnce(&str) -> Result<Option<Pin>, Refusal>,
) -> Result<(Pinning, Option<(HeaderName, HeaderValue)>), Refusal> {
    // A pin kept from an earlier write is out of date when the backend's state moved around
    // the fence (a write that bypassed it; in a cluster, a write of another leader): a client
    // precondition it fails is judged again against the backend's word, or a client that names
    // the real state would be refused on every retry. One a late write was pinned to is learnt
    // again too: that write may have landed meanwhile.
    // Judged only where the client sent any condition: most writes send none.
    let HeadFrom { uri, headers, .. } = *asked;
    let own_conditions = headers.keys().any(is_condition);
    let holds = |pin: &Pin| if own_conditions { judge(headers, pin, slot.key()) } else { Ok(()) };
    let kept = slot.get().filter(|pin| holds(pin).is_ok() && slot.late(pin).is_none());
    let pin = match kept {
        Some(pin) => pin,
        None => match count(metrics, learn(slot.key()).await)? {
            Some(pin) => {
                // A write whose outcome is unknown was sent pinned to this very state and may
                // still apply: were this one sent pinned to it too, it could land first and
                // leave the same tag behind (the same bytes, under a digest ETag), and the late
                // one would then apply after it. It waits out the quarantine, as without pins.
                // What it found is not kept: the late write may land and move it at any time,
                // and a write sent pinned to a state the backend left, should its own outcome
                // be unknown, could apply once a write of those bytes brought the tag back.
                if let Some(retry_after) = slot.late(&pin) {
                    return Err(waits(&slot, retry_after));
                }
                // Learnt under the turn: it holds until this write's advance.
                slot.set(pin.clone());
                holds(&pin)?;
                pin
            }
            None => {
                // Sent unpinned, it could leave behind the tag a late write was pinned to.
                if let Some(retry_after) = slot.late_any() {
                    return Err(waits(&slot, retry_after));
                }
                return Ok((Pinning { slot, kind, sent: None }, None));
            }
        },
    };
    if !protocol.honours(kind, &pin) {
        // No precondition the backend honours names this state: sent as without pins.
        return Ok((Pinning { slot, kind, sent: None }, None));
    }
    let precondition = match &pin {
        Pin::Tag(tag) => (IF_MATCH, HeaderValue::from_str(tag).map_err(|e| unreadable(slot.key(), e))?),
        Pin::Absent => (IF_NONE_MATCH, HeaderValue::from_static("*")),
    };
    // The client's own condition that agrees loosely (`If-Match: *`, a list) is replaced by the
    // exact one, unless the client signed it: the backend would refuse the changed header
    // (`SignatureDoesNotMatch`), so fencegate says why instead.
    let (name, value) = &precondition;
    if own_conditions
        && !headers.get_all(name).iter().eq([value])
        && headers.contains_key(name)
        && protocol.signed(headers, uri, name)
    {
        return Err(Refusal::BadRequest(format!(
            "the signed {name} names more than the state of {} that fencegate pins the write to \
             ({name}: {}): sign {name} with exactly that, or leave it out",
            slot.key(),
            value.to_str().unwrap_or_default()
        )));
    }
    slot.sent_pinned(&pin);
    // A 412 may then be the client's own condition failing (If-Unmodified-Since, WebDAV's If):
    // relayed as the backend wrote it, not as fencegate's backend_moved.
    let sent = (!own_conditions).then_some(pin);
    Ok((Pinning { slot, kind, sent }, Some(precondition)))
}

/// A pinned write's answer, under its turn: a `2xx` sets the key's pin (the answer's strong
/// `ETag` after a `PUT`, none known without one; absent after a `DELETE`), and a `412` is
/// fencegate's `backend_moved`. Any other answer leaves the pin unknown, as the advance left it.
pub(super) fn answered(
    pinning: Pinning,
    result: Result<Response<ResponseBody>, Refusal>,
) -> Result<Response<ResponseBody>, Refusal> {
    let tag = result.as_ref().ok().and_then(|resp| strong_tag(resp.headers()));
    answered_with_tag(pinning, result, tag)
}

/// [`answered`], with `tag` for the entity tag a `PUT`'s answer names: its `ETag`, or what its
/// body names where the backend writes it there (S3's CompleteMultipartUpload), read by
/// [`strong_tag_of`] as [`settle`] requires.
pub(super) fn answered_with_tag(
    pinning: Pinning,
    result: Result<Response<ResponseBody>, Refusal>,
    tag: Option<Arc<str>>,
) -> Result<Response<ResponseBody>, Refusal> {
    let resp = result?;
    settle(pinning, resp.status(), tag)?;
    Ok(resp)
}

/// A pinned write's answer `status` from the backend, under its turn: a `2xx` sets the key's
/// pin (to `tag`, the strong entity tag a `PUT`'s answer names in its `ETag` field or its body;
/// none known without one; absent after a `DELETE`), and a `412` to the precondition fencegate
/// sent is `backend_moved`. Any other answer leaves the pin unknown, as the advance left it.
/// Every caller reads `tag` with [`strong_tag_of`], so that the next write can send it in a
/// header: a tag no field can carry would leave a pin no write can use.
pub(super) fn settle(pinning: Pinning, status: StatusCode, tag: Option<Arc<str>>) -> Result<(), Refusal> {
    let Pinning { slot, kind, sent } = pinning;
    if status == StatusCode::PRECONDITION_FAILED
        && let Some(pin) = &sent
    {
        return Err(Refusal::BackendMoved { resource: slot.key().to_owned(), sent: precondition(pin) });
    }
    debug_assert!(
        tag.as_deref().is_none_or(|tag| strong_tag_of(std::iter::once(tag.as_bytes())).is_some()),
        "a tag no ETag field can carry: {tag:?}"
    );
    if status.is_success() {
        match kind {
            Pinned::Put => {
                if let Some(tag) = tag {
                    slot.set(Pin::Tag(tag));
                }
            }
            Pinned::Delete => slot.set(Pin::Absent),
        }
    }
    Ok(())
}

/// Counts a `HEAD`'s finding in `fencegate_pin_heads_total`.
fn count(metrics: &Metrics, learnt: Result<Option<Pin>, Refusal>) -> Result<Option<Pin>, Refusal> {
    let found = match &learnt {
        Ok(None) => return learnt,
        Ok(Some(Pin::Tag(_))) => "tag",
        Ok(Some(Pin::Absent)) => "absent",
        Err(_) => "unavailable",
    };
    metrics.pin_heads.get_or_create(&PinHeadLabels { found }).inc();
    learnt
}

/// The backend's state of the key a write `asked` for changes, from a `HEAD` of its target on
/// `conn`; `None` when the protocol cannot ask (conn is then given back unused).
pub(super) async fn learn(
    settings: &Settings,
    protocol: Chosen,
    conn: Connection,
    asked: &HeadFrom<'_>,
    key: &str,
) -> Result<Option<Pin>, Refusal> {
    let mut head = Request::new(RequestBody::Read(Full::new(Bytes::new())));
    *head.method_mut() = Method::HEAD;
    *head.uri_mut() = asked.uri.clone();
    let mut target = asked.target.clone();
    if !protocol.learning_head(&mut head, &mut target, asked.headers, &settings.config) {
        return Ok(None);
    }
    let resp = settings.upstream.forward(conn, head, target, asked.client, None, Hold::default()).await;
    let unavailable = |why: String| Refusal::PinUnavailable { resource: key.to_owned(), why };
    let resp = resp.map_err(|e| unavailable(format!("its HEAD failed: {e}")))?;
    let (parts, body) = resp.into_parts();
    // A HEAD's answer has no body: reading it to its end gives the connection back.
    body.collect().await.map_err(|e| unavailable(format!("its HEAD's answer broke off: {e}")))?;
    let pin = match parts.status {
        status if status.is_success() => strong_tag(&parts.headers).map(Pin::Tag).ok_or_else(|| {
            unavailable(match parts.headers.get(ETAG) {
                Some(_) => {
                    "the backend's HEAD named no strong ETag (a weak one never matches If-Match: docs/pins.md)".into()
                }
                None => "the backend's HEAD named no ETag".into(),
            })
        }),
        StatusCode::NOT_FOUND | StatusCode::GONE => Ok(Pin::Absent),
        status => Err(unavailable(format!("the backend answered its HEAD {status}"))),
    };
    pin.map(Some)
}

/// The strong entity tag of one `ETag` field, with its quotes; `None` for a weak, malformed or
/// repeated one.
fn strong_tag(headers: &HeaderMap) -> Option<Arc<str>> {
    strong_tag_of(headers.get_all(ETAG).iter().map(HeaderValue::as_bytes))
}

/// [`strong_tag`] of the `ETag` field `values`.
pub(super) fn strong_tag_of<'a>(mut values: impl Iterator<Item = &'a [u8]>) -> Option<Arc<str>> {
    let (Some(value), None) = (values.next(), values.next()) else { return None };
    // Blanks around the tag, then its quotes, and between them no quote and nothing but
    // visible ASCII or a tab (as `HeaderValue::to_str` reads a field): each byte looked at once.
    let blank = |b: &u8| matches!(b, b' ' | b'\t');
    let start = value.iter().position(|b| !blank(b))?;
    let end = value.iter().rposition(|b| !blank(b))?;
    let tag = &value[start..=end];
    let [b'"', inner @ .., b'"'] = tag else { return None };
    if !inner.iter().all(|&b| b == b'\t' || ((0x20..0x7f).contains(&b) && b != b'"')) {
        return None;
    }
    std::str::from_utf8(tag).ok().map(Arc::from)
}

/// One entity tag of a precondition's list.
#[derive(Debug, PartialEq, Eq)]
enum Listed<'a> {
    /// `*`: any current representation.
    Any,
    /// A tag, with its quotes; `weak` when written `W/"…"`.
    Tag { tag: &'a str, weak: bool },
}

/// The entity tags an `If-Match` or `If-None-Match` lists, over all its fields.
fn listed<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<Option<Vec<Listed<'a>>>, Refusal> {
    let mut all = Vec::new();
    let mut seen = false;
    for value in headers.get_all(name) {
        seen = true;
        let text = value.to_str().map_err(|e| invalid(name, e.to_string()))?;
        let mut rest = text.trim_start_matches([' ', '\t', ',']);
        while !rest.is_empty() {
            let (item, after) = if let Some(after) = rest.strip_prefix('*') {
                (Listed::Any, after)
            } else {
                let (weak, quoted) = match rest.strip_prefix("W/") {
                    Some(q) => (true, q),
                    None => (false, rest),
                };
                let inner = quoted
                    .strip_prefix('"')
                    .ok_or_else(|| invalid(name, format!("{text:?} is not a list of entity tags")))?;
                let end =
                    inner.find('"').ok_or_else(|| invalid(name, format!("{text:?} has an unclosed entity tag")))?;
                (Listed::Tag { tag: &quoted[..end + 2], weak }, &inner[end + 1..])
            };
            all.push(item);
            rest = after.trim_start_matches([' ', '\t']);
            match rest.strip_prefix(',') {
                Some(after) => rest = after.trim_start_matches([' ', '\t', ',']),
                None if rest.is_empty() => {}
                None => return Err(invalid(name, format!("{text:?} is not a list of entity tags"))),
            }
        }
    }
    Ok(seen.then_some(all))
}

/// Refuses a write whose own `If-Match` or `If-None-Match` does not hold for `pin`, as the
/// backend would (RFC 9110 13.1.1 and 13.1.2: strong comparison for `If-Match`, weak for
/// `If-None-Match`).
fn judge(headers: &HeaderMap, pin: &Pin, key: &str) -> Result<(), Refusal> {
    let state = || match pin {
        Pin::Tag(tag) => format!("tagged {tag}"),
        Pin::Absent => "absent".to_owned(),
    };
    let failed = |header| Refusal::PreconditionFailed { resource: key.to_owned(), header, state: state() };
    if let Some(list) = listed(headers, &IF_MATCH)? {
        let holds = match pin {
            Pin::Tag(current) => list.iter().any(|l| match l {
                Listed::Any => true,
                Listed::Tag { tag, weak } => !weak && *tag == &**current,
            }),
            Pin::Absent => false,
        };
        if !holds {
            return Err(failed("If-Match"));
        }
    }
    if let Some(list) = listed(headers, &IF_NONE_MATCH)? {
        let holds = match pin {
            Pin::Tag(current) => !list.iter().any(|l| match l {
                Listed::Any => true,
                Listed::Tag { tag, .. } => tag.trim_start_matches("W/") == current.trim_start_matches("W/"),
            }),
            Pin::Absent => true,
        };
        if !holds {
            return Err(failed("If-None-Match"));
        }
    }
    Ok(())
}

fn invalid(name: &HeaderName, reason: String) -> Refusal {
    Refusal::InvalidHeader { name: name.to_string(), reason }
}

fn unreadable(key: &str, e: impl std::fmt::Display) -> Refusal {
    Refusal::PinUnavailable { resource: key.to_owned(), why: format!("its entity tag cannot be sent: {e}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn a_strong_tag_is_read_and_a_weak_or_doubled_one_is_not() {
        assert_eq!(strong_tag(&headers(&[("etag", "\"a1\"")])).as_deref(), Some("\"a1\""));
        assert_eq!(strong_tag(&headers(&[("etag", "W/\"a1\"")])), None);
        assert_eq!(strong_tag(&headers(&[("etag", "a1")])), None);
        assert_eq!(strong_tag(&headers(&[("etag", "\"a\"\"")])), None);
        assert_eq!(strong_tag(&headers(&[("etag", "\"a\""), ("etag", "\"b\"")])), None);
        assert_eq!(strong_tag(&headers(&[])), None);
        assert_eq!(strong_tag(&headers(&[("etag", " \"a 1\"\t")])).as_deref(), Some("\"a 1\""));
        assert_eq!(strong_tag(&headers(&[("etag", "\"")])), None);
        assert_eq!(strong_tag(&headers(&[("etag", "\"\"")])).as_deref(), Some("\"\""));
        for bytes in [&b"\"a\xff\""[..], b"\"a\x01\"", b"\"a\"\x7f", b"x\"a\""] {
            assert_eq!(strong_tag_of(std::iter::once(bytes)), None, "{bytes:?}");
        }
    }

    #[test]
    fn lists_of_entity_tags_are_read_over_all_fields() {
        let h = headers(&[("if-match", "\"a\", W/\"b\""), ("if-match", " * ,\"c,d\"")]);
        let list = listed(&h, &IF_MATCH).unwrap().unwrap();
        assert_eq!(
            list,
            [
                Listed::Tag { tag: "\"a\"", weak: false },
                Listed::Tag { tag: "\"b\"", weak: true },
                Listed::Any,
                Listed::Tag { tag: "\"c,d\"", weak: false },
            ]
        );
        assert_eq!(listed(&headers(&[]), &IF_MATCH).unwrap(), None);
        for bad in ["a", "\"a", "\"a\" b"] {
            let h = headers(&[("if-match", bad)]);
            assert!(matches!(listed(&h, &IF_MATCH), Err(Refusal::InvalidHeader { .. })), "{bad}");
        }
    }

    #[test]
    fn the_clients_preconditions_are_judged_against_the_pin() {
        let tag = Pin::Tag("\"t\"".into());
        let judged = |pairs: &[(&'static str, &'static str)], pin: &Pin| match judge(&headers(pairs), pin, "/k") {
            Ok(()) => "holds",
            Err(Refusal::PreconditionFailed { header, .. }) => header,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(judged(&[], &tag), "holds");
        assert_eq!(judged(&[("if-match", "\"t\"")], &tag), "holds");
        assert_eq!(judged(&[("if-match", "\"x\", \"t\"")], &tag), "holds");
        assert_eq!(judged(&[("if-match", "*")], &tag), "holds");
        assert_eq!(judged(&[("if-match", "W/\"t\"")], &tag), "If-Match", "strong comparison");
        assert_eq!(judged(&[("if-match", "\"x\"")], &tag), "If-Match");
        assert_eq!(judged(&[("if-match", "*")], &Pin::Absent), "If-Match");
        assert_eq!(judged(&[("if-none-match", "*")], &Pin::Absent), "holds");
        assert_eq!(judged(&[("if-none-match", "*")], &tag), "If-None-Match");
        assert_eq!(judged(&[("if-none-match", "W/\"t\"")], &tag), "If-None-Match", "weak comparison");
        assert_eq!(judged(&[("if-none-match", "\"x\"")], &tag), "holds");
    }
}
