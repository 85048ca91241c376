//! fencegate as Envoy's external processor (`server.mode = "ext_proc"`, docs/envoy.md). Envoy
//! forwards every request itself and, for each one its filter sends, opens a gRPC stream on
//! which it reports the request's head, body chunks and the backend's answer, each waiting for
//! fencegate's word. What a request names, its token's checks, its turn and the durable advance
//! are the proxy's ([`super::classify`], [`super::fenced`], the fence and the store); what
//! differs is only who forwards ([`exchange`]) and the messages it is said in ([`wire`]).

mod exchange;
mod health;
mod wire;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use http::{Request, Response};
use hyper::body::Incoming;
use tokio::sync::mpsc;
use tonic::codegen::Service as _;
use tonic::codegen::tokio_stream::Stream;
use tonic::{Status, Streaming};
use tonic_health::pb::health_server::HealthServer;

use crate::state::State;
use crate::upstream::Peer;

/// The path prefix of gRPC health checking's calls.
const HEALTH: &str = "/grpc.health.v1.Health/";

/// The gRPC body of the processor's answers.
pub type GrpcBody = tonic::body::Body;

/// Envoy's `ExternalProcessor` service, served by fencegate, and its health for Envoy's
/// health checks.
#[derive(Clone)]
pub(crate) struct Processor {
    server: ExternalProcessorServer<Exchanges>,
    health: HealthServer<health::Checks>,
}

/// What each stream of the service runs on.
struct Exchanges {
    state: Arc<State>,
}

/// Answers Envoy on one stream; a handful is enough, since Envoy waits for each answer.
const ANSWERS_QUEUED: usize = 4;

/// What an exchange says on its stream. Unboxed: at most a handful wait in the channel, and a
/// box would cost every answer an allocation.
#[allow(clippy::large_enum_variant)]
pub(super) enum Said {
    /// An answer to one of Envoy's messages.
    Answer(ProcessingResponse),
    /// The exchange is over: the stream may close cleanly.
    Finished,
}

/// One exchange's answers as its gRPC stream sends them. An exchange that ends without saying
/// it finished (one abandoned after its write was let go, a panic) ends the stream with an
/// error status, never a clean close: Envoy takes a clean close for "nothing more to process"
/// and would forward the rest of the request unchecked, while on an error (with
/// `failure_mode_allow` off) it answers the client itself and resets the backend's request.
struct Answers {
    said: mpsc::Receiver<Said>,
    ended: bool,
}

impl Stream for Answers {
    type Item = Result<ProcessingResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let said = ready!(self.said.poll_recv(cx));
        Poll::Ready(match said {
            Some(Said::Answer(answer)) => Some(Ok(answer)),
            Some(Said::Finished) => {
                self.ended = true;
                None
            }
            None => {
                self.ended = true;
                Some(Err(Status::aborted("fencegate abandoned the exchange: Envoy must not go on with it")))
            }
        })
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Exchanges {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, Status> {
        let client = request.extensions().get::<Peer>().cloned().unwrap_or_else(Peer::unix);
        let (out, answers) = mpsc::channel(ANSWERS_QUEUED);
        // A task of its own: the exchange runs to its end (a write's turn, its quarantine)
        // whatever becomes of the stream.
        // Boxed, built in place: the exchange's state (several KiB) moves as a pointer, where
        // a task's spawn and end would each copy all of it.
        tokio::spawn(boxed_in_place!(exchange::run(Arc::clone(&self.state), client, request.into_inner(), out)));
        Ok(tonic::Response::new(Answers { said: answers, ended: false }))
    }
}

impl Processor {
    /// The service over `state`.
    pub(crate) fn new(state: Arc<State>) -> Self {
        let health = HealthServer::new(health::Checks { state: Arc::clone(&state) });
        Processor { server: ExternalProcessorServer::new(Exchanges { state }), health }
    }

    /// Answers one HTTP/2 request of Envoy's gRPC client, from `client`.
    pub(crate) fn handle(
        &self,
        mut req: Request<Incoming>,
        client: Peer,
    ) -> impl Future<Output = Response<GrpcBody>> + Send + use<> {
        req.extensions_mut().insert(client);
        let health = req.uri().path().starts_with(HEALTH).then(|| self.health.clone());
        let mut server = self.server.clone();
        async move {
            let answered: Result<_, Infallible> = match health {
                Some(mut health) => health.call(req).await,
                None => server.call(req).await,
            };
            answered.unwrap_or_else(|never| match never {})
        }
    }
}
