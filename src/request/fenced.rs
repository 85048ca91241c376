//! A fenced write's phases, in the order docs/writes.md names them. Before its turn, each may
//! be abandoned if the client goes away:
//!
//! 1. [`route`]: where it is fenced. Here, by the file store or a shared fence's leader; a
//!    follower sends it on to the leader, whose answer it relays.
//! 2. [`prove`]: its proof (a signature, the holder of an etcd lock), before anything looks at
//!    the token: an unproven one must not even be compared.
//! 3. The precheck against `max_seen` and the floors, and the wait for the turn.
//!
//! Once the turn is ours, `Turn::finish_after` runs the write to its end: the authoritative
//! check, then [`prepare`] (a backend connection, the proof's second look; the send is given
//! the lease's permit for the term of the check), the durable advance, the send, and the
//! answer or a quarantine.

use std::sync::Arc;
use std::time::Instant;

use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};

use super::classify::{Pinned, UploadStep, Write};
use super::lapsed::Watched;
use super::proof::Proof;
use super::protocol::{Chosen, Protocol as _};
use super::{InFlight, Outgoing, ResponseBody, holders, pinned, proof, send};
use crate::etcd_client::Mirrors;
use crate::fence::{BindError, Outcome, PinSlot, Policy, Touch};
use crate::refusal::Refusal;
use crate::state::{Settings, State};
use crate::store::{Permit, Role, StoreError};
use crate::upstream::{Hold, Peer, RequestBody, UpstreamError, full_body, leader, remove_held};

/// Where a write is fenced: here, or by the leader at this URL.
enum Routed {
    Here,
    Leader(String),
}

/// What a write must prove, and what proving it takes at its first and its second look.
pub(super) struct Proven {
    token: u64,
    proof: Proof,
    /// The etcd locks whose holder the token must be.
    locks: Vec<String>,
    /// The first key, which a refusal at the second look names (kept only for a write that
    /// has a proof, so that the others pay no copy).
    pub(super) first: Option<Touch>,
}

impl Proven {
    /// The proof against the keys and the locks' holders in force now.
    pub(super) fn check(
        &self,
        touches: &[Touch],
        hmac: &crate::fence::signature::HmacKeys,
        locks: &Mirrors,
    ) -> Result<(), Refusal> {
        proof::check(&self.proof, self.token, touches, hmac)?;
        holders::check(locks, &self.locks, self.token).map_err(Refusal::Lock)
    }
}

/// Takes a fenced write through its phases. Those before its turn (where it is fenced, its
/// proof, the precheck) run here, before the future is built: the future, which lives across
/// the wait for the turn, holds only what the turn needs, with the rest of the write boxed.
pub(super) fn fence(
    state: Arc<State>,
    settings: Arc<Settings>,
    mut req: Request<RequestBody>,
    write: Write,
    client: Peer,
    protocol: Chosen,
) -> impl Future<Output = Result<Response<ResponseBody>, Refusal>> {
    let next = match route(&state, &mut req) {
        Ok(Routed::Here) => check(state, settings, req, write, client, protocol),
        Ok(Routed::Leader(url)) => Ok(Next::Leader { url, req: Box::new(req), state, settings, client }),
        Err(refusal) => Err(refusal),
    };
    async move {
        match next? {
            Next::Leader { url, req, state, settings, client } => {
                send_to_leader(&state, &settings, &url, *req, &client).await
            }
            Next::Turn(waiting, None) => waiting.finish().await,
            Next::Turn(waiting, Some(created)) => {
                let token = waiting.token;
                let resp = waiting.finish().await?;
                created.bind(protocol, token, resp).await
            }
            // Boxed: a part of an upload is the exception, and its send inline would double
            // the room every fenced write's future takes.
            Next::Part(waiting) => Box::pin(waiting.send_without_turn()).await,
        }
    }
}

