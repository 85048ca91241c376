//! The least an Envoy external processor does, to measure what Envoy's ext_proc filter costs
//! by itself, apart from fencegate: it answers every message of every stream "go on" at once
//! (no classification, no turn, no store), on one current-thread runtime with mimalloc, over
//! the same tonic service and HTTP/2 server connection fencegate uses. Envoy asking it as
//! `deploy/envoy/envoy.yaml` asks fencegate sends each write the same messages (the head, each
//! body chunk, the answer's head), so Envoy with it against Envoy alone is the price of the
//! filter, and fencegate against it is fencegate's own share (benches/envoy.sh, FLOOR=1). It
//! answers Envoy's gRPC health checks `SERVING`, as a leading fencegate does: the shipped
//! bootstrap sends streams only to a processor that says so.
//!
//! `cargo run --release --example ext_proc_floor -- 127.0.0.1:18406`

use std::pin::Pin;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::ProcessingMode;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::{BodySendMode, HeaderSendMode};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Asked;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeadersResponse, ProcessingRequest, ProcessingResponse, TrailersResponse,
};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tonic::codegen::Service as _;
use tonic::codegen::tokio_stream::{Stream, StreamExt};
use tonic::{Status, Streaming};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

struct Floor;

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Floor {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Answers>, Status> {
        let answers = request.into_inner().filter_map(|message| message.ok().and_then(|m| go_on(&m)).map(Ok));
        Ok(tonic::Response::new(Box::pin(answers)))
    }
}

/// Serving, always.
struct Serving;

#[tonic::async_trait]
impl Health for Serving {
    async fn check(
        &self,
        _request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<HealthCheckResponse>, Status> {
        Ok(tonic::Response::new(HealthCheckResponse { status: ServingStatus::Serving as i32 }))
    }

    type WatchStream = tonic::codegen::tokio_stream::Empty<Result<HealthCheckResponse, Status>>;

    async fn watch(
        &self,
        _request: tonic::Request<HealthCheckRequest>,
    ) -> Result<tonic::Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("ask by Check"))
    }
}

/// "Go on" to whatever `message` carries; a write's head asks for what fencegate asks of it.
fn go_on(message: &ProcessingRequest) -> Option<ProcessingResponse> {
    let common = || Some(CommonResponse::default());
    let mut mode_override = None;
    let answer = match message.request.as_ref()? {
        Asked::RequestHeaders(_) => {
            mode_override = Some(ProcessingMode {
                request_header_mode: HeaderSendMode::Send as i32,
                response_header_mode: HeaderSendMode::Send as i32,
                request_body_mode: BodySendMode::Streamed as i32,
                response_body_mode: BodySendMode::None as i32,
                request_trailer_mode: HeaderSendMode::Skip as i32,
                response_trailer_mode: HeaderSendMode::Skip as i32,
            });
            Answer::RequestHeaders(HeadersResponse { response: common() })
        }
        Asked::ResponseHeaders(_) => Answer::ResponseHeaders(HeadersResponse { response: common() }),
        Asked::RequestBody(_) => Answer::RequestBody(BodyResponse { response: common() }),
        Asked::ResponseBody(_) => Answer::ResponseBody(BodyResponse { response: common() }),
        Asked::RequestTrailers(_) => Answer::RequestTrailers(TrailersResponse::default()),
        Asked::ResponseTrailers(_) => Answer::ResponseTrailers(TrailersResponse::default()),
    };
    Some(ProcessingResponse { response: Some(answer), mode_override, ..Default::default() })
}

fn main() -> std::io::Result<()> {
    let addr = std::env::args().nth(1).unwrap_or_else(|| "127.0.0.1:18406".into());
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        let listener = TcpListener::bind(&addr).await?;
        eprintln!("ext_proc floor listening on {addr}");
        let server = ExternalProcessorServer::new(Floor);
        let health = HealthServer::new(Serving);
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            let (server, health) = (server.clone(), health.clone());
            tokio::spawn(async move {
                let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let (mut server, mut health) = (server.clone(), health.clone());
                    async move {
                        match req.uri().path().starts_with("/grpc.health.v1.Health/") {
                            true => health.call(req).await,
                            false => server.call(req).await,
                        }
                    }
                });
                let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service);
                if let Err(e) = conn.await {
                    eprintln!("connection ended: {e}");
                }
            });
        }
    })
}
