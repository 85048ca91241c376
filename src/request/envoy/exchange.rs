//! One exchange: the gRPC stream Envoy opens for one request. fencegate reads the request's
//! head, classifies it as the proxy does, and for a fenced write answers the head only once the
//! write holds its turn and its advance is durable. Envoy sends nothing to the backend before
//! that answer, and holds each body chunk until fencegate answers it too, so the turn is held
//! until the request's end has been let go and Envoy reports the backend's answer; a stream
//! that ends before both leaves the outcome unknown and quarantines what the write touches.

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Asked;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use http::Method;
use http::uri::PathAndQuery;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::mpsc::Sender;
use tokio::sync::mpsc::error::SendError;
use tonic::Streaming;

use super::Said;
use super::wire::{self, Head};
use crate::fence::{PinSlot, Policy};
use crate::refusal::{ERROR_HEADER, Refusal};
use crate::request::InFlight;
use crate::request::access::Entry;
use crate::request::classify::{Pinned, Plan, UploadStep, Write};
use crate::request::fenced::{bind_created, drop_ended, outcome, prove};
use crate::request::lapsed::Watched;
use crate::request::pinned::{self, HeadFrom, Pinning};
use crate::request::proof::Guess;
use crate::request::protocol::{self, Chosen, Protocol as _};
use crate::state::{Settings, State};
use crate::store::{Permit, Role, StoreError};
use crate::upstream::{self, Peer, UpstreamError};

/// Why a write was not let go: Envoy closed its stream first.
const GONE: &str = "Envoy's stream ended before the write was let go";

/// Where fencegate's answers to Envoy go, and whether one of them let the request (or part of
/// it) go on: from then on, an exchange that does not end cleanly never closes its stream
/// cleanly (see `super::Answers`), whatever else it says.
#[derive(Clone)]
struct Out {
    said: Sender<Said>,
    released: Arc<AtomicBool>,
    /// Whether fencegate's own answer was given already, in place of the backend's.
    answered: Arc<AtomicBool>,
}

impl Out {
    async fn send(&self, said: Said) -> Result<(), SendError<Said>> {
        self.said.send(said).await
    }

    /// Sends `answer`, which lets the request, or part of it, go on. Noted first: once it is
    /// sent, Envoy may act on it.
    async fn release(&self, answer: ProcessingResponse) -> Result<(), SendError<Said>> {
        self.released.store(true, Ordering::Relaxed);
        self.send(Said::Answer(answer)).await
    }

    fn released(&self) -> bool {
        self.released.load(Ordering::Relaxed)
    }

    async fn closed(&self) {
        self.said.closed().await
    }

    fn is_closed(&self) -> bool {
        self.said.is_closed()
    }
}

/// How an exchange ended, as far as fencegate's own answer goes.
enum Ended {
    /// The request went on to the backend, which answered with this status.
    Forwarded(u16),
    /// The request went on unfenced.
    Passed,
}

