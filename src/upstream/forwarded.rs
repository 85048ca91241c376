//! What fencegate adds to and takes from the headers it forwards (`[headers]`): the forwarded
//! headers that tell the backend who the client is and how it came, believed from trusted
//! proxies only; the operator's rules; and, on the way back, redirects that name the backend
//! rewritten to the client-facing origin ([`super::location`]).

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

use super::headers::{Peer, remove_held};
use super::location::{self, Origin};
use crate::config::{BackendUrl, Forwarding, HeaderRules, HeadersConfig};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// `[headers]`, ready for each request: what the listener's scheme and the backend's origin
/// are, worked out once.
#[derive(Debug, Clone)]
pub(crate) struct HeaderPolicy {
    config: HeadersConfig,
    /// `http` or `https`: how clients reach fencegate.
    proto: HeaderValue,
    /// The backend's origin, whose redirects are rewritten; `None` when that is off.
    backend: Option<Origin>,
    /// Whether a forwarded header the client named in a SigV4 signature is left as sent (for
    /// a backend that checks such signatures: S3).
    keeps_signed: bool,
}

impl HeaderPolicy {
    /// The policy of `config`, for a listener speaking TLS or not, in front of `backend_url`.
    pub(crate) fn new(config: &HeadersConfig, tls: bool, backend_url: &BackendUrl, keeps_signed: bool) -> HeaderPolicy {
        let proto = HeaderValue::from_static(if tls { "https" } else { "http" });
        // A backend on a Unix socket has no origin of its own for its redirects to name.
        let backend = match backend_url {
            BackendUrl::Http(url) if config.rewrite_location => Origin::of(url),
            _ => None,
        };
        HeaderPolicy { config: config.clone(), proto, backend, keeps_signed }
    }

    /// Whether the client's own forwarded headers are believed: it is a trusted proxy.
    fn trusts(&self, client: &Peer) -> bool {
        let nets = &self.config.trusted_proxies;
        !nets.is_empty() && client.ip().is_some_and(|ip| nets.iter().any(|net| net.contains(&canonical(ip))))
    }

    /// Sets the forwarded headers of the request to the backend from `client`, which named
    /// `client_host` (its `Host`, none if it sent none), then applies the request rules.
    pub(crate) fn on_request(&self, headers: &mut HeaderMap, client: &Peer, client_host: Option<&HeaderValue>) {
        self.set_forwarded(headers, client, client_host, self.config.x_forwarded_for);
        apply(&self.config.request, headers);
    }

    /// The forwarded headers of a write a follower sends on to the leader of a shared fence:
    /// this hop added as for the backend, so that a leader that trusts its followers believes
    /// only what this instance vouches for, never what an untrusted client claimed; and
    /// `X-Forwarded-For` appended whatever `x_forwarded_for` says, since the leader reads the
    /// client's address from its last entry.
    pub(crate) fn to_leader(&self, headers: &mut HeaderMap, client: &Peer, client_host: Option<&HeaderValue>) {
        self.set_forwarded(headers, client, client_host, Forwarding::Append);
    }