/// Where a fenced write goes once its checks before the turn passed.
enum Next {
    /// To the leader at `url`, which fences it. The request is boxed, as the write fenced here
    /// boxes it, so that neither makes the future that holds them large.
    Leader { url: String, req: Box<Request<RequestBody>>, state: Arc<State>, settings: Arc<Settings>, client: Peer },
    /// To its turn here, and then, for the creation of a multipart upload, to its binding.
    Turn(Waiting, Option<Box<Created>>),
    /// A part of a multipart upload, checked here, to the backend without a turn: a part
    /// changes no object, only its upload, every write to which carries the one token it was
    /// bound to. The parts of an upload go side by side, as S3 clients send them; the
    /// completion takes the object's turn.
    Part(Waiting),
}

/// The creation of a multipart upload of `object`, whose id the backend's answer names.
struct Created {
    object: String,
    state: Arc<State>,
    settings: Arc<Settings>,
}

/// Most bytes of an answer to CreateMultipartUpload read for its upload id.
const MAX_CREATED: usize = 64 * 1024;

impl Created {
    /// Binds the upload the backend's answer `resp` to the creation of `token` names, before
    /// the client hears of it. (The binding of an upload that ends is dropped inside the
    /// write's turn: [`ended`].)
    async fn bind(
        self,
        protocol: Chosen,
        token: u64,
        resp: Response<ResponseBody>,
    ) -> Result<Response<ResponseBody>, Refusal> {
        let Created { object, state, settings } = self;
        if resp.status() != StatusCode::OK {
            return Ok(resp);
        }
        let (parts, body) = resp.into_parts();
        let unread = |e| unusable(&object, format!("its answer could not be read: {e}"));
        let bytes = read_whole_answer(body, MAX_CREATED, &settings, unread).await?;
        bind_created(&state, &settings, protocol, &object, token, &bytes).await?;
        Ok(Response::from_parts(parts, full_body(Full::new(bytes))))
    }
}

/// Binds the upload that `body`, the backend's whole answer to the creation of an upload of
/// `object`, names to `token`: durably, before the client hears of the id.
pub(super) async fn bind_created(
    state: &State,
    settings: &Settings,
    protocol: Chosen,
    object: &str,
    token: u64,
    body: &[u8],
) -> Result<(), Refusal> {
    let id = protocol.upload_id(body).ok_or_else(|| unusable(object, "its answer names no upload id".into()))?;
    let (s3, scopes) = (&settings.config.s3, &settings.config.fence.scopes);
    state.fence.bind_upload(object, &id, token, s3.max_uploads, scopes).await.map_err(|e| match e {
        BindError::Fence(e) => Refusal::Fence(e),
        BindError::Store(e) => Refusal::Store(e),
    })
}

/// A created upload of `object` that cannot be bound, for `why`.
fn unusable(object: &str, why: String) -> Refusal {
    Refusal::Upstream(UpstreamError::Failed(format!(
        "the backend created a multipart upload of {object}, but {why}; the upload cannot be used"
    )))
}

/// Drops the binding of upload `id` of `object` once `body`, the backend's whole success
/// answer to its end, does not say it failed all the same; then, the entity tag the body names
/// for the completed object, if it names one that an `ETag` field could carry (the next write's
/// precondition sends it in one).
pub(super) async fn drop_ended(
    state: &State,
    protocol: Chosen,
    object: &str,
    id: &str,
    body: &[u8],
) -> Option<Arc<str>> {
    if protocol.failed_late(body) {
        return None;
    }
    if let Err(e) = state.fence.drop_upload(object, id).await {
        // Left behind, the binding names an upload the server has ended.
        tracing::warn!(object, upload = id, error = %e, "could not drop an ended upload's binding");
    }
    protocol.completed_tag(body).and_then(|tag| pinned::strong_tag_of(std::iter::once(tag.as_bytes())))
}