/// Runs one exchange to its end.
pub(super) async fn run(state: Arc<State>, client: Peer, mut inbound: Streaming<ProcessingRequest>, out: Sender<Said>) {
    let out = Out { said: out, released: Arc::default(), answered: Arc::default() };
    let started = Instant::now();
    let Ok(Some(first)) = inbound.message().await else { return };
    let settings = state.settings.get();
    let protocol = protocol::for_backend(&settings.config.backend);
    let Some(Asked::RequestHeaders(headers)) = &first.request else {
        // Envoy was told (a processing mode for this route, say) not to send the request's
        // head: nothing can be decided, so nothing goes on.
        let why = "Envoy sent no request head to decide on: its ext_proc processing mode must send request heads";
        refuse(&state, &settings, protocol, &Method::GET, "", &client, &Refusal::NotImplemented(why.into()), &out)
            .await;
        let _ = out.send(Said::Finished).await;
        return;
    };
    let head = match Head::read(headers) {
        Ok(head) => head,
        Err(refusal) => {
            refuse(&state, &settings, protocol, &Method::GET, "", &client, &refusal, &out).await;
            let _ = out.send(Said::Finished).await;
            return;
        }
    };
    let method = head.request.method().clone();
    let path = head.request.uri().path().to_owned();
    let log = &settings.config.log;
    let mut access = if log.access { Entry::start(&head.request, &client, log.access_format, started) } else { None };
    let ended = decide(&state, &settings, protocol, &client, head, inbound, &out, &mut access).await;
    let clean = ended.is_ok();
    // The line's outcome, what the client got where fencegate knows it, and the backend's
    // status where it answered.
    let (outcome, status, backend, body_bytes) = match ended {
        Ok(Ended::Forwarded(status)) => {
            state.metrics.request(&method, "forwarded");
            let status = http::StatusCode::from_u16(status).ok();
            if let Some(status) = status {
                state.metrics.backend_response(status);
            }
            ("forwarded", status, status, None)
        }
        // Envoy reports nothing more of an exchange it carries on unchecked.
        Ok(Ended::Passed) => {
            state.metrics.request(&method, "forwarded");
            ("passed", None, None, None)
        }
        // A write abandoned after it was let go: Envoy answers the client itself. Or one
        // fencegate answered already, in place of the backend's answer.
        Err(refusal) if matches!(refusal, Refusal::Upstream(_)) || out.answered.load(Ordering::Relaxed) => {
            crate::request::note_refusal(&state, &settings, &method, &path, &client, &refusal);
            let status = out.answered.load(Ordering::Relaxed).then(|| refusal.status());
            (refusal.code(), status, None, None)
        }
        Err(refusal) => {
            let body_bytes = refuse(&state, &settings, protocol, &method, &path, &client, &refusal, &out).await;
            (refusal.code(), Some(refusal.status()), None, body_bytes)
        }
    };
    if let Some(entry) = access {
        entry.log(outcome, status, backend, body_bytes);
    }
    state.metrics.request_latency.observe(started.elapsed().as_secs_f64());
    // Once the request was let go, only an exchange that ended cleanly says it finished; any
    // other end closes the stream with an error, and Envoy resets the backend's request.
    if clean || !out.released() {
        let _ = out.send(Said::Finished).await;
    }
}

/// Answers Envoy with fencegate's own refusal, in the protocol's form, in place of the backend's.
#[allow(clippy::too_many_arguments)]
async fn refuse(
    state: &State,
    settings: &Settings,
    protocol: Chosen,
    method: &Method,
    path: &str,
    client: &Peer,
    refusal: &Refusal,
    out: &Out,
) -> Option<u64> {
    let resp = crate::request::refused(state, settings, protocol, method, path, client, refusal);
    let body_bytes = hyper::body::Body::size_hint(resp.body()).exact();
    let answer = wire::immediate(resp, refusal.code()).await;
    let _ = out.send(Said::Answer(answer)).await;
    body_bytes
}

/// Carries out what the request's classification says, noting it in the request's access line.
#[allow(clippy::too_many_arguments)]
async fn decide(
    state: &Arc<State>,
    settings: &Arc<Settings>,
    protocol: Chosen,
    client: &Peer,
    head: Head,
    mut inbound: Streaming<ProcessingRequest>,
    out: &Out,
    access: &mut Option<Entry>,
) -> Result<Ended, Refusal> {
    let mut plan = protocol.classify(&head.classified(), &settings.config)?;
    let mut release = Release::Head;
    if let Plan::ReadBody { limit } = plan {
        // The request names its resources in its body: Envoy is asked for all of it in one
        // message, and holds the request until that message is answered.
        let body = match head.ends {
            true => Vec::new(),
            false => {
                release = Release::Body;
                out.release(wire::continue_head(Vec::new(), Some(wire::whole_body()))).await.map_err(|_| gone())?;
                whole_body(&mut inbound, limit).await?
            }
        };
        plan = protocol.classify_read(&head.classified(), &body, &settings.config)?;
    }
    if let Some(entry) = access.as_mut() {
        entry.plan(&plan);
    }
    let guess = Guess::of(&plan, &head.request, client, settings, state);
    if let Some(guess) = &guess {
        guess.admit(state)?;
    }
    let sent = head.request.uri().path_and_query().map_or("/", |pq| pq.as_str());
    let result = match plan {
        Plan::Pass { .. } => pass(release, Vec::new(), None, inbound, out).await,
        // Forwarded as the proxy forwards a write, at the target it would send, unchecked.
        Plan::Unchecked { target, body_limit } => {
            let limit = body_limit.map(|limit| (limit, protocol));
            pass(release, set_target(sent, target.as_str()), limit, inbound, out).await
        }
        Plan::ReadBody { .. } => Err(Refusal::BadRequest("the body was read already".into())),
        Plan::Write(write) => {
            let set = set_target(sent, write.target.as_str());
            let asked = RequestHead { head: head.request, ends: head.ends, client: client.clone() };
            fence(state, settings, protocol, asked, release, write, set, inbound, out).await
        }
    };
    if let (Some(guess), Err(refusal)) = (&guess, &result) {
        guess.count_refusal(state, refusal);
    }
    result
}

