//! The external processor's listener (`server.mode = "ext_proc"`): every stream Envoy opens
//! goes through [`Processor`].

use std::future::Future;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;

use crate::listener::{self, Handler, Listener, Listening, Remote};
use crate::request::envoy::{GrpcBody, Processor};
use crate::request::protocol::Protocol as _;
use crate::state::State;
use crate::upstream::Peer;

/// Envoy's external processor: every gRPC stream goes through [`Processor`].
#[derive(Clone)]
struct Processing(Processor);

impl Handler for Processing {
    type Client = Peer;
    type Body = GrpcBody;

    const BUSY_UNTIL_BODY_ENDS: bool = true;

    fn client(&self, remote: Remote) -> Peer {
        super::proxying::peer(remote)
    }

    fn handle(self, req: Request<Incoming>, client: Peer) -> impl Future<Output = Response<GrpcBody>> + Send {
        self.0.handle(req, client)
    }
}

/// Serves Envoy's external processor on `listener` until `shutdown` resolves, then stops
/// accepting and lets open exchanges finish within `server.shutdown_grace`.
pub(crate) async fn serve(state: Arc<State>, listener: Listener, shutdown: impl Future<Output = ()>) {
    let settings = state.settings.get();
    let config = &settings.config;
    let protocol = crate::request::protocol::for_backend(&config.backend).name();
    tracing::info!(addr = %listener.describe(), protocol, mode = "ext_proc", "fencegate listening");
    let listening = Listening { name: "ext_proc", max_connections: config.limits.max_connections, tls: true };
    listener::serve(Processing(Processor::new(Arc::clone(&state))), listening, state, listener, shutdown).await;
}