/// The checks of a write fenced here before its turn: its proof, then the precheck of its
/// token against `max_seen` and the floors.
fn check(
    state: Arc<State>,
    settings: Arc<Settings>,
    mut req: Request<RequestBody>,
    write: Write,
    client: Peer,
    protocol: Chosen,
) -> Result<Next, Refusal> {
    let Write { token, touches, target, set_headers, body_limit, equal, max_jump, proof, locks, upload, pin } = write;
    let proven = prove(&state, &settings, token, proof, locks, &touches)?;
    // A part's or an end's upload is checked before the precheck, since its token is what is
    // checked.
    let (mut part, mut ends, mut created) = (false, None, None);
    match upload.map(|step| *step) {
        Some(UploadStep::Part { object, id }) => {
            state.fence.check_upload(&object, &id, token)?;
            part = true;
        }
        Some(UploadStep::End { object, id }) => {
            state.fence.check_upload(&object, &id, token)?;
            ends = Some(Box::new(Ends { object, id }));
        }
        Some(UploadStep::Create { object }) => {
            created = Some(Box::new(Created { object, state: Arc::clone(&state), settings: Arc::clone(&settings) }));
        }
        None => {}
    }
    // A pinned PUT may pass the quarantine a pinned write's unknown outcome left.
    let policy = Policy { equal, max_jump, pinned: pin == Some(Pinned::Put) };
    // What the backend is told to change is what was fenced.
    for (name, value) in set_headers {
        req.headers_mut().insert(name, value);
    }
    state.fence.precheck(&touches, token, policy)?;
    // Boxed once, built in place: until the send takes it apart it moves as a pointer.
    let out = Outgoing { req, target, client, body_limit };
    let pending = Box::write(Box::new_uninit(), Pending { state, settings, proven, out, ends, pin, protocol });
    let waiting = Waiting { token, policy, touches, pending };
    Ok(if part { Next::Part(waiting) } else { Next::Turn(waiting, created) })
}

/// A write that passed its checks before the turn, and waits for it.
struct Waiting {
    token: u64,
    policy: Policy,
    touches: Vec<Touch>,
    pending: Box<Pending>,
}

impl Waiting {
    /// Sends a part of a multipart upload, checked (its binding, its token against the
    /// object's `max_seen`) but neither advancing a key nor taking a turn: it changes no object.
    async fn send_without_turn(self) -> Result<Response<ResponseBody>, Refusal> {
        let pending = self.pending;
        let conn = pending.settings.upstream.connection().await?;
        let _flying = InFlight::new(&pending.state.metrics);
        send(&pending.state, &pending.settings, conn, pending.out, Hold::default()).await
    }

    /// Waits for the turn; once it is ours, `finish_after` runs the write to its end.
    async fn finish(self) -> Result<Response<ResponseBody>, Refusal> {
        let Waiting { token, policy, touches, pending } = self;
        let fence = &pending.settings.config.fence;
        let (queue_timeout, quarantine) = (fence.queue_timeout, fence.quarantine);
        let waiting = Instant::now();
        let turn = pending.state.fence.acquire(touches, queue_timeout).await;
        pending.state.metrics.queue_wait.observe(waiting.elapsed().as_secs_f64());
        let mut turn = turn?;
        let slot = pending.pin.and_then(|kind| turn.pin_slot().map(|slot| (slot, kind)));
        turn.finish_after(token, policy, quarantine, move |permit| prepare(pending, permit, slot), outcome).await
    }
}

/// What a fenced write's send needs once its turn has come.
struct Pending {
    state: Arc<State>,
    settings: Arc<Settings>,
    proven: Proven,
    out: Outgoing,
    /// The multipart upload the write completes or aborts, if it does.
    ends: Option<Box<Ends>>,
    /// How the write is pinned to its key's state at the backend, if it is.
    pin: Option<Pinned>,
    protocol: Chosen,
}

/// A write's end of a multipart upload: the turn is held until the backend's answer has ended,
/// not only its head (S3 answers a completion `200` before it has finished), and the upload's
/// binding is dropped within it, so even a write whose client left drops it.
struct Ends {
    object: String,
    id: String,
}