/// The `:path` to set, when what is forwarded is not what was sent.
fn set_target(sent: &str, target: &str) -> Vec<(String, Vec<u8>)> {
    if sent == target { Vec::new() } else { vec![(":path".to_owned(), target.as_bytes().to_vec())] }
}

/// Lets an unfenced request go from where Envoy holds it, asking for nothing more of it.
/// With `limit`, its body is counted as it goes, and one longer than that is cut off: Envoy
/// answers fencegate's refusal and resets the backend's request.
async fn pass(
    release: Release,
    set: Vec<(String, Vec<u8>)>,
    limit: Option<(u64, Chosen)>,
    inbound: Streaming<ProcessingRequest>,
    out: &Out,
) -> Result<Ended, Refusal> {
    let answer = match (release, limit) {
        (Release::Head, None) => wire::continue_head(set, Some(wire::nothing_more())),
        (Release::Head, Some(_)) => wire::continue_head(set, Some(wire::counted_body())),
        (Release::Body, _) => wire::continue_body(set),
    };
    if out.release(answer).await.is_ok() {
        pass_on(inbound, out, limit).await?;
    }
    Ok(Ended::Passed)
}

/// Where Envoy holds a request until fencegate answers: at its head, or (for one that names
/// its resources in its body) at its whole body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Release {
    Head,
    Body,
}

/// The whole body Envoy was asked for, at most `limit` bytes, in the one message a buffered
/// body comes in.
async fn whole_body(inbound: &mut Streaming<ProcessingRequest>, limit: usize) -> Result<Vec<u8>, Refusal> {
    let message = inbound.message().await.map_err(|e| failed(format!("Envoy's stream failed: {e}")))?;
    match message.and_then(|m| m.request) {
        Some(Asked::RequestBody(body)) if body.end_of_stream => match body.body.len() > limit {
            true => Err(Refusal::BodyTooLarge { limit: limit as u64 }),
            false => Ok(body.body),
        },
        Some(Asked::RequestBody(_)) => Err(Refusal::NotImplemented(
            "a request that names its resources in its body needs the whole body at once: set \
             allow_mode_override: true on Envoy's ext_proc filter"
                .into(),
        )),
        _ => Err(failed("Envoy's stream ended before the request's body came".into())),
    }
}

/// Answers whatever else Envoy sends with "go on", until it ends the stream; with `limit`,
/// cutting off a request body longer than that.
async fn pass_on(
    mut inbound: Streaming<ProcessingRequest>,
    out: &Out,
    limit: Option<(u64, Chosen)>,
) -> Result<(), Refusal> {
    let mut sent = 0u64;
    while let Ok(Some(message)) = inbound.message().await {
        if let (Some(Asked::RequestBody(body)), Some((limit, protocol))) = (&message.request, limit) {
            sent += body.body.len() as u64;
            if sent > limit {
                let _ = out.send(Said::Answer(too_late(protocol, &Refusal::BodyTooLarge { limit }).await)).await;
                return Err(UpstreamError::BodyTooLarge { limit }.into());
            }
        }
        let Some(answer) = wire::continue_any(&message) else { continue };
        if out.send(Said::Answer(answer)).await.is_err() {
            break;
        }
    }
    Ok(())
}

