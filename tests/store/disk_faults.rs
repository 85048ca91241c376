//! Disks that fail under the real binary (docs/faults.md, "Disk faults"): `EIO` from the log's
//! `fdatasync`, from its writes of records and from its writes of zeros (an `LD_PRELOAD` shim,
//! [`Shim`]), an ext4 file system the kernel turns read-only mid-load, and the restart on it
//! ([`Ext4`]), and a slow device: the same ext4 on a loop device that takes eight writes a
//! second (a blkio cgroup, [`Throttle`]; `dm-delay` needs the kernel's device-mapper, which
//! this machine's kernel lacks: docs/faults.md).
//!
//! After each fault: nothing was forwarded that was not durable (the backend received exactly
//! the acknowledged writes, each resource's in token order), readiness says why, writes are
//! refused with the documented code, and a restart without the fault recovers every
//! acknowledged token (each resource refuses it).

use crate::common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};

use common::builder::Deployment;
use common::disks::{Ext4, Fault, Shim, Throttle};
use common::process::{BIN, Running};
use common::raw::put_response;
use common::{Resp, eventually, poll_until, raw_request};

/// Zeros 4 KiB ahead of the records (so a write of zeros comes every few dozen writes), no
/// rotation, a quarantine short enough to wait out after a restart, and an admin API.
const CONFIG: &str = "segment_bytes = 65536\n[fence]\nquarantine = \"100ms\"\n[admin]\nlisten = \"127.0.0.1:0\"";

/// Writers at once, each on resources of its own.
const WRITERS: u64 = 4;

/// Writes acknowledged before the fault comes.
const BEFORE: usize = 40;

/// A write: its path and token.
type Write = (String, u64);

/// What a load met: the writes acknowledged, in order, and each writer's first refused write
/// with its answer.
struct Outcome {
    acked: Vec<Write>,
    refused: Vec<(Write, Resp)>,
}

/// Runs [`WRITERS`] writers of fenced PUTs, each to four resources of its own with ever higher
/// tokens, calls `fault` once [`BEFORE`] writes are acknowledged, and returns once every writer
/// has had a write refused.
async fn load_until_refused(addr: SocketAddr, fault: impl FnOnce()) -> Outcome {
    let acked = Arc::new(Mutex::new(Vec::new()));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let acked = Arc::clone(&acked);
            tokio::spawn(async move {
                for step in 0..2_000u64 {
                    let write = (format!("/w{w}/r{}", step % 4), step + 1);
                    let r = put_response(addr, &write.0, write.1).await.expect("the proxy answers");
                    if r.status != 200 {
                        return (write, r);
                    }
                    acked.lock().unwrap().push(write);
                }
                panic!("writer {w}: no write was refused");
            })
        })
        .collect();
    poll_until("writes acknowledged before the fault", || acked.lock().unwrap().len() >= BEFORE).await;
    fault();
    let mut refused = Vec::new();
    for writer in writers {
        refused.push(writer.await.unwrap());
    }
    let acked = acked.lock().unwrap().clone();
    Outcome { acked, refused }
}

/// The backend received exactly the acknowledged writes, and each resource's in token order:
/// nothing was forwarded whose advance was not durable.
fn assert_forwarded_exactly_the_acknowledged(d: &Deployment, acked: &[Write]) {
    let mut forwarded: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for r in d.backend.requests().into_iter().filter(|r| r.method == http::Method::PUT) {
        forwarded.entry(r.path.clone()).or_default().push(r.token().expect("a fenced write's token"));
    }
    let mut expected: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for (path, token) in acked {
        expected.entry(path.clone()).or_default().push(*token);
    }
    for tokens in expected.values_mut() {
        tokens.sort_unstable();
    }
    assert_eq!(forwarded, expected, "forwarded, in arrival order, against acknowledged, in token order");
}

async fn readyz(admin: SocketAddr) -> Resp {
    raw_request(admin, "GET /readyz HTTP/1.1\r\nHost: x", "").await
}

