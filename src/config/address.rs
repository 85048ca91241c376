//! Where fencegate listens and where its backend is: a TCP address (an IP literal or a host
//! name resolved when the listener is bound), or a Unix socket at `unix:/absolute/path`.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use http::Uri;
use http::uri::Authority;

use super::ConfigError;
use super::validate::invalid;

/// The prefix that names a Unix socket in `server.listen`, `admin.listen` and `backend.url`.
const UNIX: &str = "unix:";

/// The mode a listener's Unix socket file gets when `listen_mode` is unset: owner and group
/// may connect.
pub const DEFAULT_LISTEN_MODE: u32 = 0o660;

/// A listener's address (`server.listen`, `admin.listen`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// An IP address and port.
    Ip(SocketAddr),
    /// A host name and port; bound on every address the name resolves to when the listener is
    /// bound.
    Host {
        /// The name, as written.
        host: String,
        /// The port.
        port: u16,
    },
    /// A Unix socket file, made when the listener is bound.
    Unix(PathBuf),
}

impl ListenAddr {
    /// Reads `IP:PORT`, `HOST:PORT` or `unix:/absolute/path`; the error says what is wrong.
    pub fn parse(text: &str) -> Result<Self, String> {
        if let Some(path) = text.strip_prefix(UNIX) {
            return socket_path(path).map(ListenAddr::Unix);
        }
        if let Ok(addr) = text.parse::<SocketAddr>() {
            return Ok(ListenAddr::Ip(addr));
        }
        let expected = "expected IP:PORT, HOST:PORT or unix:/absolute/path";
        let Some((host, port)) = text.rsplit_once(':') else {
            return Err(format!("{text:?}: no port; {expected}"));
        };
        let port = port.parse().map_err(|e| format!("{text:?}: port {port:?}: {e}; {expected}"))?;
        let name = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.';
        if host.is_empty() || !host.chars().all(name) {
            return Err(format!("{text:?}: {host:?} is neither an IP address nor a host name; {expected}"));
        }
        Ok(ListenAddr::Host { host: host.to_owned(), port })
    }

    /// The port, for a TCP listener.
    pub fn port(&self) -> Option<u16> {
        match self {
            ListenAddr::Ip(addr) => Some(addr.port()),
            ListenAddr::Host { port, .. } => Some(*port),
            ListenAddr::Unix(_) => None,
        }
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddr::Ip(addr) => addr.fmt(f),
            ListenAddr::Host { host, port } => write!(f, "{host}:{port}"),
            ListenAddr::Unix(path) => write!(f, "{UNIX}{}", path.display()),
        }
    }
}

impl From<SocketAddr> for ListenAddr {
    fn from(addr: SocketAddr) -> Self {
        ListenAddr::Ip(addr)
    }
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        ListenAddr::parse(text)
    }
}

/// A listener's `listen_mode`: an octal permission string such as `"0660"`, applied to its
/// Unix socket file.
pub(super) fn listen_mode(key: &str, text: Option<&str>) -> Result<u32, ConfigError> {
    let Some(text) = text else { return Ok(DEFAULT_LISTEN_MODE) };
    let digits = text.strip_prefix("0o").unwrap_or(text);
    match u32::from_str_radix(digits, 8) {
        Ok(mode) if mode <= 0o777 && !digits.is_empty() => Ok(mode),
        _ => Err(invalid(key, format!("{text:?}: expected an octal mode of at most 0777, such as \"0660\""))),
    }
}

/// Where the backend is (`backend.url`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendUrl {
    /// `http://HOST[:PORT]` or `https://HOST[:PORT]`.
    Http(Uri),
    /// `unix:/absolute/path`: plain HTTP on a Unix socket.
    Unix(PathBuf),
}

impl BackendUrl {
    /// The URL's scheme: `http`, `https` or `unix`.
    pub fn scheme_str(&self) -> Option<&str> {
        match self {
            BackendUrl::Http(uri) => uri.scheme_str(),
            BackendUrl::Unix(_) => Some("unix"),
        }
    }

    /// Whether the backend speaks TLS.
    pub fn is_https(&self) -> bool {
        self.scheme_str() == Some("https")
    }

    /// Host and port of a TCP backend.
    pub fn authority(&self) -> Option<&Authority> {
        match self {
            BackendUrl::Http(uri) => uri.authority(),
            BackendUrl::Unix(_) => None,
        }
    }

