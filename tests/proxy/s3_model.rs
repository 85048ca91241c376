//! Model-based checks of S3 mode: random mixes of PutObject, DeleteObject, DeleteObjects,
//! CopyObject and multipart uploads from several holders with climbing tokens, zombies
//! included, go through fencegate to a real S3 server (moto, then s3s-fs), and the server's own
//! record (a listing and a GET of every key) must be what the fence allows: each key holds the
//! last write whose token was above its `max_seen`, and no overtaken holder's part, completion
//! or abort got through. The driver and the model are `tests/common/s3/mix.py`, which also
//! checks every answer as it comes.
//!
//! The seed is printed (`FG_S3_MODEL_SEED=N` replays it); [`DEFAULT_ROUNDS`] programs of 40
//! operations per server in a local `cargo test`, `FG_S3_MODEL_ROUNDS=N` runs N (`.ci/run`
//! sets 40).

use std::time::{SystemTime, UNIX_EPOCH};

use crate::common::s3::{S3Proxy, S3Server, python, start_moto, start_s3s};

/// Programs per server without `FG_S3_MODEL_ROUNDS`: about 3 s each for the two servers.
const DEFAULT_ROUNDS: u32 = 6;

fn seed() -> u64 {
    std::env::var("FG_S3_MODEL_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64 % 1_000_000_000)
    })
}

fn rounds() -> u32 {
    std::env::var("FG_S3_MODEL_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_ROUNDS)
}

/// fencegate in front of `server` as the mix expects it: the bucket `mixeq` accepts equal
/// tokens, `mix` refuses them.
async fn proxy(server: &S3Server) -> S3Proxy {
    // s3s-fs stores objects as files (see tests/proxy/s3.rs).
    let flat = server.kind != "s3s";
    let config = format!("[s3]\nflat_keys = {flat}\n[[fence.rules]]\nprefix = \"/mixeq\"\nequal_token = \"accept\"\n");
    S3Proxy::start(&server.url, &config).await
}

/// Runs `rounds` programs from `seed` against `server`, through `endpoint` (or the server
/// itself with `bare`).
async fn mix(server: &S3Server, endpoint: &str, seed: u64, rounds: u32, bare: bool) -> std::process::Output {
    let mut args = [server.kind, endpoint, &server.url, &server.access_key, &server.secret].map(str::to_owned).to_vec();
    args.extend([seed.to_string(), rounds.to_string()]);
    if bare {
        args.push("bare".to_owned());
    }
    python("mix.py", args).await
}

fn text(out: &std::process::Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

async fn random_mixes_against(server: Option<S3Server>, seed: u64, rounds: u32) {
    let Some(server) = server else { return };
    let proxy = proxy(&server).await;
    let out = mix(&server, &proxy.url(), seed, rounds, false).await;
    let said = text(&out);
    assert!(out.status.success(), "FG_S3_MODEL_SEED={seed} against {}:\n{said}", server.kind);
    eprint!("{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_s3_mixes_leave_the_server_holding_what_the_fence_allows() {
    let (seed, rounds) = (seed(), rounds());
    eprintln!("FG_S3_MODEL_SEED={seed} FG_S3_MODEL_ROUNDS={rounds}");
    random_mixes_against(start_moto().await, seed, rounds).await;
    random_mixes_against(start_s3s().await, seed, rounds).await;
}

/// The same programs sent to the server around fencegate: stale writes land, and the model's
/// check of the server's record says so. A seed whose first program leaves a stale write in
/// the server's record on both servers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_catches_the_stale_writes_a_bare_server_takes() {
    for server in [start_moto().await, start_s3s().await].into_iter().flatten() {
        let out = mix(&server, &server.url, 1, 1, true).await;
        let said = text(&out);
        assert!(!out.status.success(), "the bare {} passed the model:\n{said}", server.kind);
        assert!(said.contains("answered ok, the model says stale"), "{said}");
        assert!(said.contains("the server holds r0/k0 as"), "{said}");
    }
}