/// `/readyz` says the store is not ready, and `problems[0]` starts with `starts` and names
/// `cause`.
async fn assert_unready(admin: SocketAddr, starts: &str, cause: &str) {
    let ready = readyz(admin).await;
    assert_eq!(ready.status, 503, "{ready:?}");
    assert_eq!(ready.json()["checks"]["store"], false, "{ready:?}");
    let problem = ready.json()["problems"][0].as_str().unwrap_or_default().to_owned();
    assert!(problem.starts_with(starts) && problem.contains(cause), "{problem}");
}

/// After a restart without the fault: every resource's level is at least its highest
/// acknowledged token, and it refuses that token (every lower one with it) as stale, once a
/// quarantine of writes whose answers the failed store could not log is over. A higher token
/// passes: the store works again.
async fn assert_recovered(addr: SocketAddr, admin: SocketAddr, acked: &[Write]) {
    let mut highest: BTreeMap<&str, u64> = BTreeMap::new();
    for (path, token) in acked {
        let top = highest.entry(path).or_default();
        *top = (*top).max(*token);
    }
    for (path, token) in highest {
        let level = raw_request(admin, &format!("GET /fences{path} HTTP/1.1\r\nHost: x"), "").await;
        assert_eq!(level.status, 200, "{path}: {level:?}");
        let max_seen = level.json()["max_seen"].as_u64().unwrap();
        assert!(max_seen >= token, "{path}: max_seen {max_seen} lost the acknowledged token {token}");
        eventually("the acknowledged token is refused as stale", async || {
            let r = put_response(addr, path, token).await.unwrap();
            if r.fencegate_error() == Some("resource_quarantined") {
                return false;
            }
            r.assert_refused(409, "stale_token");
            true
        })
        .await;
        eventually("a higher token passes", async || {
            let r = put_response(addr, path, max_seen + 1).await.unwrap();
            if r.fencegate_error() == Some("resource_quarantined") {
                return false;
            }
            assert_eq!((r.status, r.fencegate_error()), (200, None), "{path}: {:?}", r.body);
            true
        })
        .await;
    }
}

/// Starts the proxy of `d` with the shim loaded; returns its address and its admin API's.
async fn start_with_shim(d: &mut Deployment, shim: &Shim) -> (SocketAddr, SocketAddr) {
    let mut cmd = d.command();
    shim.apply(&mut cmd);
    d.running = Some(Running::spawn(cmd));
    (d.addr(), d.proxy().admin_addr().await)
}

/// `EIO` from `fault` mid-load fails the store for good: writes are refused with
/// `store_unavailable` (no `Retry-After`), readiness says the store failed and why, even once
/// the disk behaves again, and a restart recovers every acknowledged write.
async fn eio_fails_the_store_for_good(fault: Fault) {
    let Some(shim) = Shim::build() else { return };
    let mut d = Deployment::builder().config_extra(CONFIG).build().await;
    let (addr, admin) = start_with_shim(&mut d, &shim).await;
    let outcome = load_until_refused(addr, || shim.arm(fault)).await;
    assert!(shim.hit(fault), "the shim failed a call");
    for (_, r) in &outcome.refused {
        r.assert_refused(503, "store_unavailable");
        assert!(!r.headers.contains_key("retry-after"), "failed until a restart: {:?}", r.headers);
    }
    d.proxy().wait_for_log("refusing every fenced write until fencegate is restarted", 1).await;
    assert!(d.proxy().log_contains("Input/output error"), "the cause is logged");
    assert!(!d.proxy().log_contains("no room on disk"), "not a full disk");
    assert_unready(admin, "store failed:", "Input/output error").await;
    assert_forwarded_exactly_the_acknowledged(&d, &outcome.acked);

    // The disk behaves again; the store stays failed: the kernel may have dropped the pages
    // whose write or sync failed, so no later sync can vouch for them.
    shim.disarm(fault);
    let ((path, token), _) = &outcome.refused[0];
    put_response(addr, path, *token).await.unwrap().assert_refused(503, "store_unavailable");
    assert_unready(admin, "store failed:", "Input/output error").await;
    assert_forwarded_exactly_the_acknowledged(&d, &outcome.acked);

    d.kill9();
    let addr = d.start().addr;
    let admin = d.proxy().admin_addr().await;
    assert_recovered(addr, admin, &outcome.acked).await;
}