    fn set_forwarded(
        &self,
        headers: &mut HeaderMap,
        client: &Peer,
        client_host: Option<&HeaderValue>,
        x_forwarded_for: Forwarding,
    ) {
        let c = &self.config;
        let trusted = self.trusts(client);
        // Where the backend checks SigV4 signatures (S3), a header the client signed reaches it
        // as sent: any change would break the signature. Nowhere else: a client could then
        // forge any of them by naming it in an Authorization header.
        let signed = match self.keeps_signed {
            true => signed_headers(headers),
            false => Vec::new(),
        };
        let signed = |name: &HeaderName| signed.iter().any(|s| s == name.as_str());
        // Off adds nothing, and passes only a trusted proxy's claim: anyone else's is dropped,
        // so that a client cannot forge one through fencegate.
        let off = |headers: &mut HeaderMap, name: &HeaderName| {
            if !trusted && !signed(name) {
                remove_held(headers, name);
            }
        };
        match x_forwarded_for {
            _ if signed(&X_FORWARDED_FOR) => {}
            Forwarding::Off => off(headers, &X_FORWARDED_FOR),
            mode => set_forwarded_for(headers, client, mode == Forwarding::Append && trusted),
        }
        // One value, the first hop's: a trusted proxy's is kept, anyone else's replaced (or
        // dropped, where there is no value of this hop to give).
        let first_hops = [
            (&X_FORWARDED_PROTO, c.x_forwarded_proto, Some(&self.proto)),
            (&X_FORWARDED_HOST, c.x_forwarded_host, client_host),
        ];
        for (name, mode, ours) in first_hops {
            match mode {
                _ if signed(name) => {}
                Forwarding::Off => off(headers, name),
                Forwarding::Append if trusted && headers.contains_key(name) => {}
                _ => match ours {
                    Some(value) => {
                        headers.insert(name.clone(), value.clone());
                    }
                    None => remove_held(headers, name),
                },
            }
        }
        match c.forwarded {
            _ if signed(&header::FORWARDED) => {}
            Forwarding::Off => off(headers, &header::FORWARDED),
            mode => {
                let element = self.forwarded_element(client, client_host);
                let joined = match (mode == Forwarding::Append && trusted, headers.get(header::FORWARDED)) {
                    (true, Some(sent)) => [sent.as_bytes(), b", ", element.as_bytes()].concat(),
                    _ => element.into_bytes(),
                };
                if let Ok(value) = HeaderValue::from_bytes(&joined) {
                    headers.insert(header::FORWARDED, value);
                }
            }
        }
    }

    /// This hop's RFC 7239 element: `for`, `proto` and `host`, quoted where the syntax asks.
    fn forwarded_element(&self, client: &Peer, host: Option<&HeaderValue>) -> String {
        let node = match client.ip() {
            Some(IpAddr::V4(ip)) => ip.to_string(),
            Some(IpAddr::V6(ip)) => format!("\"[{ip}]\""),
            None => "unknown".to_owned(),
        };
        let proto = self.proto.to_str().unwrap_or("http");
        let mut element = format!("for={node};proto={proto}");
        if let Some(host) = host.and_then(|h| h.to_str().ok()) {
            element.push_str(";host=");
            element.push_str(&quoted(host));
        }
        element
    }

    /// Rewrites the backend's redirects for the client that named `client_host`, then applies
    /// the response rules.
    pub(crate) fn on_response(&self, headers: &mut HeaderMap, client_host: Option<&HeaderValue>) {
        if let Some(backend) = &self.backend {
            location::rewrite(headers, backend, self.proto.to_str().unwrap_or("http"), client_host);
        }
        apply(&self.config.response, headers);
    }

    /// Whether the host the client named is read: to rewrite redirects, or to forward it.
    pub(crate) fn reads_client_host(&self) -> bool {
        self.backend.is_some()
            || self.config.x_forwarded_host != Forwarding::Off
            || self.config.forwarded != Forwarding::Off
    }
}

/// `X-Forwarded-For` for a request from `client`: appended to what it sent if `append` (a
/// trusted proxy's), else this hop alone (none for a Unix socket's peer, which has no
/// address).
fn set_forwarded_for(headers: &mut HeaderMap, client: &Peer, append: bool) {
    match (client.ip(), append) {
        (Some(_), true) => super::headers::append_forwarded_for(headers, client),
        (Some(_), false) => {
            headers.insert(X_FORWARDED_FOR.clone(), client.ip_value().clone());
        }
        (None, true) => {}
        (None, false) => remove_held(headers, &X_FORWARDED_FOR),
    }
}

/// An IPv4 address a dual-stack socket reports as IPv4-mapped IPv6, as IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

/// `value` as an RFC 7239 token, or quoted where it is not one (a `host:port`).
fn quoted(value: &str) -> String {
    let token =
        !value.is_empty() && value.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    match token {
        true => value.to_owned(),
        false => format!("\"{}\"", value.replace('\\', "\\\\").replace('"', "\\\"")),
    }
}

/// `rules` applied to `headers`: remove, then set, then add.
fn apply(rules: &HeaderRules, headers: &mut HeaderMap) {
    if rules.is_empty() {
        return;
    }
    for name in &rules.remove {
        headers.remove(name);
    }
    for (name, value) in &rules.set {
        headers.insert(name.clone(), value.clone());
    }
    for (name, value) in &rules.add {
        headers.append(name.clone(), value.clone());
    }
}