/// A fenced write: its checks before the turn, then the turn, in which the head is let go once
/// the advance is durable, and which is held until the backend answered the whole request.
#[allow(clippy::too_many_arguments)]
async fn fence(
    state: &Arc<State>,
    settings: &Arc<Settings>,
    protocol: Chosen,
    request: RequestHead,
    release: Release,
    write: Write,
    set: Vec<(String, Vec<u8>)>,
    inbound: Streaming<ProcessingRequest>,
    out: &Out,
) -> Result<Ended, Refusal> {
    match state.store.role() {
        Role::Fences => {}
        Role::Forward(url) => {
            return Err(StoreError::Unavailable(format!(
                "the shared fence is led by {url}, not by this instance; Envoy's external processor cluster must \
                 reach the leader"
            ))
            .into());
        }
        Role::Unavailable(why) => return Err(StoreError::Unavailable(why).into()),
    }
    let Write { token, touches, target, set_headers, body_limit, equal, max_jump, proof, locks, upload, pin } = write;
    let proven = prove(state, settings, token, proof, locks, &touches)?;
    let mut set = set;
    set.extend(set_headers.iter().map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec())));
    let answered = match upload.map(|step| *step) {
        None => None,
        // A part changes no object, only its upload, which the token was bound to.
        Some(UploadStep::Part { object, id }) => {
            state.fence.check_upload(&object, &id, token)?;
            state.fence.precheck(&touches, token, Policy { equal, max_jump, pinned: false })?;
            return pass(release, set, body_limit.map(|limit| (limit, protocol)), inbound, out).await;
        }
        Some(UploadStep::End { object, id }) => {
            state.fence.check_upload(&object, &id, token)?;
            Some(AnswerBody::Ends { object, id })
        }
        Some(UploadStep::Create { object }) => Some(AnswerBody::Binds { object }),
    };
    // A pinned PUT may pass the quarantine a pinned write's unknown outcome left.
    let policy = Policy { equal, max_jump, pinned: pin == Some(Pinned::Put) };
    state.fence.precheck(&touches, token, policy)?;
    let fence = &settings.config.fence;
    let (queue_timeout, quarantine) = (fence.queue_timeout, fence.quarantine);
    let waiting = Instant::now();
    // A write whose stream Envoy closed (its client left, its message timed out) stops waiting,
    // as a proxied write whose client left does: it never gets the turn, so its token is not
    // used up.
    let turn = tokio::select! {
        turn = state.fence.acquire(touches, queue_timeout) => turn,
        () = out.closed() => return Err(gone()),
    };
    state.metrics.queue_wait.observe(waiting.elapsed().as_secs_f64());
    let mut turn = turn?;
    let slot = pin.and_then(|kind| turn.pin_slot().map(|slot| (slot, kind)));
    let ends = request.ends;
    let held = Held {
        state: Arc::clone(state),
        settings: Arc::clone(settings),
        protocol,
        token,
        release,
        answered,
        set,
        ends,
        body_limit,
        timeout: settings.config.backend.request_timeout,
        inbound,
        out: out.clone(),
        pinning: None,
    };
    let watcher = Arc::clone(state);
    let prepare = move |permit: Option<Permit>| async move {
        let mut held = held;
        // The proof's authoritative look, once the turn has come.
        let state = &held.state;
        proven.check(proven.first.as_slice(), &state.settings.get().hmac, &state.locks.load())?;
        // Before the advance: a write whose stream closed does not use its token up.
        if held.out.is_closed() {
            return Err(gone());
        }
        // The key's state learnt and named in the request, still before the advance.
        if let Some((slot, kind)) = slot {
            held.pin(slot, kind, &request, &target).await?;
            // Its HEAD may take a while: a stream that closed meanwhile uses no token up either.
            if held.out.is_closed() {
                return Err(gone());
            }
        }
        // Envoy sends what is let go: the window between the last check and the send spans its
        // hop too, and a write that ends after the permit lapsed says so.
        Ok::<_, Refusal>(async move {
            let watched = permit.map(Watched::new);
            let answered = held.let_go(watched.as_ref().map(Watched::permit)).await;
            if let Some(watched) = watched {
                let status_of = |(status, _): &Answered| http::StatusCode::from_u16(*status).ok();
                watched.ended(&watcher.metrics, target.path(), token, &answered, status_of);
            }
            answered
        })
    };
    let (status, inbound) = turn.finish_after(token, policy, quarantine, prepare, outcome).await?;
    pass_on(inbound, out, None).await?;
    Ok(Ended::Forwarded(status))
}

/// What a write's turn holds once it is the write's.
struct Held {
    state: Arc<State>,
    settings: Arc<Settings>,
    protocol: Chosen,
    token: u64,
    /// Where Envoy holds the request.
    release: Release,
    /// What the backend's answer body is read for, when the write needs it.
    answered: Option<AnswerBody>,
    /// Headers set on the request's head as it goes on.
    set: Vec<(String, Vec<u8>)>,
    /// Whether the request ends with its head.
    ends: bool,
    body_limit: Option<u64>,
    /// How long the backend has to answer once the head is let go.
    timeout: Duration,
    inbound: Streaming<ProcessingRequest>,
    out: Out,
    /// How the write is pinned to its key's state at the backend, once it is.
    pinning: Option<Pinning>,
}