#[tokio::test]
async fn eio_from_fdatasync_mid_load_fails_the_store_and_a_restart_recovers_every_acknowledged_write() {
    eio_fails_the_store_for_good(Fault::Fdatasync).await;
}

#[tokio::test]
async fn eio_from_the_write_of_records_mid_load_fails_the_store_and_a_restart_recovers_every_acknowledged_write() {
    eio_fails_the_store_for_good(Fault::Records).await;
}

#[tokio::test]
async fn eio_in_the_write_of_zeros_is_reported_as_an_io_error_not_a_full_disk_and_passes_once_the_disk_takes_it() {
    let Some(shim) = Shim::build() else { return };
    let mut d = Deployment::builder().config_extra(CONFIG).build().await;
    let (addr, admin) = start_with_shim(&mut d, &shim).await;
    let outcome = load_until_refused(addr, || shim.arm(Fault::Zeros)).await;
    assert!(shim.hit(Fault::Zeros), "the shim failed a write of zeros");
    for (_, r) in &outcome.refused {
        r.assert_refused(503, "store_unavailable");
        assert!(r.headers.contains_key("retry-after"), "it may pass again: {:?}", r.headers);
        assert!(r.json()["message"].as_str().unwrap_or_default().contains("Input/output error"), "{:?}", r.body);
    }
    d.proxy().wait_for_log("the disk failed the write of zeros that makes room for the fence log", 1).await;
    assert!(!d.proxy().log_contains("no room on disk"), "not told a full disk");
    assert!(!d.proxy().log_contains("refusing every fenced write"), "nothing of the batch was written");
    assert_unready(admin, "store cannot make room:", "Input/output error").await;
    assert_forwarded_exactly_the_acknowledged(&d, &outcome.acked);

    // The disk takes writes again: a store nobody writes to finds out by itself, and the very
    // writes that were refused pass.
    shim.disarm(Fault::Zeros);
    d.proxy().wait_for_log("the disk makes room for the fence log again", 1).await;
    eventually("ready again", async || readyz(admin).await.status == 200).await;
    let mut acked = outcome.acked;
    for ((path, token), _) in outcome.refused {
        let r = put_response(addr, &path, token).await.unwrap();
        assert_eq!((r.status, r.fencegate_error()), (200, None), "{path}: {:?}", r.body);
        acked.push((path, token));
    }
    assert_forwarded_exactly_the_acknowledged(&d, &acked);

    d.kill9();
    let addr = d.start().addr;
    let admin = d.proxy().admin_addr().await;
    assert_recovered(addr, admin, &acked).await;
}

/// Runs `cmd` (a `fencegate` command expected to refuse at once) to its end.
async fn run_to_end(mut cmd: Command) -> Output {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    poll_until("the command ends", || child.try_wait().unwrap().is_some()).await;
    child.wait_with_output().unwrap()
}