/// The header names an AWS SigV4 `Authorization` header says it signed (`SignedHeaders=a;b`),
/// lowercase; none for any other request.
fn signed_headers(headers: &HeaderMap) -> Vec<String> {
    let Some(auth) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else { return Vec::new() };
    if !auth.starts_with("AWS4-") {
        return Vec::new();
    }
    auth.split(',')
        .filter_map(|part| part.trim().strip_prefix("SignedHeaders="))
        .flat_map(|list| list.split(';'))
        .map(|name| name.trim().to_ascii_lowercase())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(tweak: impl FnOnce(&mut HeadersConfig)) -> HeaderPolicy {
        let mut config = HeadersConfig::default();
        tweak(&mut config);
        let url = BackendUrl::Http("http://127.0.0.1:9000".parse().unwrap());
        HeaderPolicy::new(&config, false, &url, false)
    }

    fn name(text: &str) -> HeaderName {
        HeaderName::from_bytes(text.as_bytes()).unwrap()
    }

    #[test]
    fn a_header_the_client_signed_is_left_as_sent_in_s3_mode_only() {
        let url = BackendUrl::Http("http://127.0.0.1:9000".parse().unwrap());
        let s3 = HeaderPolicy::new(&HeadersConfig::default(), false, &url, true);
        let signed = |map: &mut HeaderMap| {
            map.insert(
                header::AUTHORIZATION,
                HeaderValue::from_static(
                    "AWS4-HMAC-SHA256 Credential=AK/20260101/us-east-1/s3/aws4_request, \
                     SignedHeaders=host;x-amz-date;x-forwarded-for, Signature=00",
                ),
            );
            map.insert(X_FORWARDED_FOR.clone(), HeaderValue::from_static("10.0.0.1"));
        };
        let peer = Peer::new("192.0.2.7:1".parse().unwrap());
        let mut map = HeaderMap::new();
        signed(&mut map);
        s3.on_request(&mut map, &peer, None);
        assert_eq!(map.get(&X_FORWARDED_FOR).unwrap(), "10.0.0.1", "signed: untouched");
        map.remove(header::AUTHORIZATION);
        s3.on_request(&mut map, &peer, None);
        assert_eq!(map.get(&X_FORWARDED_FOR).unwrap(), "192.0.2.7", "unsigned: this hop");
        let mut map = HeaderMap::new();
        signed(&mut map);
        policy(|_| {}).on_request(&mut map, &peer, None);
        assert_eq!(map.get(&X_FORWARDED_FOR).unwrap(), "192.0.2.7", "in HTTP mode a signature is no licence");
    }

    #[test]
    fn off_drops_an_untrusted_peers_claim_and_passes_a_trusted_ones() {
        let off = policy(|c| c.trusted_proxies = vec!["10.0.0.0/8".parse().unwrap()]);
        let claims = [("x-forwarded-host", "bank.example"), ("forwarded", "for=6.6.6.6")];
        let from_client = sent(&off, "192.0.2.7:5000", &claims);
        assert!(from_client.get("x-forwarded-host").is_none() && from_client.get("forwarded").is_none());
        let from_proxy = sent(&off, "10.0.0.7:5000", &claims);
        assert_eq!(all(&from_proxy, "x-forwarded-host"), ["bank.example"]);
        assert_eq!(all(&from_proxy, "forwarded"), ["for=6.6.6.6"]);
    }

    fn pair(k: &str, v: &'static str) -> (HeaderName, HeaderValue) {
        (name(k), HeaderValue::from_static(v))
    }

    fn sent(policy: &HeaderPolicy, peer: &str, headers: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        map.insert(header::HOST, HeaderValue::from_static("proxy.example:8080"));
        for (k, v) in headers {
            map.append(HeaderName::from_bytes(k.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap());
        }
        let host = map.get(header::HOST).cloned();
        policy.on_request(&mut map, &Peer::new(peer.parse().unwrap()), host.as_ref());
        map
    }

    fn all(map: &HeaderMap, name: &str) -> Vec<String> {
        map.get_all(name).iter().map(|v| v.to_str().unwrap().to_owned()).collect()
    }

    #[test]
    fn an_untrusted_client_cannot_forge_the_hops_before_it() {
        let p = policy(|c| {
            c.forwarded = Forwarding::Append;
            c.x_forwarded_host = Forwarding::Append;
        });
        let forged = [
            ("x-forwarded-for", "1.2.3.4"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "bank.example"),
            ("forwarded", "for=1.2.3.4"),
        ];
        let map = sent(&p, "10.0.0.7:5000", &forged);
        assert_eq!(all(&map, "x-forwarded-for"), ["10.0.0.7"]);
        assert_eq!(all(&map, "x-forwarded-proto"), ["http"]);
        assert_eq!(all(&map, "x-forwarded-host"), ["proxy.example:8080"]);
        assert_eq!(all(&map, "forwarded"), ["for=10.0.0.7;proto=http;host=\"proxy.example:8080\""]);
    }

    #[test]
    fn a_trusted_proxys_hops_are_kept_and_appended_to() {
        let p = policy(|c| {
            c.forwarded = Forwarding::Append;
            c.x_forwarded_host = Forwarding::Append;
            c.trusted_proxies = vec!["10.0.0.0/8".parse().unwrap()];
        });
        let from_lb = [
            ("x-forwarded-for", "1.2.3.4"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "www.example"),
            ("forwarded", "for=1.2.3.4;proto=https"),
        ];
        let map = sent(&p, "10.0.0.7:5000", &from_lb);
        assert_eq!(all(&map, "x-forwarded-for"), ["1.2.3.4, 10.0.0.7"]);
        assert_eq!(all(&map, "x-forwarded-proto"), ["https"]);
        assert_eq!(all(&map, "x-forwarded-host"), ["www.example"]);
        assert_eq!(
            all(&map, "forwarded"),
            ["for=1.2.3.4;proto=https, for=10.0.0.7;proto=http;host=\"proxy.example:8080\""]
        );
        let ipv6 = sent(&p, "[::ffff:10.1.2.3]:5000", &[("x-forwarded-for", "1.2.3.4")]);
        assert_eq!(all(&ipv6, "x-forwarded-for"), ["1.2.3.4, ::ffff:10.1.2.3"], "a mapped address is its IPv4 one");
    }

    #[test]
    fn replace_and_off_do_what_they_say() {
        let p = policy(|c| {
            c.x_forwarded_for = Forwarding::Replace;
            c.x_forwarded_proto = Forwarding::Off;
            c.trusted_proxies = vec!["10.0.0.7/32".parse().unwrap()];
        });
        let map = sent(&p, "10.0.0.7:5000", &[("x-forwarded-for", "1.2.3.4"), ("x-forwarded-proto", "gopher")]);
        assert_eq!(all(&map, "x-forwarded-for"), ["10.0.0.7"], "replace drops even a trusted peer's");
        assert_eq!(all(&map, "x-forwarded-proto"), ["gopher"], "off passes the client's");
        let v6 = policy(|c| c.forwarded = Forwarding::Replace);
        assert_eq!(
            all(&sent(&v6, "[2001:db8::1]:5000", &[]), "forwarded"),
            ["for=\"[2001:db8::1]\";proto=http;host=\"proxy.example:8080\""]
        );
    }

    #[test]
    fn rules_remove_then_set_then_add() {
        let p = policy(|c| {
            c.request.remove = vec![name("x-debug")];
            c.request.set = vec![pair("x-env", "prod")];
            c.request.add = vec![pair("x-tag", "fg")];
            c.response.set = vec![pair("server", "fencegate")];
        });
        let map = sent(&p, "10.0.0.7:5000", &[("x-debug", "1"), ("x-env", "dev"), ("x-tag", "client")]);
        assert!(map.get("x-debug").is_none());
        assert_eq!(all(&map, "x-env"), ["prod"]);
        assert_eq!(all(&map, "x-tag"), ["client", "fg"]);
        let mut resp = HeaderMap::new();
        resp.insert("server", HeaderValue::from_static("nginx"));
        p.on_response(&mut resp, None);
        assert_eq!(all(&resp, "server"), ["fencegate"]);
    }
}
