//! Headers on the way through: hop-by-hop headers stripped both ways (RFC 9110 §7.6.1), and
//! the client's address appended to `X-Forwarded-For`.

use std::net::{IpAddr, SocketAddr};

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Whether `name` describes one connection, not the message (RFC 9110 §7.6.1), or is one of
/// the legacy connection headers proxies have always stripped.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    // Names are lowercase; a match on the string costs less than comparing against a list
    // of `HeaderName`s, which would be built and dropped on every call.
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// Most names a message may carry for a walk over them to be the cheaper way to find one: a
/// lookup hashes the name and probes, a walk compares a few names, most of them standard ones
/// (an enum each).
const FEW_NAMES: usize = 16;

/// Whether `headers` hold `name`.
fn holds(headers: &HeaderMap, name: &HeaderName) -> bool {
    match headers.keys_len() <= FEW_NAMES {
        true => headers.keys().any(|held| held == name),
        false => headers.contains_key(name),
    }
}

/// Removes every `name` line. Most messages carry none of the names fencegate drops, and a
/// removal that finds nothing costs a lookup: a look ([`holds`]) first costs less.
pub fn remove_held(headers: &mut HeaderMap, name: &HeaderName) {
    if holds(headers, name) {
        headers.remove(name);
    }
}

/// Removes hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most requests carry no hop-by-hop header at all, and every header a `Connection` names
    // comes with a `Connection`, itself one: one walk over the names settles them.
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    // Most messages carry no `Connection`, or only `Connection: keep-alive`, whose name is
    // removed anyway: then nothing is allocated, and one pass over the names finds the rest.
    let (mut listed, mut connection) = (Vec::<HeaderName>::new(), false);
    for value in headers.get_all(header::CONNECTION) {
        connection = true;
        for name in value.to_str().unwrap_or_default().split(',').map(str::trim) {
            if name.is_empty() || name.eq_ignore_ascii_case("keep-alive") {
                continue;
            }
            // Host names the resource's origin: no client may have it dropped on the way.
            if let Ok(name) = HeaderName::from_bytes(name.as_bytes())
                && name != header::HOST
            {
                listed.push(name);
            }
        }
    }
    if connection {
        headers.remove(header::CONNECTION);
    }
    let doomed: Vec<HeaderName> = headers.keys().filter(|k| is_hop_by_hop(k) || listed.contains(k)).cloned().collect();
    for name in &doomed {
        headers.remove(name);
    }
}

/// Where a client's connection comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerAddr {
    /// A TCP peer.
    Ip(SocketAddr),
    /// A peer on a Unix socket, which has no address a header could name.
    Unix,
}

/// The client at the other end of a connection, with its `X-Forwarded-For` entry made once.
#[derive(Debug, Clone)]
pub struct Peer {
    addr: PeerAddr,
    ip: HeaderValue,
}

impl Peer {
    /// The TCP peer at `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        let ip = HeaderValue::from_str(&addr.ip().to_string()).unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        Peer { addr: PeerAddr::Ip(addr), ip }
    }

    /// A peer on a Unix socket.
    pub fn unix() -> Self {
        Peer { addr: PeerAddr::Unix, ip: HeaderValue::from_static("unknown") }
    }

    /// Where the connection comes from.
    pub fn addr(&self) -> PeerAddr {
        self.addr
    }

    /// The peer's IP address as a header value (`unknown` for a Unix socket's peer).
    pub fn ip_value(&self) -> &HeaderValue {
        &self.ip
    }

    /// The peer's IP address, if it came over TCP.
    pub fn ip(&self) -> Option<IpAddr> {
        match self.addr {
            PeerAddr::Ip(addr) => Some(addr.ip()),
            PeerAddr::Unix => None,
        }
    }
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.addr {
            PeerAddr::Ip(addr) => addr.fmt(f),
            PeerAddr::Unix => f.write_str("unix"),
        }
    }
}

/// Adds the client's address to `X-Forwarded-For`.
pub fn append_forwarded_for(headers: &mut HeaderMap, client: &Peer) {
    const FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
    match headers.entry(FORWARDED_FOR) {
        header::Entry::Vacant(entry) => {
            entry.insert(client.ip.clone());
        }
        header::Entry::Occupied(mut entry) => {
            // Every earlier hop, on however many lines they came, then this client.
            let mut joined: Vec<&str> = entry.iter().filter_map(|v| v.to_str().ok()).collect();
            joined.push(client.ip.to_str().unwrap_or_default());
            if let Ok(value) = HeaderValue::from_str(&joined.join(", ")) {
                entry.insert(value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_those_connection_names_are_removed() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, x-secret-hop"),
            ("keep-alive", "timeout=5"),
            ("x-secret-hop", "1"),
            ("te", "trailers"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("proxy-authorization", "Basic x"),
            ("content-type", "text/plain"),
            ("fencing-token", "34"),
        ] {
            h.append(k, HeaderValue::from_static(v));
        }
        strip_hop_by_hop(&mut h);
        let mut left: Vec<_> = h.keys().map(|k| k.as_str()).collect();
        left.sort_unstable(); // distinct fields have no order (RFC 9110 §5.3)
        assert_eq!(left, ["content-type", "fencing-token"]);
    }

    #[test]
    fn a_connection_header_alone_is_removed_and_a_message_without_one_kept_whole() {
        let mut h = HeaderMap::new();
        h.append("connection", HeaderValue::from_static("keep-alive"));
        h.append("content-length", HeaderValue::from_static("3"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.keys().map(|k| k.as_str()).collect::<Vec<_>>(), ["content-length"]);
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn held_names_are_found_by_walk_and_by_lookup() {
        let secret = HeaderName::from_static("x-secret");
        for count in [0, 3, FEW_NAMES, FEW_NAMES + 1, 40] {
            let mut h = HeaderMap::new();
            for i in 0..count {
                h.append(
                    HeaderName::from_bytes(format!("x-other-{i}").as_bytes()).unwrap(),
                    HeaderValue::from_static("1"),
                );
            }
            assert!(!holds(&h, &secret), "{count} other names");
            remove_held(&mut h, &secret);
            assert_eq!(h.len(), count);
            h.append(secret.clone(), HeaderValue::from_static("a"));
            h.append(secret.clone(), HeaderValue::from_static("b"));
            assert!(holds(&h, &secret), "{count} other names");
            remove_held(&mut h, &secret);
            assert!(!h.contains_key(&secret), "every line goes, beside {count} other names");
            assert_eq!(h.len(), count);
        }
    }

    #[test]
    fn forwarded_for_is_appended() {
        let mut h = HeaderMap::new();
        let peer = Peer::new("127.0.0.9:1".parse().unwrap());
        append_forwarded_for(&mut h, &peer);
        assert_eq!(h["x-forwarded-for"], "127.0.0.9");
        append_forwarded_for(&mut h, &peer);
        assert_eq!(h["x-forwarded-for"], "127.0.0.9, 127.0.0.9");
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        append_forwarded_for(&mut h, &peer);
        let all: Vec<_> = h.get_all("x-forwarded-for").iter().collect();
        assert_eq!(all, ["127.0.0.9, 127.0.0.9, 10.0.0.1, 127.0.0.9"], "every earlier line is kept, in order");
    }
}