#[tokio::test]
async fn a_file_system_the_kernel_turns_read_only_fails_the_store_and_a_restart_on_it_exits_74_saying_why() {
    let mut d = Deployment::builder().config_extra(CONFIG).build().await;
    let data = d.data_dir();
    let Some(mut ext4) = Ext4::mount(&data, 32) else { return };
    let init = ext4.command(BIN).args(["init", "--dir"]).arg(&data).output().unwrap();
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let config = d.config_path.clone();
    let run = |ext4: &Ext4| {
        let mut cmd = ext4.command(BIN);
        cmd.args(["run", "--config"]).arg(&config);
        cmd
    };
    d.running = Some(Running::spawn(run(&ext4)));
    let (addr, admin) = (d.addr(), d.proxy().admin_addr().await);
    assert!(ext4.path(&data).join("segment-00000000000000000001.log").exists(), "the log is on the ext4");

    let outcome = load_until_refused(addr, || ext4.fail()).await;
    // A write of records or of zeros, or a sync, met the read-only file system (EROFS; a sync
    // under way when the journal aborted gets EIO): either way the same code, and readiness
    // names the cause.
    for (_, r) in &outcome.refused {
        r.assert_refused(503, "store_unavailable");
    }
    let cause = ["Read-only file system", "Input/output error"];
    // The log reaches the test through the log thread and a pipe: waited for, not raced.
    poll_until("the cause is logged", || cause.iter().any(|c| d.proxy().log_contains(c))).await;
    let ready = readyz(admin).await;
    let problem = ready.json()["problems"][0].as_str().unwrap_or_default().to_owned();
    assert!(
        (problem.starts_with("store failed:") || problem.starts_with("store cannot make room:"))
            && cause.iter().any(|c| problem.contains(c)),
        "{problem}"
    );
    assert_forwarded_exactly_the_acknowledged(&d, &outcome.acked);

    // A restart on the read-only file system: one line naming the cause and the fix, and
    // status 74, on which a service manager is told not to restart (RestartPreventExitStatus).
    // `fencegate check` says the same.
    d.kill9();
    let mut check = ext4.command(BIN);
    check.args(["check", "--quiet", "--config"]).arg(&d.config_path);
    for (what, out) in [("run", run_to_end(run(&ext4)).await), ("check", run_to_end(check).await)] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr.lines().last().unwrap_or_default();
        assert_eq!(out.status.code(), Some(74), "{what}: {stderr}");
        for says in ["is on a read-only file system", "Read-only file system", "fsck", "status 74"] {
            assert!(last.contains(says), "{what} does not say {says:?}: {last}");
        }
    }

    // Repaired and mounted read-write again, the store recovers every acknowledged write.
    ext4.repair();
    d.running = Some(Running::spawn(run(&ext4)));
    let (addr, admin) = (d.addr(), d.proxy().admin_addr().await);
    assert_recovered(addr, admin, &outcome.acked).await;
    // Nothing may use the file system when it goes.
    d.kill9();
}

/// [`WRITERS`] writers of fenced PUTs to the same four resources, `per_writer` writes each:
/// at step `s` every writer writes resource `s % 4`, with a token of `4s + 1` to `4s + 4`, so
/// that writes to one resource race each other. Each returns the writes it had acknowledged; a write may also be
/// refused as stale (a higher token overtook it), and never otherwise.
fn spawn_racing_writers(addr: SocketAddr, per_writer: u64) -> Vec<tokio::task::JoinHandle<Vec<Write>>> {
    (0..WRITERS)
        .map(|w| {
            tokio::spawn(async move {
                let mut acked = Vec::new();
                for step in 0..per_writer {
                    // The writers tend to arrive in the same order at every step: odd steps
                    // give the first the highest token, so the others' are stale by then.
                    let rank = if step % 2 == 0 { w + 1 } else { WRITERS - w };
                    let write = (format!("/shared/r{}", step % 4), step * WRITERS + rank);
                    let r = put_response(addr, &write.0, write.1).await.expect("the proxy answers");
                    match (r.status, r.fencegate_error()) {
                        (200, None) => acked.push(write),
                        (409, Some("stale_token")) => {}
                        _ => panic!("{write:?}: {} {:?}", r.status, r.body),
                    }
                }
                acked
            })
        })
        .collect()
}