/// Where the write is fenced: with a shared fence, only its leader fences writes, and a
/// follower sends them to it once (a write sent on once is not sent on again).
fn route(state: &State, req: &mut Request<RequestBody>) -> Result<Routed, Refusal> {
    match state.store.role() {
        Role::Fences => {
            remove_held(req.headers_mut(), &leader::FORWARDED_BY);
            remove_held(req.headers_mut(), &leader::FORWARDED_PROOF);
            Ok(Routed::Here)
        }
        Role::Forward(url) if !leader::forwarded(req, state.store.peer_secret().as_deref()) => Ok(Routed::Leader(url)),
        Role::Forward(url) => Err(StoreError::Unavailable(format!(
            "the fence is led by {url}, not by this instance, which another instance took for the leader; \
            a write sent on once is not sent on again"
        ))
        .into()),
        Role::Unavailable(why) => Err(StoreError::Unavailable(why).into()),
    }
}

/// Sends a write on to the leader at `url`, which fences it, and relays its answer.
async fn send_to_leader(
    state: &State,
    settings: &Settings,
    url: &str,
    req: Request<RequestBody>,
    client: &Peer,
) -> Result<Response<ResponseBody>, Refusal> {
    let Some(peers) = state.peers.as_ref() else {
        return Err(StoreError::Unavailable("this instance cannot reach the leader".into()).into());
    };
    let backend = &settings.config.backend;
    let timeout = backend.pool_timeout + backend.request_timeout + settings.config.fence.queue_timeout;
    let secret = state.store.peer_secret();
    Ok(peers.forward(url, req, client, settings.upstream.policy(), timeout, secret.as_deref()).await?)
}

/// The proof's first look, before anything looks at the token.
pub(super) fn prove(
    state: &State,
    settings: &Settings,
    token: u64,
    proof: Proof,
    locks: Vec<String>,
    touches: &[Touch],
) -> Result<Proven, Refusal> {
    let first = match proof {
        Proof::None => None,
        _ => touches.first().cloned(),
    };
    let proven = Proven { token, proof, locks, first };
    proven.check(touches, &settings.hmac, &state.locks.load())?;
    Ok(proven)
}

/// What the turn runs before the advance, and then the send, under `permit`: the store's
/// permit for the term the write was checked in. Boxed: the connection's checkout and the
/// forward's state (request, timer) would otherwise make up most of the write's future, which
/// is moved into its box whole.
fn prepare(
    mut pending: Box<Pending>,
    permit: Option<Permit>,
    slot: Option<(PinSlot, Pinned)>,
) -> impl Future<Output = Result<impl Future<Output = Result<Response<ResponseBody>, Refusal>>, Refusal>> {
    boxed_in_place!(async move {
        // Before the advance: without a connection the token is not used up.
        let conn = pending.settings.upstream.connection().await?;
        // The proof's authoritative look, when the turn has come and the connection is there
        // (waiting for one can take pool_timeout), against the keys in force now: a holder that
        // lost its lock meanwhile, a key a reload withdrew (after a leak), or a signature that
        // expired while the write waited no longer passes, and the token is not used up.
        let (proven, state) = (&pending.proven, &pending.state);
        proven.check(proven.first.as_slice(), &state.settings.get().hmac, &state.locks.load())?;
        // The key's state learnt and named in the request, still before the advance.
        let (conn, pinning) = match slot {
            Some((slot, kind)) => {
                let (conn, pinning) = pinned::pin(
                    &pending.settings,
                    &pending.state.metrics,
                    pending.protocol,
                    conn,
                    &mut pending.out,
                    slot,
                    kind,
                )
                .await?;
                (conn, Some(pinning))
            }
            None => (conn, None),
        };
        // Still boxed: the send takes it apart.
        Ok(boxed_in_place!(async move {
            let _flying = InFlight::new(&pending.state.metrics);
            // Whole: the turn is held until the backend has the whole body, not only until it
            // answers. A shared fence's leader sends only while it trusts its lease: the permit
            // is checked before the head and each body chunk (docs/cluster.md: self-fencing).
            // Only what is sent leaves the box.
            let watched = permit.map(|permit| (Watched::new(permit), pending.out.target.clone()));
            let hold = Hold { whole: true, permit: watched.as_ref().map(|(watched, _)| watched.permit()) };
            let resp = send(&pending.state, &pending.settings, conn, pending.out, hold).await;
            if let Some((watched, target)) = &watched {
                let (metrics, token) = (&pending.state.metrics, pending.proven.token);
                watched.ended(metrics, target.path(), token, &resp, |resp| Some(resp.status()));
            }
            let Some(ends) = &pending.ends else {
                return match pinning {
                    Some(pinning) => pinned::answered(pinning, resp),
                    None => resp,
                };
            };
            // The end of an upload names the object's entity tag in its body, read whole first.
            let (resp, tag) = ended(&pending.state, &pending.settings, pending.protocol, ends, resp?).await?;
            match pinning {
                Some(pinning) => pinned::answered_with_tag(pinning, Ok(resp), tag),
                None => Ok(resp),
            }
        }))
    })
}