/// A fenced write's request as Envoy sent its head, for the `HEAD` that learns its key's state.
struct RequestHead {
    head: http::Request<()>,
    /// Whether the request ends with its head.
    ends: bool,
    client: Peer,
}

/// What a write of a multipart upload reads in the backend's answer body, under its turn, as
/// the proxy does: S3 names a created upload's id there, and a completion's result.
enum AnswerBody {
    /// The upload of `object` the answer creates is bound to the write's token before the
    /// client hears of it.
    Binds { object: String },
    /// Upload `id` of `object` ended, unless the answer says it failed late: its binding is
    /// dropped.
    Ends { object: String, id: String },
}

/// The backend's answer to a write: its status, and the stream, for what Envoy still sends.
type Answered = (u16, Streaming<ProcessingRequest>);

impl Held {
    /// Under the turn, before the advance: the pin of the write's one key (learnt by a `HEAD`
    /// to `backend.url` when the fence knows none, as the proxy learns it), the client's own
    /// preconditions judged against it, and the precondition naming it set on the head.
    async fn pin(
        &mut self,
        slot: PinSlot,
        kind: Pinned,
        request: &RequestHead,
        target: &PathAndQuery,
    ) -> Result<(), Refusal> {
        let (settings, protocol) = (&self.settings, self.protocol);
        let headers = request.head.headers();
        let asked = HeadFrom { uri: request.head.uri(), target, headers, client: &request.client };
        let (pinning, precondition) =
            pinned::choose(&self.state.metrics, protocol, &asked, slot, kind, async |key: &str| {
                let conn = settings.upstream.connection().await?;
                pinned::learn(settings, protocol, conn, &asked, key).await
            })
            .await?;
        if let Some((name, value)) = precondition {
            self.set.push((name.as_str().to_owned(), value.as_bytes().to_vec()));
        }
        self.pinning = Some(pinning);
        Ok(())
    }