    /// The port written in a TCP backend's URL.
    pub fn port_u16(&self) -> Option<u16> {
        self.authority().and_then(Authority::port_u16)
    }

    /// The socket of a backend on a Unix socket.
    pub fn socket(&self) -> Option<&Path> {
        match self {
            BackendUrl::Http(_) => None,
            BackendUrl::Unix(path) => Some(path),
        }
    }
}

impl fmt::Display for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BackendUrl::Http(uri) => uri.fmt(f),
            BackendUrl::Unix(path) => write!(f, "{UNIX}{}", path.display()),
        }
    }
}

impl FromStr for BackendUrl {
    type Err = ConfigError;

    /// Reads and checks `backend.url`; the error names the key.
    fn from_str(text: &str) -> Result<Self, ConfigError> {
        let key = "backend.url";
        if let Some(path) = text.strip_prefix(UNIX) {
            return socket_path(path).map(BackendUrl::Unix).map_err(|e| invalid(key, e));
        }
        let uri: Uri = text.parse().map_err(|e| invalid(key, format!("{text:?}: {e}")))?;
        match uri.scheme_str() {
            Some("http" | "https") => {}
            Some(other) => {
                return Err(invalid(
                    key,
                    format!("scheme {other:?} is not supported; use http://, https:// or unix:/absolute/path"),
                ));
            }
            None => {
                return Err(invalid(key, format!("{text:?} needs a scheme, e.g. http://127.0.0.1:9000")));
            }
        }
        if uri.authority().is_none() {
            return Err(invalid(key, format!("{text:?} has no host")));
        }
        // The forwarded path must be exactly the fenced path, so no base path can be prepended.
        if uri.path_and_query().is_some_and(|pq| pq.as_str() != "/" && !pq.as_str().is_empty()) {
            return Err(invalid(key, format!("{text:?} must not have a path or query")));
        }
        Ok(BackendUrl::Http(uri))
    }
}

/// The path after `unix:`, which must be absolute: a relative one would depend on the working
/// directory fencegate happens to start in.
fn socket_path(path: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(path);
    if !path.is_absolute() {
        return Err(format!("unix:{}: the socket path must be absolute (unix:/run/app.sock)", path.display()));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_are_ip_host_or_unix() {
        assert_eq!(ListenAddr::parse("127.0.0.1:80").unwrap(), ListenAddr::Ip("127.0.0.1:80".parse().unwrap()));
        assert_eq!(ListenAddr::parse("[::1]:80").unwrap(), ListenAddr::Ip("[::1]:80".parse().unwrap()));
        let host = ListenAddr::parse("localhost:8080").unwrap();
        assert_eq!(host, ListenAddr::Host { host: "localhost".into(), port: 8080 });
        assert_eq!(host.to_string(), "localhost:8080");
        let unix = ListenAddr::parse("unix:/run/fg.sock").unwrap();
        assert_eq!(unix, ListenAddr::Unix("/run/fg.sock".into()));
        assert_eq!(unix.to_string(), "unix:/run/fg.sock");
        for bad in ["localhost", "localhost:http", ":80", "unix:fg.sock", "a b:80", "[::1:80"] {
            assert!(ListenAddr::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn listen_modes_are_octal() {
        assert_eq!(listen_mode("server.listen_mode", None).unwrap(), 0o660);
        assert_eq!(listen_mode("server.listen_mode", Some("0600")).unwrap(), 0o600);
        assert_eq!(listen_mode("server.listen_mode", Some("777")).unwrap(), 0o777);
        for bad in ["", "0o", "0680", "1777", "rw"] {
            let e = listen_mode("server.listen_mode", Some(bad)).unwrap_err().to_string();
            assert!(e.starts_with("server.listen_mode: "), "{e}");
        }
    }

    #[test]
    fn backend_urls_are_http_or_an_absolute_unix_socket() {
        let unix: BackendUrl = "unix:/run/app.sock".parse().unwrap();
        assert_eq!(unix.socket(), Some(Path::new("/run/app.sock")));
        assert_eq!((unix.to_string().as_str(), unix.is_https()), ("unix:/run/app.sock", false));
        let http: BackendUrl = "https://b:8443".parse().unwrap();
        assert_eq!((http.is_https(), http.port_u16(), http.socket()), (true, Some(8443), None));
        let relative = "unix:app.sock".parse::<BackendUrl>().unwrap_err().to_string();
        assert!(relative.contains("must be absolute"), "{relative}");
    }
}
