//! Redirects that stay behind the fence: a `Location` or `Content-Location` naming the
//! backend's own origin would send the client to the backend directly, around the fence, so it
//! is rewritten to the origin the client reached (nginx's `proxy_redirect default`). Relative
//! references and other origins pass unchanged.

use http::header::{CONTENT_LOCATION, HeaderMap, HeaderValue, LOCATION};
use http::uri::Uri;

/// The backend's origin, as its redirects name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Origin {
    scheme: String,
    host: String,
    port: u16,
}

impl Origin {
    /// The origin of the backend at `url`.
    pub(super) fn of(url: &Uri) -> Option<Origin> {
        let scheme = url.scheme_str()?.to_ascii_lowercase();
        let host = url.host()?.to_ascii_lowercase();
        let port = url.port_u16().or_else(|| default_port(&scheme))?;
        Some(Origin { scheme, host, port })
    }

    /// Whether `authority` (`host[:port]`, no userinfo), under `scheme`, is this origin.
    fn is(&self, scheme: &str, authority: &str) -> bool {
        if !scheme.eq_ignore_ascii_case(&self.scheme) || authority.contains('@') {
            return false;
        }
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) if !port.contains(']') => (host, port.parse::<u16>().ok()),
            _ => (authority, None),
        };
        let port = match port {
            Some(port) => port,
            None if authority.ends_with(':') => return false,
            None => match default_port(scheme) {
                Some(port) => port,
                None => return false,
            },
        };
        host.eq_ignore_ascii_case(&self.host) && port == self.port
    }
}

fn default_port(scheme: &str) -> Option<u16> {
    match scheme.to_ascii_lowercase().as_str() {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    }
}

/// Rewrites the response's `Location` and `Content-Location` that name `backend` to the
/// client's origin: `proto://client_host`, or a reference without an origin where the
/// client named no host.
pub(super) fn rewrite(headers: &mut HeaderMap, backend: &Origin, proto: &str, client_host: Option<&HeaderValue>) {
    // Most answers name no location: one walk over their names (standard ones, an enum each)
    // costs less than a lookup of each.
    if !headers.keys().any(|name| name == LOCATION || name == CONTENT_LOCATION) {
        return;
    }
    for name in [LOCATION, CONTENT_LOCATION] {
        // Every line: a second `Location` naming the backend would leak as well as the first.
        let values: Vec<HeaderValue> = headers.get_all(&name).iter().cloned().collect();
        let mut changed = false;
        let values: Vec<HeaderValue> = values
            .into_iter()
            .map(|value| {
                let rewritten = value
                    .to_str()
                    .ok()
                    .and_then(|text| rewritten(text, backend, proto, client_host))
                    .and_then(|text| HeaderValue::from_str(&text).ok());
                changed |= rewritten.is_some();
                rewritten.unwrap_or(value)
            })
            .collect();
        if changed {
            headers.remove(&name);
            for value in values {
                headers.append(name.clone(), value);
            }
        }
    }
}

/// `location` with the backend's origin replaced, or `None` if it names another origin or
/// none.
fn rewritten(location: &str, backend: &Origin, proto: &str, client_host: Option<&HeaderValue>) -> Option<String> {
    // Read as browsers read it (WHATWG URL): tabs dropped, `\` a `/` in http(s) URLs.
    let location = location.replace('\t', "").replace('\\', "/");
    let location = location.as_str();
    let (scheme, rest) = match location.split_once("://") {
        Some((scheme, rest))
            if !scheme.is_empty() && scheme.bytes().all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b)) =>
        {
            (Some(scheme), rest)
        }
        // A network-path reference: the request's scheme, here the backend's.
        _ => (None, location.strip_prefix("//")?),
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    // Userinfo names no other origin: `http://u@backend/` is the backend.
    let authority = authority.rsplit_once('@').map_or(authority, |(_, hostport)| hostport);
    let host = client_host.and_then(|h| h.to_str().ok());
    let scheme_of = scheme.unwrap_or(&backend.scheme);
    // fencegate forwards the client's Host, and a backend that makes its redirects absolute
    // (nginx) names that host with its own port: that is the backend too.
    let at_backend_port = host.map(|h| Origin { host: host_part(h).to_ascii_lowercase(), ..backend.clone() });
    if !backend.is(scheme_of, authority) && !at_backend_port.is_some_and(|o| o.is(scheme_of, authority)) {
        return None;
    }
    Some(match (host, scheme) {
        (Some(host), Some(_)) => format!("{proto}://{host}{tail}"),
        (Some(host), None) => format!("//{host}{tail}"),
        // No origin the client reached is known: a reference without one, to wherever the
        // client is.
        (None, _) if tail.starts_with('/') => tail.to_owned(),
        (None, _) => format!("/{tail}"),
    })
}

/// The host of `host[:port]`, an IPv6 literal with its brackets.
fn host_part(authority: &str) -> &str {
    match authority.rsplit_once(':') {
        Some((host, port)) if !port.contains(']') => host,
        _ => authority,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(url: &str) -> Origin {
        Origin::of(&url.parse().unwrap()).unwrap()
    }

    fn rewrite_one(location: &str, client: Option<&'static str>) -> Option<String> {
        let host = client.map(HeaderValue::from_static);
        rewritten(location, &backend("http://127.0.0.1:9000"), "https", host.as_ref())
    }

    #[test]
    fn the_backends_origin_becomes_the_clients() {
        let to = |l| rewrite_one(l, Some("proxy.example:8443"));
        assert_eq!(to("http://127.0.0.1:9000/loc/a").as_deref(), Some("https://proxy.example:8443/loc/a"));
        assert_eq!(to("HTTP://127.0.0.1:9000/a?q=1#f").as_deref(), Some("https://proxy.example:8443/a?q=1#f"));
        assert_eq!(to("http://127.0.0.1:9000").as_deref(), Some("https://proxy.example:8443"));
        assert_eq!(to("//127.0.0.1:9000/x").as_deref(), Some("//proxy.example:8443/x"));
        assert_eq!(rewrite_one("http://127.0.0.1:9000/a", None).as_deref(), Some("/a"), "no client host");
    }

    #[test]
    fn other_origins_and_relative_references_pass() {
        let to = |l| rewrite_one(l, Some("proxy.example"));
        for location in [
            "/loc/a",
            "a/b",
            "http://127.0.0.1:9001/a",
            "https://127.0.0.1:9000/a",
            "http://127.0.0.2:9000/a",
            "http://example.com/a",
            "mailto:x@127.0.0.1",
        ] {
            assert_eq!(to(location), None, "{location}");
        }
    }

    #[test]
    fn default_ports_and_case_name_one_origin() {
        let origin = backend("http://Backend.Local");
        assert!(origin.is("http", "backend.local:80"));
        assert!(origin.is("HTTP", "BACKEND.local"));
        assert!(!origin.is("http", "backend.local:8080"));
        assert!(!origin.is("http", "backend.local:"));
        let v6 = backend("https://[::1]:8443");
        assert!(v6.is("https", "[::1]:8443"));
        assert!(!v6.is("https", "[::1]"));
    }
}
