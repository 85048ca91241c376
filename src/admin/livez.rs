//! `GET /livez`: whether the runtime that serves requests still runs tasks. The admin API has
//! a thread and runtime of its own, so `/healthz` answers even while the serving threads are
//! wedged (a blocking call or a busy loop on one of them); `/livez` hands a small task to the
//! serving runtime and answers `503` when it has not run within [`BOUND`], for a liveness
//! probe that restarts a wedged process.

use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use serde_json::json;
use tokio::runtime::Handle;

use crate::refusal::json_response;

/// How long the serving runtime has to run the probe's task. A runtime that needs longer to
/// get to a task is wedged, or so overloaded that restarting it is the lesser harm; a
/// liveness probe's timeout must be longer than this.
pub(crate) const BOUND: Duration = Duration::from_secs(2);

/// `200` when `serving` runs a task within `bound` (time read on the admin runtime's clock),
/// `503` otherwise. Without a serving runtime (a proxy opened outside one) there is nothing
/// to check, and the answer is `200`.
pub(crate) async fn liveness(serving: Option<&Handle>, bound: Duration) -> Response<Full<Bytes>> {
    let Some(serving) = serving else {
        return json_response(StatusCode::OK, &json!({ "status": "ok", "serving": "unknown" }));
    };
    let ran = serving.spawn(async {});
    match tokio::time::timeout(bound, ran).await {
        Ok(Ok(())) => json_response(StatusCode::OK, &json!({ "status": "ok" })),
        Ok(Err(e)) => wedged(format!("the serving runtime dropped the probe's task: {e}")),
        Err(_) => wedged(format!("the serving runtime did not run a task within {bound:?}: it is wedged or saturated")),
    }
}

fn wedged(problem: String) -> Response<Full<Bytes>> {
    json_response(StatusCode::SERVICE_UNAVAILABLE, &json!({ "status": "wedged", "problem": problem }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_runtime_that_runs_no_task_within_the_bound_is_not_live() {
        // A runtime nothing drives: a task handed to it never runs, as on wedged threads.
        let wedged = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let start = tokio::time::Instant::now();
        let answer = liveness(Some(wedged.handle()), BOUND).await;
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(start.elapsed(), BOUND, "answered when the bound ran out, on tokio's clock");
        wedged.shutdown_background();

        // This test's own runtime runs it.
        let answer = liveness(Some(&Handle::current()), BOUND).await;
        assert_eq!(answer.status(), StatusCode::OK);
    }
}
