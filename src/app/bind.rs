//! Binding what `server.listen` and `admin.listen` name: an IP address, every address a host
//! name resolves to (`localhost:8080` is `127.0.0.1:8080` and, where the host has IPv6,
//! `[::1]:8080`), or a Unix socket with its `listen_mode`.

use std::net::SocketAddr;

use tokio::net::TcpListener;

use super::Error;
use crate::config::ListenAddr;
use crate::listener::Listener;

/// Binds `addr`, which the setting `setting` names; a Unix socket's file gets `mode`. Call it
/// on the runtime that serves the listener ([`crate::Proxy::serve_admin`] moves it to its own).
pub async fn bind(setting: &'static str, addr: &ListenAddr, mode: u32) -> Result<Listener, Error> {
    let failed = |message: String| Error::Listen { setting, addr: addr.to_string(), message };
    match addr {
        ListenAddr::Ip(ip) => Ok(Listener::tcp(vec![bind_tcp(*ip).await.map_err(failed)?])),
        ListenAddr::Unix(path) => Listener::bind_unix(path, mode).map_err(|e| failed(e.to_string())),
        ListenAddr::Host { host, port } => {
            let resolved = tokio::net::lookup_host((host.as_str(), *port))
                .await
                .map_err(|e| failed(format!("cannot resolve {host:?}: {e}")))?;
            let mut addrs: Vec<SocketAddr> = Vec::new();
            for found in resolved {
                if !addrs.contains(&found) {
                    addrs.push(found);
                }
            }
            if addrs.is_empty() {
                return Err(failed(format!("{host:?} resolves to no address")));
            }
            let mut listeners: Vec<TcpListener> = Vec::new();
            for mut at in addrs {
                // Port 0: every address gets the port the first one was given.
                if let Some(first) = listeners.first().and_then(|l| l.local_addr().ok()) {
                    at.set_port(first.port());
                }
                match TcpListener::bind(at).await {
                    Ok(listener) => listeners.push(listener),
                    // `localhost` resolves to `::1` on hosts whose IPv6 is off: the address
                    // cannot be bound and is left out, as long as another one is bound.
                    Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
                        tracing::warn!(setting, %at, error = %e, "{host} resolves to an address this host cannot bind; left out");
                    }
                    Err(e) => return Err(failed(format!("{at} ({host} resolves to it): {e}"))),
                }
            }
            if listeners.is_empty() {
                return Err(failed(format!("none of the addresses {host:?} resolves to can be bound")));
            }
            Ok(Listener::tcp(listeners))
        }
    }
}

async fn bind_tcp(addr: SocketAddr) -> Result<TcpListener, String> {
    TcpListener::bind(addr).await.map_err(|e| e.to_string())
}