    /// Lets the head go, then each body chunk while `permit` holds, until the request has been
    /// let go whole and Envoy reports the backend's answer.
    async fn let_go(self, permit: Option<Permit>) -> Result<Answered, Refusal> {
        let Held {
            state,
            settings,
            protocol,
            token,
            release,
            mut answered,
            set,
            ends,
            body_limit,
            timeout,
            mut inbound,
            out,
            mut pinning,
        } = self;
        let _flying = InFlight::new(&state.metrics);
        // The self-fence before the head, as the proxy checks it. Nothing has been let go: the
        // refusal is fencegate's own immediate answer, and Envoy sends the backend nothing (an
        // upstream failure here would end the stream cleanly, which lets Envoy forward the rest
        // unchecked).
        if !upstream::head_may_go(permit.as_ref()) {
            let why = "the permission to send this write lapsed before it was sent".to_owned();
            return Err(Refusal::Store(StoreError::Unavailable(why)));
        }
        // The head goes with the mode the turn relies on (each chunk held, the answer's head
        // reported), whatever Envoy's filter says for this route.
        let let_go = match release {
            Release::Head => wire::continue_head(set, Some(wire::write_mode())),
            Release::Body => wire::continue_body(set),
        };
        out.release(let_go).await.map_err(|_| gone())?;
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + timeout;
        // Once the head is let go, an answer that cannot be given leaves the outcome unknown.
        let say = |answer: ProcessingResponse| {
            let out = &out;
            async move {
                match tokio::time::timeout_at(deadline, out.send(Said::Answer(answer))).await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(_)) => Err(failed("Envoy's stream ended while the write was at the backend".to_owned())),
                    Err(_) => Err(Refusal::from(UpstreamError::Timeout(timeout))),
                }
            }
        };
        let (mut whole, mut answer, mut sent) = (ends || release == Release::Body, None, 0u64);
        // Whether the backend answered before the request had been let go whole, and whether
        // that answer was its refusal.
        let (mut early, mut refused_early) = (false, false);
        // Set while the answer's body is awaited (a multipart upload's), with what it is for.
        let mut reading: Option<AnswerBody> = None;
        // A pinned write whose answer's status came, settled once its body names the tag.
        let mut settling: Option<(Pinning, http::StatusCode)> = None;
        loop {
            let message = match tokio::time::timeout_at(deadline, inbound.message()).await {
                Err(_) => return Err(UpstreamError::Timeout(timeout).into()),
                // Refused by the backend: the rest, never let go, reaches it no more.
                Ok(Err(_) | Ok(None)) if refused_early => break,
                Ok(Err(status)) => return Err(failed(format!("Envoy's stream failed: {status}"))),
                Ok(Ok(None)) => {
                    return Err(failed(
                        "Envoy's stream ended before the backend answered the whole request".to_owned(),
                    ));
                }
                Ok(Ok(Some(message))) => message,
            };
            match &message.request {
                Some(Asked::RequestBody(body)) => {
                    sent += body.body.len() as u64;
                    if let Some(limit) = body_limit.filter(|&limit| sent > limit) {
                        let refusal = Refusal::BodyTooLarge { limit };
                        let _ = out.send(Said::Answer(too_late(protocol, &refusal).await)).await;
                        return Err(UpstreamError::BodyTooLarge { limit }.into());
                    }
                    // The self-fence: a leader whose lease lapsed lets no more of the write go.
                    if permit.as_ref().is_some_and(upstream::lapsed) {
                        let why = "the shared fence's lease lapsed while the write was being sent".to_owned();
                        let _ = out
                            .send(Said::Answer(
                                too_late(protocol, &Refusal::Store(StoreError::Unavailable(why.clone()))).await,
                            ))
                            .await;
                        return Err(failed(why));
                    }
                    whole |= body.end_of_stream;
                }
                Some(Asked::RequestTrailers(_)) => whole = true,
                Some(Asked::ResponseHeaders(headers)) => {
                    let (status, details) = wire::answer_of(headers, &message);
                    let backend = by_backend(status, details.as_deref());
                    // A backend that refused the request (4xx) before it had all of it (an S3
                    // server refusing a precondition or a signature by the head) applied
                    // nothing: its refusal is the answer, as through the proxy. The turn is
                    // still held until the request's end has been let go, or its stream ends
                    // (what was not let go never reaches the backend). Only a refusal Envoy
                    // says is the backend's counts: Envoy's own answers mid-body (a codec
                    // error) look like the backend's without `response.code_details`. Any other
                    // answer before the request's end: Envoy resets the backend's request,
                    // which may hold part of it, however the stream goes on.
                    refused_early =
                        !whole && details.as_deref() == Some("via_upstream") && (400..500).contains(&status);
                    early |= !whole && !refused_early;
                    state.metrics.backend_latency.observe(started.elapsed().as_secs_f64());
                    // Only a success names the upload or ends it.
                    reading = answered.take().filter(|_| (200..300).contains(&status));
                    // The backend's own answer to the whole request settles a pinned write: a
                    // completion's entity tag is in its body, the others' in the head.
                    if let Some(pin) = pinning.take_if(|_| (whole || refused_early) && backend)
                        && let Ok(code) = http::StatusCode::from_u16(status)
                    {
                        match reading {
                            Some(AnswerBody::Ends { .. }) => settling = Some((pin, code)),
                            _ => match pinned::settle(pin, code, wire::strong_tag(headers)) {
                                Err(refusal) if !whole => {
                                    return Err(moved_early(refusal, protocol, &out, &mut inbound, deadline).await);
                                }
                                settled => settled?,
                            },
                        }
                    }
                    // An answer without a body (an abort's `204`) is read whole now: no body
                    // message will come.
                    if headers.end_of_stream
                        && let Some(read) = reading.take()
                    {
                        let tag =
                            by_deadline(deadline, timeout, read.read(&state, &settings, protocol, token, &[])).await?;
                        if let Some((pin, status)) = settling.take() {
                            pinned::settle(pin, status, tag)?;
                        }
                    }
                    answer = Some((status, details));
                    let mode = reading.is_some().then(wire::answer_body);
                    say(wire::continue_answer(ERROR_HEADER, mode)).await?;
                    if whole && reading.is_none() {
                        break;
                    }
                    continue;
                }
                Some(Asked::ResponseBody(body)) if reading.is_some() => {
                    if !body.end_of_stream {
                        return Err(failed(
                            "Envoy streamed the answer to a multipart upload's write: set allow_mode_override: true \
                             on its ext_proc filter"
                                .to_owned(),
                        ));
                    }
                    if let Some(read) = reading.take() {
                        let read = read.read(&state, &settings, protocol, token, &body.body);
                        let tag = by_deadline(deadline, timeout, read).await?;
                        if let Some((pin, status)) = settling.take() {
                            pinned::settle(pin, status, tag)?;
                        }
                    }
                }
                Some(Asked::RequestHeaders(_)) => return Err(failed("Envoy sent a second request head".to_owned())),
                Some(Asked::ResponseBody(_) | Asked::ResponseTrailers(_)) | None => {}
            }
            if let Some(answer) = wire::continue_any(&message) {
                say(answer).await?;
            }
            if whole && answer.is_some() && reading.is_none() {
                break;
            }
        }
        let Some((status, details)) = answer else { unreachable!("the loop ends only with an answer") };
        if early {
            return Err(failed(format!("the backend answered {status} before it had the whole request")));
        }
        if by_backend(status, details.as_deref()) {
            return Ok((status, inbound));
        }
        Err(failed(match details {
            Some(details) => format!("Envoy answered {status} itself ({details})"),
            None => format!(
                "Envoy answered {status}, and did not say whether the backend did (response_attributes lacks {})",
                wire::CODE_DETAILS
            ),
        }))
    }
}

