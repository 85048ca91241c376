//! gRPC health checking (`grpc.health.v1.Health`) on the processor's listener, so that Envoy's
//! active health checks send each stream to an instance that decides writes: with a shared
//! fence only its leader does, and a follower answers every fenced write `503`. An instance is
//! `SERVING` while it fences writes and its store takes advances (a running sync within
//! `store.stall_after` included); `NOT_SERVING` while it follows, has no leader, or its store
//! is full, failed or unreachable. Envoy asks by `Check`; `Watch` is not offered, which the
//! protocol lets a client take for "ask by `Check`".

use std::sync::Arc;

use tonic::codegen::tokio_stream::Empty;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::Health;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use crate::state::State;
use crate::store::{Condition, Role};

/// The services whose health is asked for: the whole server (`""`) and the processor.
const SERVICES: [&str; 2] = ["", "envoy.service.ext_proc.v3.ExternalProcessor"];

/// The processor's health, as its state says it each time it is asked.
pub(super) struct Checks {
    pub(super) state: Arc<State>,
}

impl Checks {
    /// Whether this instance decides fenced writes now.
    fn serving(&self) -> ServingStatus {
        let stall_after = self.state.settings.get().config.store.stall_after;
        let store_takes = match self.state.store.condition() {
            Condition::Ready => true,
            Condition::Busy(took) => took < stall_after,
            Condition::Full(_) | Condition::RoomFailed(_) | Condition::Failed(_) | Condition::Unavailable(_) => false,
        };
        match self.state.store.role() {
            Role::Fences if store_takes => ServingStatus::Serving,
            Role::Fences | Role::Forward(_) | Role::Unavailable(_) => ServingStatus::NotServing,
        }
    }
}

#[tonic::async_trait]
impl Health for Checks {
    async fn check(&self, request: Request<HealthCheckRequest>) -> Result<Response<HealthCheckResponse>, Status> {
        let service = request.into_inner().service;
        if !SERVICES.contains(&service.as_str()) {
            return Err(Status::not_found(format!("no service {service:?} here")));
        }
        Ok(Response::new(HealthCheckResponse { status: self.serving() as i32 }))
    }

    type WatchStream = Empty<Result<HealthCheckResponse, Status>>;

    async fn watch(&self, _request: Request<HealthCheckRequest>) -> Result<Response<Self::WatchStream>, Status> {
        Err(Status::unimplemented("ask by Check"))
    }
}
