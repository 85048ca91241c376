//! The real `fencegate` binary: one instance per data dir, and the `init`, `check`, `inspect`
//! and `demo` commands. Crash tests are in `crash.rs`.

use crate::common;

use std::process::{Command, Output};

use common::builder::{Deployment, write_config};
use common::process::{BIN, thread_policies};
use common::raw::put;
use common::{eventually, poll_until};

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[tokio::test]
async fn a_second_instance_on_the_same_data_dir_exits_at_once_with_a_clear_message() {
    let d = Deployment::builder().start().await;
    let second = run(&["run", "--config", d.config_path.to_str().unwrap()], &[]);
    assert!(!second.status.success());
    let msg = String::from_utf8_lossy(&second.stderr);
    assert!(msg.contains("in use by another fencegate"), "{msg}");
}

/// `SCHED_OTHER` and `SCHED_BATCH`, as Linux numbers them.
const SCHED_OTHER: u32 = 0;
const SCHED_BATCH: u32 = 3;

/// `count` fenced PUTs at once, to resources of their own, each with `token`.
async fn burst(addr: std::net::SocketAddr, count: usize, token: u64) {
    let mut writes = tokio::task::JoinSet::new();
    for i in 0..count {
        writes.spawn(async move { put(addr, &format!("/burst/{i}"), token).await });
    }
    while let Some(status) = writes.join_next().await {
        assert_ne!(status.unwrap(), 0, "every write is answered");
    }
}

#[tokio::test]
async fn the_store_writer_is_a_batch_thread_while_writes_come_several_to_a_batch() {
    // The test runs under the default policy, which the serving thread keeps.
    let d = Deployment::builder().start().await;
    let (pid, addr) = (d.proxy().pid(), d.addr());
    let writer = || thread_policies(pid, "fencegate-log");
    // A thread the writer starts (compaction) bears the writer's name until it names itself:
    // one thread of that name, under the default policy, is what must show up.
    poll_until("the writer is up, an ordinary thread before any write", || writer() == [SCHED_OTHER]).await;
    let mut token = 0;
    eventually("a batch of several writes makes the writer a batch thread", async || {
        token += 1;
        burst(addr, 16, token).await;
        writer() == [SCHED_BATCH]
    })
    .await;
    let serving = thread_policies(pid, "fencegate");
    assert!(!serving.is_empty() && serving.iter().all(|&p| p == SCHED_OTHER), "the serving thread: {serving:?}");
    assert_eq!(thread_policies(pid, "fencegate-compa"), [SCHED_OTHER], "nor does the compaction thread change");
    eventually("lone writes make it an ordinary thread again", async || {
        token += 1;
        assert_ne!(put(addr, "/lone", token).await, 0);
        writer() == [SCHED_OTHER]
    })
    .await;

    let normal = Deployment::builder().config_extra("writer_scheduling = \"normal\"").start().await;
    let (pid, addr) = (normal.proxy().pid(), normal.addr());
    for token in 1..=20 {
        burst(addr, 16, token).await;
    }
    assert_eq!(thread_policies(pid, "fencegate-log"), [SCHED_OTHER], "normal: never changed");
}

#[test]
fn run_refuses_a_missing_or_empty_data_dir_and_says_what_to_run() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "http://127.0.0.1:9000", "");
    let data = dir.path().join("data");
    let d = data.display();
    let out = run(&["run", "--config", config.to_str().unwrap()], &[]);
    let msg = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{msg}");
    assert!(msg.contains(&format!("data dir {d} does not exist")), "{msg}");
    assert!(msg.contains(&format!("`fencegate init --dir {d}`")), "{msg}");
    assert!(msg.contains(&format!("`fencegate init --dir {d} --floor <that token>`")), "{msg}");
    assert!(!data.exists(), "run created the data dir");

    std::fs::create_dir(&data).unwrap();
    let out = run(&["run", "--config", config.to_str().unwrap()], &[]);
    let msg = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && msg.contains(&format!("data dir {d} holds no fence state")), "{msg}");
    assert_eq!(std::fs::read_dir(&data).unwrap().count(), 0, "run wrote into the empty data dir");
}