/// fencegate's `refusal` (`backend_moved`) of a pinned write the backend refused by its
/// precondition before the request's end, answered at once in place of the backend's `412`
/// (a slow body would otherwise meet Envoy's `message_timeout`). Envoy lets nothing more of the
/// request go after that answer, and ends the stream: the turn is held until it has, or until
/// `deadline`. Returns the refusal, answered already where the answer could be sent (see
/// [`Out::answered`]).
async fn moved_early(
    refusal: Refusal,
    protocol: Chosen,
    out: &Out,
    inbound: &mut Streaming<ProcessingRequest>,
    deadline: tokio::time::Instant,
) -> Refusal {
    let answer = too_late(protocol, &refusal).await;
    if let Ok(Ok(())) = tokio::time::timeout_at(deadline, out.send(Said::Answer(answer))).await {
        out.answered.store(true, Ordering::Relaxed);
        // Nothing Envoy still sends is answered: no more of the request goes on.
        while let Ok(Ok(Some(_))) = tokio::time::timeout_at(deadline, inbound.message()).await {}
    }
    refusal
}

/// `read` by `deadline`, the write's own (`backend.request_timeout`, `timeout`, from its
/// release): a binding the store cannot make by then leaves the outcome unknown.
async fn by_deadline<T>(
    deadline: tokio::time::Instant,
    timeout: Duration,
    read: impl Future<Output = Result<T, Refusal>>,
) -> Result<T, Refusal> {
    tokio::time::timeout_at(deadline, read).await.unwrap_or(Err(UpstreamError::Timeout(timeout).into()))
}

impl AnswerBody {
    /// Reads the backend's whole answer `body` to a multipart upload's write, under its turn;
    /// for a completion, the entity tag the body names for the completed object.
    async fn read(
        self,
        state: &State,
        settings: &Settings,
        protocol: Chosen,
        token: u64,
        body: &[u8],
    ) -> Result<Option<Arc<str>>, Refusal> {
        match self {
            AnswerBody::Binds { object } => {
                bind_created(state, settings, protocol, &object, token, body).await.map(|()| None)
            }
            AnswerBody::Ends { object, id } => Ok(drop_ended(state, protocol, &object, &id, body).await),
        }
    }
}

/// Whether an answer of `status` with `details` (`response.code_details`) is the backend's
/// own. Without the attribute, Envoy's answers to a failed or late backend look like the
/// backend's: those statuses are taken for Envoy's.
fn by_backend(status: u16, details: Option<&str>) -> bool {
    match details {
        Some(details) => details == "via_upstream",
        None => !matches!(status, 502..=504),
    }
}

fn gone() -> Refusal {
    UpstreamError::Unreachable(GONE.into()).into()
}

fn failed(why: String) -> Refusal {
    UpstreamError::Failed(why).into()
}

/// fencegate's own answer to a write cut off after its head was let go: Envoy resets the
/// backend's request and answers the client with this.
async fn too_late(protocol: Chosen, refusal: &Refusal) -> ProcessingResponse {
    wire::immediate(protocol.refuse(refusal, false), refusal.code()).await
}
