//! The proxy's listener: every request its connections carry goes through
//! [`request::handle`].

use std::future::Future;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use prometheus_client::metrics::counter::Counter;

use crate::listener::{self, Handler, Listener, Listening, Remote};
use crate::request::protocol::Protocol as _;
use crate::request::{self, ResponseBody};
use crate::state::State;
use crate::upstream::Peer;

/// The proxy itself: every request goes through [`request::handle`].
#[derive(Clone)]
struct Proxying(Arc<State>);

impl Handler for Proxying {
    type Client = Peer;
    type Body = ResponseBody;

    fn client(&self, remote: Remote) -> Peer {
        peer(remote)
    }

    fn handle(self, req: Request<Incoming>, client: Peer) -> impl Future<Output = Response<ResponseBody>> + Send {
        request::handle(self.0, req, client)
    }

    fn bytes_out(&self) -> Option<&Counter> {
        Some(&self.0.metrics.bytes_out)
    }
}

/// The peer a connection from `remote` is, as requests see it.
pub(super) fn peer(remote: Remote) -> Peer {
    match remote {
        Remote::Tcp(addr) => Peer::new(addr),
        Remote::Unix => Peer::unix(),
    }
}

/// Serves the proxy on `listener` until `shutdown` resolves, then stops accepting and lets
/// in-flight requests finish within `server.shutdown_grace`.
pub(crate) async fn serve(state: Arc<State>, listener: Listener, shutdown: impl Future<Output = ()>) {
    let settings = state.settings.get();
    let config = &settings.config;
    let protocol = request::protocol::for_backend(&config.backend).name();
    tracing::info!(addr = %listener.describe(), backend = %config.backend.url, protocol, "fencegate listening");
    let listening = Listening { name: "proxy", max_connections: config.limits.max_connections, tls: true };
    listener::serve(Proxying(Arc::clone(&state)), listening, state, listener, shutdown).await;
}