#[tokio::test]
async fn init_with_a_floor_then_run_serves_and_init_refuses_the_dir_from_then_on() {
    let dir = tempfile::tempdir().unwrap();
    let backend = fencegate::demo::MemBackend::start().await.unwrap();
    let config = write_config(dir.path(), &backend.url(), "");
    let data = dir.path().join("data");
    let init = |floor: &str| run(&["init", "--dir", data.to_str().unwrap(), "--floor", floor], &[]);
    let out = init("7");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("every resource starts at max_seen = 7"));

    let mut cmd = std::process::Command::new(BIN);
    cmd.args(["run", "--config", config.to_str().unwrap()]);
    let proxy = common::process::Running::spawn(cmd);
    assert_eq!(put(proxy.addr, "/never/written", 7).await, 409);
    assert_eq!(put(proxy.addr, "/never/written", 8).await, 200);
    let busy = init("0");
    assert!(!busy.status.success() && String::from_utf8_lossy(&busy.stderr).contains("in use by another fencegate"));
    proxy.kill9();

    let again = init("0");
    let msg = String::from_utf8_lossy(&again.stderr);
    assert!(!again.status.success() && msg.contains("already holds fence state"), "{msg}");
    let out = run(&["inspect", "--dir", data.to_str().unwrap()], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("init       fencegate init, floor 7 at /"), "{text}");
    assert!(text.contains("resources  1") && text.contains("floors     1"), "{text}");
}

#[test]
fn check_prints_the_effective_settings_of_a_valid_file() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "http://127.0.0.1:9000", "");
    init_data_dir(dir.path());
    let out = run(&["check", "--config", config.to_str().unwrap()], &[("FENCEGATE_FENCE__EQUAL_TOKEN", "accept")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    for expected in ["equal_token = \"accept\"", "request_timeout = \"30s\"", "header = \"fencing-token\""] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }
}

#[test]
fn check_with_envoy_passes_the_shipped_bootstrap_and_names_what_lets_a_write_by() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "http://127.0.0.1:9000", "");
    init_data_dir(dir.path());
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/envoy/envoy.yaml");
    let env = [("FENCEGATE_SERVER__MODE", "ext_proc")];
    let out = run(&["check", "--config", config.to_str().unwrap(), "--envoy", shipped], &env);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("mode = \"ext_proc\""));
    let open =
        std::fs::read_to_string(shipped).unwrap().replace("failure_mode_allow: false", "failure_mode_allow: true");
    let bad = dir.path().join("envoy.yaml");
    std::fs::write(&bad, open).unwrap();
    let out = run(&["check", "--config", config.to_str().unwrap(), "--envoy", bad.to_str().unwrap()], &env);
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("failure_mode_allow is not false"), "{said}");
}

