//! A follower's fenced writes, sent on to the instance that leads the shared fence (the etcd
//! store): as a plain reverse proxy would, with the body streamed, and with a header naming
//! this instance. The leader fences the write and forwards it to the backend; its answer, a
//! refusal included, comes back unchanged. A write that arrives with the header at an
//! instance that does not lead is refused rather than sent on again, so a write never travels
//! twice and two instances that each think the other leads cannot bounce it between them.
//!
//! The header is believed only with a proof beside it: an HMAC-SHA256, under the fence's key
//! in etcd (`P/secret`, which only the fence's instances read), of the time, the sending
//! instance, the method and the target. Without one, the header is a client's claim: the
//! leader takes the write as the client's own (its address, not one the client named, is the
//! one refused proofs are counted against), and a follower sends it on as any other.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::hmac;

use bytes::Bytes;
use http::header::HeaderName;
use http::{HeaderValue, Request, Response, Uri};
use http_body_util::BodyExt;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::{HeaderPolicy, Peer, RequestBody, ResponseBody, UpstreamError, strip_hop_by_hop};

/// Names the instance that sent a write on to the leader (its advertised URL).
pub static FORWARDED_BY: HeaderName = HeaderName::from_static("fencegate-forwarded-by");

/// The proof that [`FORWARDED_BY`] was set by an instance of the fence: `<unix seconds>.<MAC>`.
pub static FORWARDED_PROOF: HeaderName = HeaderName::from_static("fencegate-forwarded-proof");

/// How far a proof's time may be from the receiver's clock: the way between instances, and
/// their clocks' difference.
const PROOF_WINDOW: u64 = 60;

/// The client a follower sends writes to the leader with.
#[derive(Debug, Clone)]
pub(crate) struct Peers {
    /// `http://` and `https://` leaders alike.
    http: Client<HttpsConnector<HttpConnector>, RequestBody>,
    /// This instance's advertised URL, for [`FORWARDED_BY`].
    me: HeaderValue,
}

impl Peers {
    /// A client for an instance that advertises `me`, checking an `https://` leader's
    /// certificate against `ca` (the system's roots without one) and showing it `identity`
    /// (a certificate and its key), which a leader whose listener asks clients for one takes.
    pub(crate) fn new(
        me: &str,
        connect_timeout: Duration,
        ca: Option<&Path>,
        identity: Option<(&Path, &Path)>,
    ) -> Result<Peers, String> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        // The TLS layer takes the https:// URLs the plain connector would refuse.
        connector.enforce_http(false);
        let (cert, key) = identity.unzip();
        let tls = crate::tls::client_config(ca, cert, key).map_err(|e| format!("store.peer_ca: {e}"))?;
        let connector =
            HttpsConnectorBuilder::new().with_tls_config(tls).https_or_http().enable_http1().wrap_connector(connector);
        Ok(Peers {
            http: Client::builder(TokioExecutor::new()).build(connector),
            me: HeaderValue::from_str(me).unwrap_or_else(|_| HeaderValue::from_static("unknown")),
        })
    }

    /// Sends `req` to the leader at `leader` and relays its answer; gives up on the answer's
    /// head after `timeout`.
    pub(crate) async fn forward(
        &self,
        leader: &str,
        mut req: Request<RequestBody>,
        client: &Peer,
        policy: &HeaderPolicy,
        timeout: Duration,
        secret: Option<&[u8]>,
    ) -> Result<Response<ResponseBody>, UpstreamError> {
        let unavailable = UpstreamError::NoLeader;
        let target = req.uri().path_and_query().map_or("/", |p| p.as_str());
        // What the leader verifies the proof against: the target and method it receives.
        let proof =
            secret.and_then(|s| HeaderValue::from_str(&prove(s, unix_now(), &self.me, req.method(), target)).ok());
        let uri: Uri = format!("{leader}{target}")
            .parse()
            .map_err(|e| unavailable(format!("the leader's URL {leader:?} cannot take this path: {e}")))?;
        let host = req.uri().authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok());
        *req.uri_mut() = uri;
        let headers = req.headers_mut();
        strip_hop_by_hop(headers);
        // The leader fences what the client named: the same Host (an absolute-form target's
        // authority, else the client's Host header).
        if let Some(host) = host {
            headers.insert(http::header::HOST, host);
        }
        let client_host = headers.get(http::header::HOST).cloned();
        headers.insert(FORWARDED_BY.clone(), self.me.clone());
        match proof {
            Some(proof) => headers.insert(FORWARDED_PROOF.clone(), proof),
            None => headers.remove(&FORWARDED_PROOF),
        };
        // The leader learns the client's address from the last entry; the backend learns it
        // as it would from the leader itself.
        policy.to_leader(headers, client, client_host.as_ref());
        *req.version_mut() = http::Version::HTTP_11;
        // Once the write may have reached the leader, which runs it to its end on its own, its
        // outcome is unknown: a gateway error, not "not forwarded".
        let resp = match tokio::time::timeout(timeout, self.http.request(req)).await {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) if e.is_connect() => {
                return Err(unavailable(format!("the leader at {leader} cannot be reached: {e}")));
            }
            Ok(Err(e)) => {
                return Err(UpstreamError::Failed(format!("the leader at {leader} failed: {e}")));
            }
            Err(_) => return Err(UpstreamError::Timeout(timeout)),
        };
        let (mut parts, body) = resp.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        Ok(Response::from_parts(parts, body.map_frame(|f: hyper::body::Frame<Bytes>| f).boxed()))
    }
}

