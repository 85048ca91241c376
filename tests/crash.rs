//! Crash and failure tests of the real binary: whatever instant it dies at, and whatever the
//! disk does, no advance that was forwarded is ever forgotten.
//!
//! `FG_CRASH_ROUNDS=N` runs N rounds of the random-kill test instead of 20 (a soak), and
//! `FG_CRASH_SEED=S` replays the kill moments of a failed run.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::builder::Deployment;
use common::raw::{put, put_response};
use common::{eventually, poll_until, raw_request};

/// xorshift64*: enough randomness for kill moments, and reproducible from a printed seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn sigkill_at_random_moments_never_loses_a_forwarded_advance() {
    let rounds = env_u64("FG_CRASH_ROUNDS").unwrap_or(20);
    let seed = env_u64("FG_CRASH_SEED")
        .unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64 | 1);
    let mut rng = Rng(seed);
    // Tiny segments, so kills also land in rotations and compactions.
    let mut d =
        Deployment::builder().config_extra("segment_bytes = 4096\n[fence]\nquarantine = \"100ms\"").build().await;
    let resources: Arc<Vec<String>> = Arc::new((0..32).map(|i| format!("/tenant-{}/object-{i}", i % 4)).collect());
    let mut base = 0u64;
    let mut forwarded = 0usize;
    let mut in_flight_at_kill = 0usize;
    for round in 0..rounds {
        let addr = d.start().addr;
        // Eight writers, each walking all resources with ever higher tokens.
        let writers: Vec<_> = (0..8u64)
            .map(|w| {
                let resources = Arc::clone(&resources);
                tokio::spawn(async move {
                    for step in 0u64.. {
                        let path = &resources[((step * 8 + w) % resources.len() as u64) as usize];
                        let token = base + 1 + step * 8 + w;
                        // 0: the proxy is gone. A 503 (a resource quarantined after the
                        // previous kill) just moves on to the next resource.
                        if put(addr, path, token).await == 0 {
                            return;
                        }
                    }
                })
            })
            .collect();
        // Random on purpose: where in the writers' work the kill lands.
        tokio::time::sleep(Duration::from_millis(20 + rng.below(300))).await;
        d.kill9();
        for w in writers {
            let _ = w.await; // each stops once the proxy is gone
        }

        // The highest token the backend ever received, per resource, applied or not.
        let mut highest: HashMap<String, u64> = HashMap::new();
        for r in d.backend.requests() {
            let e = highest.entry(r.path.clone()).or_default();
            *e = (*e).max(r.token().unwrap());
        }
        forwarded = d.backend.requests().len();
        if d.start().log_contains("in flight when fencegate stopped") {
            in_flight_at_kill += 1;
        }
        for (path, max) in &highest {
            let status = put(d.addr(), path, *max).await;
            assert_eq!(status, 409, "seed {seed} round {round}: {path} forgot token {max} (got {status})");
        }
        d.kill9();
        base += 10_000_000;
    }
    eprintln!(
        "{rounds} kill -9 rounds (seed {seed}): {forwarded} writes forwarded in all; \
         {in_flight_at_kill} restarts found writes in flight"
    );
}

#[tokio::test]
async fn sigkill_while_a_write_is_at_the_backend_keeps_its_advance_and_quarantines_the_resource() {
    let mut d = Deployment::builder().config_extra("[fence]\nquarantine = \"1500ms\"").start().await;
    let addr = d.addr();
    // The backend holds the write for 1 s: the proxy dies while it is in flight, and the
    // backend applies it after the new proxy is up.
    let held = tokio::spawn(async move {
        let head = format!("PUT /doc HTTP/1.1\r\nHost: x\r\nFencing-Token: 77\r\n{}: 1000", common::DELAY_HEADER);
        raw_request(addr, &head, "v").await
    });
    poll_until("the backend receives the held write", || !d.backend.requests().is_empty()).await;
    d.kill9();
    held.abort();
    let addr = d.start().addr;
    assert_eq!(put(addr, "/doc", 77).await, 409, "the forwarded token's advance survived kill -9");
    // 77 may still be applied: a newer write must not overtake it.
    put_response(addr, "/doc", 78).await.unwrap().assert_refused(503, "resource_quarantined");
    assert!(d.proxy().log_contains("in flight when fencegate stopped"));
    eventually("the resource reopens after its quarantine", async || put(addr, "/doc", 78).await == 200).await;
    let applied: Vec<u64> = d.backend.applied().iter().filter_map(|r| r.token()).collect();
    assert_eq!(applied, [77, 78], "the backend applied them in token order");
}

#[tokio::test]
async fn a_failed_log_write_closes_fenced_writes_keeps_reads_flowing_and_loses_nothing() {
    let mut d = Deployment::builder().build().await;
    // A real write failure: files may not grow past 8 KiB (EFBIG), and the signal that would
    // otherwise kill the process for it is ignored, as it stays across exec.
    let addr = d.start_in_shell("trap '' XFSZ; ulimit -f 8").addr;
    let mut acked = Vec::new();
    let refusal = loop {
        let path = format!("/objects/{}", acked.len());
        let r = put_response(addr, &path, 5).await.unwrap();
        if r.status != 200 {
            break r;
        }
        acked.push(path);
        assert!(acked.len() < 10_000, "the file size limit never bit");
    };
    refusal.assert_refused(503, "store_unavailable");
    assert!(!acked.is_empty());
    // Failed for good: even a known resource with a higher token is refused now...
    put_response(addr, &acked[0], 6).await.unwrap().assert_refused(503, "store_unavailable");
    // ...while reads still flow.
    let get = raw_request(addr, &format!("GET {} HTTP/1.1\r\nHost: x", acked[0]), "").await;
    assert_eq!((get.status, get.fencegate_error()), (200, None));
    assert!(d.proxy().log_contains("refusing every fenced write"), "the failure is logged loudly");
    assert!(d.proxy().log_contains("cannot write zeros ahead"), "the 1 MiB of zeros ahead failed first, harmlessly");
    let refused_path = format!("/objects/{}", acked.len());
    assert!(d.backend.requests().iter().all(|r| r.path != refused_path), "the failed write was not forwarded");

    let addr = d.restart().addr;
    for path in &acked {
        assert_eq!(put(addr, path, 5).await, 409, "{path}: an acknowledged advance was lost");
    }
    assert_eq!(put(addr, &acked[0], 6).await, 200, "after a restart the store works again");
    d.kill9();
    assert!(d.data_dir().join("LOCK").exists());
}