/// `fencegate init` of the data dir `write_config` names.
fn init_data_dir(dir: &std::path::Path) {
    let data = dir.join("data");
    let out = run(&["init", "--dir", data.to_str().unwrap()], &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn init_and_inspect_name_both_ways_to_a_data_dir_and_init_refuses_a_file() {
    for command in ["init", "inspect"] {
        let out = run(&[command], &[]);
        let msg = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && msg.contains("--dir") && msg.contains("--config"), "{command}: {msg}");
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data");
    std::fs::write(&file, "not a directory").unwrap();
    let out = run(&["init", "--dir", file.to_str().unwrap()], &[]);
    let msg = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && msg.contains("is a file, not a directory") && !msg.contains("File exists"),
        "{msg}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "not a directory");
}

#[test]
fn check_refuses_what_run_would_refuse() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "http://127.0.0.1:9000", "");
    let check = |env: &[(&str, &str)]| {
        let out = run(&["check", "--config", config.to_str().unwrap()], env);
        (
            out.status.success(),
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
        )
    };
    let (ok, text) = check(&[]);
    assert!(!ok && text.contains("does not exist") && text.contains("fencegate init --dir"), "{text}");
    init_data_dir(dir.path());
    let (ok, text) = check(&[]);
    assert!(ok && text.contains("initialised, same key rules, writable"), "{text}");

    // Keys made under other rules (as a run with other `[[fence.scopes]]` would have recorded).
    let keying = dir.path().join("data/KEYING");
    let recorded = std::fs::read_to_string(&keying).ok();
    std::fs::write(&keying, "recorded under other rules").unwrap();
    let (ok, text) = check(&[]);
    assert!(!ok && text.contains("other key rules"), "{text}");
    match recorded {
        Some(text) => std::fs::write(&keying, text).unwrap(),
        None => std::fs::remove_file(&keying).unwrap(),
    }

    // Listeners on one address, or on the backend's.
    for (env, says) in [
        (("FENCEGATE_ADMIN__LISTEN", "127.0.0.1:9100"), "same address"),
        (("FENCEGATE_BACKEND__URL", "http://127.0.0.1:9100"), "forward to itself"),
    ] {
        let (ok, text) = check(&[("FENCEGATE_SERVER__LISTEN", "0.0.0.0:9100"), env]);
        assert!(!ok && text.contains(says), "{env:?}: {text}");
    }
    // A directory given as the config file.
    let out = run(&["check", "--config", dir.path().to_str().unwrap()], &[]);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && text.contains("Is a directory"), "{text}");
}

#[test]
fn kubernetes_service_links_are_ignored_and_stray_variables_named() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "http://127.0.0.1:9000", "");
    init_data_dir(dir.path());
    let config = config.to_str().unwrap();
    // What Kubernetes puts into every pod of a namespace with a Service named `fencegate`.
    let links = [
        ("FENCEGATE_SERVICE_HOST", "10.96.0.12"),
        ("FENCEGATE_SERVICE_PORT", "8080"),
        ("FENCEGATE_PORT", "tcp://10.96.0.12:8080"),
        ("FENCEGATE_PORT_8080_TCP", "tcp://10.96.0.12:8080"),
        ("FENCEGATE_PORT_8080_TCP_PROTO", "tcp"),
        ("FENCEGATE_PORT_8080_TCP_PORT", "8080"),
        ("FENCEGATE_PORT_8080_TCP_ADDR", "10.96.0.12"),
    ];
    let out = run(&["check", "--config", config], &links);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("warning"), "service links are no one's typo");

    let out = run(&["check", "--config", config], &[("FENCEGATE_BACKEND_URL", "http://127.0.0.1:1")]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("# warning: FENCEGATE_BACKEND_URL is ignored"), "{text}");
    assert!(text.contains("url = \"http://127.0.0.1:9000/\"") || text.contains("127.0.0.1:9000"), "{text}");

    let out = run(&["check", "--config", config], &[("FENCEGATE_BACKEND__URLL", "http://127.0.0.1:1")]);
    assert!(!out.status.success());
    let msg = String::from_utf8_lossy(&out.stderr);
    assert!(msg.contains("environment variable FENCEGATE_BACKEND__URLL"), "names the variable: {msg}");
}

#[test]
fn check_names_the_bad_key_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    for (body, key) in [
        ("[backend]\nurl = \"http://127.0.0.1:9000\"\n[fence]\nequal_tokens = \"accept\"\n", "equal_tokens"),
        ("[backend]\nurl = \"http://127.0.0.1:9000\"\nconect_timeout = \"1s\"\n", "conect_timeout"),
        ("[backend]\nurl = \"http://127.0.0.1:9000\"\n[fence]\nqueue_timeout = \"-1\"\n", "fence.queue_timeout"),
        ("[fence]\nheader = \"x\"\n", "backend"),
    ] {
        let path = dir.path().join("bad.toml");
        std::fs::write(&path, body).unwrap();
        let out = run(&["check", "--config", path.to_str().unwrap()], &[]);
        assert!(!out.status.success(), "{body:?} was accepted");
        let msg = String::from_utf8_lossy(&out.stderr);
        assert!(msg.contains(key), "{body:?}: {msg}");
    }
    let out = run(&["check", "--config", "/nonexistent/fencegate.toml"], &[]);
    assert!(!out.status.success());
}