/// Whether the leader at `leader` (its advertised URL) takes a connection within `timeout`:
/// a follower that cannot reach it refuses every fenced write it is sent.
pub(crate) async fn reachable(leader: &str, timeout: Duration) -> Result<(), String> {
    let uri: Uri = leader.parse().map_err(|e| format!("the leader's URL {leader:?} is not a URL: {e}"))?;
    match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(super::backend_addr(&uri))).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("leader unreachable: connecting to {leader} failed: {e}; fenced writes are refused")),
        Err(_) => Err(format!(
            "leader unreachable: no connection to {leader} within {timeout:?} (backend.connect_timeout); fenced \
            writes are refused"
        )),
    }
}

/// The client a follower named when it sent this write on: the last `X-Forwarded-For` entry,
/// which it appended; `None` if there is none that is an address.
pub(crate) fn sent_on_for(headers: &http::HeaderMap) -> Option<std::net::IpAddr> {
    let last = headers.get_all(http::header::HeaderName::from_static("x-forwarded-for")).iter().next_back()?;
    last.to_str().ok()?.rsplit(',').next()?.trim().parse().ok()
}

/// Whether an instance of the fence whose key is `secret` sent this write on: it names one
/// ([`FORWARDED_BY`]) and proves it ([`FORWARDED_PROOF`]).
pub(crate) fn forwarded<B>(req: &Request<B>, secret: Option<&[u8]>) -> bool {
    let headers = req.headers();
    let (Some(secret), Some(by), Some(proof)) = (secret, headers.get(&FORWARDED_BY), headers.get(&FORWARDED_PROOF))
    else {
        return false;
    };
    let Some((at, mac)) = proof.to_str().ok().and_then(|p| p.split_once('.')) else { return false };
    let (Ok(at), Ok(mac)) = (at.parse::<u64>(), URL_SAFE_NO_PAD.decode(mac)) else { return false };
    if unix_now().abs_diff(at) > PROOF_WINDOW {
        return false;
    }
    let target = req.uri().path_and_query().map_or("/", |p| p.as_str());
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    hmac::verify(&key, &proven(at, by, req.method(), target), &mac).is_ok()
}

/// What a proof's MAC covers.
fn proven(at: u64, by: &HeaderValue, method: &http::Method, target: &str) -> Vec<u8> {
    let mut text = format!("{at}\n").into_bytes();
    text.extend_from_slice(by.as_bytes());
    text.extend_from_slice(format!("\n{method}\n{target}").as_bytes());
    text
}

/// The value of [`FORWARDED_PROOF`] for a write of `method` to `target` sent on by `by`.
fn prove(secret: &[u8], at: u64, by: &HeaderValue, method: &http::Method, target: &str) -> String {
    let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
    let mac = hmac::sign(&key, &proven(at, by, method, target));
    format!("{at}.{}", URL_SAFE_NO_PAD.encode(mac.as_ref()))
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(headers: &[(&HeaderName, &str)], target: &str) -> Request<()> {
        let mut req = Request::builder().method("PUT").uri(target).body(()).unwrap();
        for (name, value) in headers {
            req.headers_mut().insert((*name).clone(), HeaderValue::from_str(value).unwrap());
        }
        req
    }

    #[test]
    fn only_a_proof_under_the_fences_key_makes_a_write_forwarded() {
        let (secret, me) = (b"the fence's key".as_slice(), HeaderValue::from_static("http://10.0.0.5:8080"));
        let put = http::Method::PUT;
        let proof = prove(secret, unix_now(), &me, &put, "/a?x=1");
        let by = (&FORWARDED_BY, "http://10.0.0.5:8080");
        assert!(forwarded(&sent(&[by, (&FORWARDED_PROOF, &proof)], "/a?x=1"), Some(secret)));
        assert!(!forwarded(&sent(&[by], "/a?x=1"), Some(secret)), "a claim without a proof");
        assert!(!forwarded(&sent(&[by, (&FORWARDED_PROOF, &proof)], "/b"), Some(secret)), "another target");
        assert!(!forwarded(&sent(&[by, (&FORWARDED_PROOF, &proof)], "/a?x=1"), Some(b"another key")));
        assert!(!forwarded(&sent(&[by, (&FORWARDED_PROOF, &proof)], "/a?x=1"), None));
        let other = (&FORWARDED_BY, "http://10.0.0.6:8080");
        assert!(!forwarded(&sent(&[other, (&FORWARDED_PROOF, &proof)], "/a?x=1"), Some(secret)), "another sender");
        let old = prove(secret, unix_now() - 2 * PROOF_WINDOW, &me, &put, "/a?x=1");
        assert!(!forwarded(&sent(&[by, (&FORWARDED_PROOF, &old)], "/a?x=1"), Some(secret)), "too old");
        assert!(!forwarded(&sent(&[by, (&FORWARDED_PROOF, "12.abc")], "/a?x=1"), Some(secret)));
    }
}