/// Most bytes of the answer to a multipart upload's completion read while its turn is held.
const MAX_ENDED: usize = 1024 * 1024;

/// The backend's answer `body` read whole: at most `limit` bytes within
/// `backend.request_timeout`. One cut off or too long is `unread` of why; one late,
/// `UpstreamError::Timeout`.
async fn read_whole_answer(
    body: ResponseBody,
    limit: usize,
    settings: &Settings,
    unread: impl FnOnce(Box<dyn std::error::Error + Send + Sync>) -> Refusal,
) -> Result<bytes::Bytes, Refusal> {
    let timeout = settings.config.backend.request_timeout;
    match tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) => Err(unread(e)),
        Err(_) => Err(Refusal::Upstream(UpstreamError::Timeout(timeout))),
    }
}

/// The backend's answer `resp` to the end of an upload, read whole (within
/// `backend.request_timeout`) while the turn is held: S3 answers a CompleteMultipartUpload
/// `200` at once and its result (or a late `<Error>`) once the upload is complete, keeping the
/// connection with whitespace meanwhile, so the completion is done only when its answer has
/// ended. An answer cut off or late leaves the outcome unknown, and the object is quarantined.
/// Once the backend completed or aborted the upload (not after a `200` that says it failed,
/// which leaves the upload open for the holder's retry), its binding is dropped, and the
/// entity tag the answer names for the completed object is returned with it.
async fn ended(
    state: &State,
    settings: &Settings,
    protocol: Chosen,
    ends: &Ends,
    resp: Response<ResponseBody>,
) -> Result<(Response<ResponseBody>, Option<Arc<str>>), Refusal> {
    let (parts, body) = resp.into_parts();
    let unread = |e| {
        let why = format!("the answer to the end of a multipart upload could not be read whole: {e}");
        Refusal::Upstream(UpstreamError::Failed(why))
    };
    let bytes = read_whole_answer(body, MAX_ENDED, settings, unread).await?;
    let Ends { object, id } = ends;
    let tag = match parts.status.is_success() {
        true => drop_ended(state, protocol, object, id, &bytes).await,
        false => None,
    };
    Ok((Response::from_parts(parts, full_body(Full::new(bytes))), tag))
}

/// Whether the backend may still apply a write that got this result.
pub(super) fn outcome<T>(result: &Result<T, Refusal>) -> Outcome {
    match result {
        Err(Refusal::Upstream(
            UpstreamError::Timeout(_) | UpstreamError::Failed(_) | UpstreamError::BodyTooLarge { .. },
        )) => Outcome::Unknown,
        _ => Outcome::Answered,
    }
}