/// `check --quiet`, as the systemd unit's `ExecStartPre=` runs it: nothing in the journal on
/// every start, only the error when the start is refused.
#[test]
fn check_quiet_prints_nothing_on_success_and_the_error_on_failure() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "http://127.0.0.1:9000", "");
    init_data_dir(dir.path());
    // A variable that is not a setting: `check` warns about it, `check --quiet` leaves it to `run`.
    let env = [("FENCEGATE_BACKEND_URL", "http://127.0.0.1:1")];
    let out = run(&["check", "--quiet", "--config", config.to_str().unwrap()], &env);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!((out.stdout.as_slice(), out.stderr.as_slice()), (&b""[..], &b""[..]), "check --quiet said something");

    // Valid TOML, but a run would refuse it: a listener on the backend's address.
    let out =
        run(&["check", "-q", "--config", config.to_str().unwrap()], &[("FENCEGATE_SERVER__LISTEN", "127.0.0.1:9000")]);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stderr).contains("server.listen"), "{}", String::from_utf8_lossy(&out.stderr));
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[backend]\nurl = \"http://127.0.0.1:9000\"\n[fence]\nequal_tokens = \"accept\"\n").unwrap();
    let out = run(&["check", "--quiet", "--config", bad.to_str().unwrap()], &[]);
    assert!(!out.status.success() && out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("equal_tokens"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `fencegate sleep`, the Kubernetes `preStop` hook: waits, then exits 0; a duration it cannot
/// read is an error that says so.
#[test]
fn sleep_waits_and_refuses_a_duration_it_cannot_read() {
    let out = run(&["sleep", "10ms"], &[]);
    assert!(out.status.success() && out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = run(&["sleep", "soon"], &[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("soon"), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn the_shipped_sample_config_is_valid() {
    let sample = concat!(env!("CARGO_MANIFEST_DIR"), "/config/fencegate.toml");
    let dir = tempfile::tempdir().unwrap();
    init_data_dir(dir.path());
    let data = dir.path().join("data");
    let out = run(&["check", "--config", sample], &[("FENCEGATE_STORE__DIR", data.to_str().unwrap())]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn demo_replays_the_race_shows_it_defeated_and_exits_zero() {
    let out = run(&["demo"], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("t4  Client2 PUT /accounts/42 token=34  -> 200 OK"), "{text}");
    assert!(text.contains("t6  Client1 PUT /accounts/42 token=33  -> 409 Conflict"), "{text}");
    assert!(text.contains("\"balance=200 (client2)\""), "{text}");
    assert!(!text.contains("UNEXPECTED"), "{text}");
}

#[tokio::test]
async fn inspect_reads_a_data_dir_without_a_proxy_and_refuses_while_one_runs() {
    let mut d = Deployment::builder().start().await;
    for (path, token) in [("/a", 5), ("/b", 70), ("/c", 9)] {
        assert_eq!(put(d.addr(), path, token).await, 200);
    }
    let data = d.data_dir();
    let busy = run(&["inspect", "--dir", data.to_str().unwrap(), "//c"], &[]);
    assert!(!busy.status.success());
    let said = String::from_utf8_lossy(&busy.stderr);
    assert!(
        said.contains("in use by another fencegate") && said.contains("admin API ([admin] listen): GET /fences/c"),
        "{said}"
    );
    d.kill9();

    let out = run(&["inspect", "--dir", data.to_str().unwrap(), "--top", "2"], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("resources  3"), "{text}");
    let top: Vec<&str> = text.lines().skip_while(|l| !l.starts_with("top 2")).skip(1).collect();
    assert_eq!(top.len(), 2, "{text}");
    assert!(top[0].trim().starts_with("70") && top[0].ends_with("/b"), "{text}");
    let out = run(&["inspect", "--dir", data.to_str().unwrap(), "/c"], &[]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "/c max_seen=9");
    // A path as a client writes it names its fence key, by the config's rules when given one.
    let out = run(&["inspect", "--dir", data.to_str().unwrap(), "//c"], &[]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "/c max_seen=9 (fence key of //c)");
    let out = run(&["inspect", "--config", d.config_path.to_str().unwrap(), "/x/../c"], &[]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "/c max_seen=9 (fence key of /x/../c)");
    let out = run(&["inspect", "--dir", data.to_str().unwrap(), "/a%2Fb"], &[]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("not a path a write could use"));
    let out = run(&["inspect", "--dir", data.to_str().unwrap(), "/never"], &[]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("never written"));
}

#[tokio::test]
async fn refused_writes_are_logged_once_per_resource_and_interval_with_a_count_of_the_rest() {
    // An interval no test outlasts: every refusal after the first is suppressed, whatever the
    // machine's speed; a reload then shortens it, so that the next refusal is logged.
    let d = Deployment::builder().config_extra("[log]\nformat = \"json\"\nrefusal_interval = \"1h\"").start().await;
    let (proxy, addr) = (d.proxy(), d.addr());
    assert_eq!(put(addr, "/doc", 5).await, 200);
    for _ in 0..30 {
        assert_eq!(put(addr, "/doc", 4).await, 409); // a zombie in a loop
    }
    assert_eq!(put(addr, "/other", 1).await, 200);
    assert_eq!(put(addr, "/other", 1).await, 409, "another resource is logged on its own");
    let text = std::fs::read_to_string(&d.config_path).unwrap().replace("\"1h\"", "\"1ms\"");
    std::fs::write(&d.config_path, text).unwrap();
    proxy.signal("HUP");
    proxy.wait_for_log("configuration reloaded", 1).await;
    assert_eq!(put(addr, "/doc", 4).await, 409);
    // Each refusal is logged (or counted) before it is answered: no earlier line can follow.
    proxy.wait_for_log("refused stale token", 3).await;
    let lines = proxy.log_lines("refused stale token");
    assert_eq!(lines.len(), 3, "{lines:#?}");
    let last: serde_json::Value = serde_json::from_str(lines.last().unwrap()).expect("JSON log lines");
    let fields = &last; // fields at the top level
    assert!(last.get("fields").is_none(), "{last}");
    assert_eq!((fields["resource"].as_str(), fields["token"].as_u64()), (Some("/doc"), Some(4)));
    assert_eq!(fields["max_seen"], 5);
    assert_eq!(fields["suppressed"], 29, "the next line counts what was left out");
    assert!(fields["client"].as_str().is_some_and(|c| c.starts_with("127.0.0.1:")), "{last}");
}

fn open_files_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap().to_owned();
    let mut fields = line.trim_start_matches("Max open files").split_whitespace();
    (fields.next().unwrap().to_owned(), fields.next().unwrap().to_owned())
}

#[tokio::test]
async fn run_raises_the_soft_limit_on_open_files_to_the_hard_limit() {
    let mut d = Deployment::builder().build().await;
    // A low soft limit under whatever hard limit the test runs with.
    let pid = d.start_in_shell("ulimit -Sn 256").pid();
    let (soft, hard) = open_files_limits(pid);
    assert_ne!(hard, "256", "the test needs a hard limit above 256");
    assert_eq!(soft, hard, "the proxy took the descriptors the operator allows");
    assert!(d.proxy().log_contains("raised the soft limit on open files"));
}

#[tokio::test]
async fn the_log_says_which_version_starts_and_shows_no_debug_formatting() {
    let mut d = Deployment::builder().build().await;
    d.start();
    let start = d.proxy().log_lines("fencegate starting");
    assert!(start.iter().any(|l| l.contains(&format!("version={}", env!("CARGO_PKG_VERSION")))), "{start:?}");
    let recovered = d.proxy().log_lines("fence store recovered");
    assert!(recovered.iter().all(|l| !l.contains("None") && !l.contains("Some(")), "{recovered:?}");
}