/// The mean of a Prometheus histogram `name` in `metrics`: its `_sum` over its `_count`.
fn mean(metrics: &str, name: &str) -> f64 {
    let value = |suffix: &str| -> f64 {
        let prefix = format!("{name}_{suffix} ");
        let line =
            metrics.lines().find(|l| l.starts_with(&prefix)).unwrap_or_else(|| panic!("no {prefix}in\n{metrics}"));
        line[prefix.len()..].trim().parse().unwrap()
    };
    value("sum") / value("count")
}

#[tokio::test]
async fn a_slow_device_keeps_each_resources_writes_in_token_order_and_readiness_reports_the_stall() {
    let mut d = Deployment::builder().config_extra(&format!("stall_after = \"50ms\"\n{CONFIG}")).build().await;
    let data = d.data_dir();
    let Some(ext4) = Ext4::mount(&data, 32) else { return };
    let init = ext4.command(BIN).args(["init", "--dir"]).arg(&data).output().unwrap();
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    // Eight writes a second: every sync of the log waits in the block layer.
    let Some(throttle) = Throttle::new(&ext4.device_number(), 8) else { return };
    let mut run = ext4.throttled_command(&throttle, BIN);
    run.args(["run", "--config"]).arg(&d.config_path);
    d.running = Some(Running::spawn(run));
    let (addr, admin) = (d.addr(), d.proxy().admin_addr().await);

    let writers = spawn_racing_writers(addr, 8);
    eventually("/readyz reports the stalled store", async || {
        let ready = readyz(admin).await;
        let problem = ready.json()["problems"][0].as_str().unwrap_or_default().to_owned();
        ready.status == 503 && problem.starts_with("store stalled")
    })
    .await;
    let mut acked = Vec::new();
    for writer in writers {
        acked.extend(writer.await.unwrap());
    }
    eventually("/readyz is ready once the load is over", async || readyz(admin).await.status == 200).await;
    let metrics = raw_request(admin, "GET /metrics HTTP/1.1\r\nHost: x", "").await;
    let metrics = String::from_utf8_lossy(&metrics.body).into_owned();
    eprintln!(
        "a slow device: {} writes acknowledged of {}, a batch's write and sync took {:.0} ms on average, {:.1} advances a batch",
        acked.len(),
        WRITERS * 8,
        mean(&metrics, "fencegate_store_sync_duration_seconds") * 1000.0,
        mean(&metrics, "fencegate_store_batch_advances")
    );
    assert_forwarded_exactly_the_acknowledged(&d, &acked);

    // Without the throttle, a restart recovers every acknowledged write.
    d.kill9();
    let mut run = ext4.command(BIN);
    run.args(["run", "--config"]).arg(&d.config_path);
    d.running = Some(Running::spawn(run));
    let (addr, admin) = (d.addr(), d.proxy().admin_addr().await);
    assert_recovered(addr, admin, &acked).await;
    d.kill9();
}

#[tokio::test]
async fn a_slow_device_from_dm_delay_where_the_kernel_has_device_mapper() {
    // dm-delay needs the kernel's device-mapper (/dev/mapper/control) and its delay target;
    // the blkio throttle above makes a slow device without it.
    let why = match Command::new("dmsetup").arg("targets").output() {
        Err(e) => format!("no dmsetup ({e}; apt-get install dmsetup)"),
        Ok(out) if !out.status.success() => format!(
            "the kernel has no device-mapper (dmsetup targets: {})",
            String::from_utf8_lossy(&out.stderr).lines().next().unwrap_or_default()
        ),
        Ok(out) if !String::from_utf8_lossy(&out.stdout).lines().any(|l| l.starts_with("delay")) => {
            "the kernel's device-mapper has no delay target (dm-delay)".to_owned()
        }
        Ok(_) => "dm-delay is here, but only the blkio throttle is tried (docs/faults.md)".to_owned(),
    };
    assert!(std::env::var("FG_REQUIRE_DM").as_deref() != Ok("1"), "FG_REQUIRE_DM=1 but {why}");
    common::skips::skip(&why);
}
