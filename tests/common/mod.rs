//! The shared test harness. Here: the in-process [`Harness`] (a real in-memory backend,
//! fencegate in front of it on port 0, and clients that speak real HTTP over loopback) and the
//! [`Resp`] every helper returns. Beside it: `raw` (raw HTTP/1.1 connections), `backend` (stub
//! backends), `process`, `logs` and `builder` (the real binary, its log, and a deployment of
//! it), `wait` (waiting for a state instead of sleeping), `services`, `etcd_server` and
//! `etcd_cluster` (real etcd and ZooKeeper for the interop and cluster tests), `disks` (real
//! disk faults: an EIO shim, ext4 the kernel turns read-only), `etcd` (a client of etcd's JSON
//! gateway), `cluster` (several instances sharing a fence in etcd), `netns` (a network of
//! namespaces to partition), `pki` (certificates made at test time),
//! `signing` (key files and signed tokens), `webdav` (a recording WebDAV stub), `apache` (Apache
//! httpd with mod_dav, a backend that honours preconditions) and `relay` (a TCP relay that
//! holds a chosen request and delivers it late).
//!
//! The test binaries `proxy`, `store` and `cluster` include it as their module `common`; each
//! uses its own part of it.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use fencegate::Config;
use fencegate::app::Proxy;
use fencegate::demo::MemBackend;
use http::{HeaderMap, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use fencegate::demo::DELAY_HEADER;

pub mod apache;
pub mod backend;
pub mod builder;
pub mod cluster;
pub mod disks;
pub mod envoy;
pub mod etcd;
pub mod etcd_cluster;
pub mod etcd_server;
pub mod grpc_relay;
pub mod logs;
pub mod netns;
pub mod nginx;
pub mod pki;
pub mod process;
pub mod raw;
pub mod relay;
pub mod rng;
pub mod s3;
pub mod services;
pub mod signing;
pub mod skips;
pub mod wait;
pub mod webdav;

// Each test binary uses its own part of these.
#[allow(unused_imports)]
pub use raw::{RawConn, dead_address, raw_request, try_raw_request};
#[allow(unused_imports)]
pub use wait::{eventually, past_quarantine, poll_until};

/// A response, fully read.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    /// The `fencegate-error` header: present only on responses fencegate made itself.
    pub fn fencegate_error(&self) -> Option<&str> {
        self.headers.get("fencegate-error").map(|v| v.to_str().unwrap())
    }

    /// Asserts a response fencegate made itself: status, JSON `error` code and header agree.
    pub fn assert_refused(&self, status: u16, code: &str) {
        assert_eq!(self.status, status, "body: {:?}", self.body);
        assert_eq!(self.fencegate_error(), Some(code), "header of {:?}", self.body);
        assert_eq!(self.json()["error"], code);
    }
}

/// Opens the proxy for `config` once its data directory's lock is free. Another test thread
/// that spawns a process (nginx, moto, boto3) between `fork` and `exec` holds a copy of every
/// descriptor open at that moment, a just-released lock file's too, for that instant: a real
/// proxy spawns nothing, so only tests wait for it.
pub async fn open_proxy(config: Config) -> Proxy {
    for _ in 0..1_000 {
        match Proxy::open(config.clone()).await {
            Err(fencegate::Error::Store(fencegate::store::StoreError::Locked { .. })) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            other => return other.unwrap(),
        }
    }
    panic!("{} stayed locked", config.store.dir.display());
}

/// The minimal config for a proxy in front of `backend_url` with data in `dir`.
pub fn config_for(backend_url: &str, dir: &std::path::Path) -> Config {
    Config::from_toml_str(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[backend]\nurl = \"{backend_url}\"\n[store]\ndir = {:?}\n",
        dir.display().to_string()
    ))
    .expect("harness config is valid")
}

pub struct Harness {
    pub backend: MemBackend,
    pub addr: SocketAddr,
    pub proxy: Proxy,
    pub dir: tempfile::TempDir,
    pub config: Config,
    client: Client<HttpConnector, Full<Bytes>>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), fencegate::Error>>>,
}

impl Harness {
    /// Backend plus proxy with the default configuration.
    pub async fn start() -> Harness {
        Harness::start_with(|_| {}).await
    }

    /// Backend plus proxy, with `tweak` applied to the configuration first. The data dir is
    /// initialised (`fencegate init`, floor 0) before the proxy opens it.
    pub async fn start_with(tweak: impl FnOnce(&mut Config)) -> Harness {
        Harness::start_with_floor(0, tweak).await
    }

    /// Like [`Harness::start_with`], on a data dir initialised with `floor`
    /// (`fencegate init --floor`).
    pub async fn start_with_floor(floor: u64, tweak: impl FnOnce(&mut Config)) -> Harness {
        let backend = MemBackend::start().await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let mut config = config_for(&backend.url(), dir.path());
        tweak(&mut config);
        fencegate::app::init_data_dir(&config.store.dir, floor).unwrap();
        let mut h = Harness {
            backend,
            addr: "127.0.0.1:0".parse().unwrap(),
            proxy: open_proxy(config.clone()).await,
            dir,
            config,
            client: Client::builder(TokioExecutor::new()).build_http(),
            stop: None,
            task: None,
        };
        h.serve().await;
        h
    }

    async fn serve(&mut self) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        self.addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        self.stop = Some(stop);
        self.task = Some(tokio::spawn(self.proxy.clone().serve(listener, async {
            let _ = stopped.await;
        })));
    }

    /// Stops the proxy (graceful), then opens a new one on the same data dir and backend.
    pub async fn restart(&mut self) {
        self.shutdown().await;
        self.proxy = open_proxy(self.config.clone()).await;
        self.serve().await;
    }

    /// Graceful shutdown; returns once the store is closed.
    pub async fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap().unwrap();
        }
    }

    /// Starts the admin API on a loopback port of its own, on its own thread and runtime as
    /// `fencegate run` does; it runs until the test ends.
    pub async fn start_admin(&self) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        self.proxy.serve_admin(listener, std::future::pending()).unwrap();
        addr
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Sends a request through the proxy with the given headers.
    pub async fn send(&self, method: &str, path: &str, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Resp {
        self.send_to(self.addr, method, path, headers, body).await
    }

    /// Sends a request to `addr` (a proxy in front of this one: Envoy) with the given headers.
    pub async fn send_to(
        &self,
        addr: SocketAddr,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Resp {
        let url = format!("http://{addr}{path}");
        let mut req = Request::builder().method(Method::from_bytes(method.as_bytes()).unwrap()).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        send_with(&self.client, req.body(Full::new(body.into())).unwrap()).await
    }

    /// A fenced PUT with `token` in the default header.
    pub async fn put(&self, path: &str, token: u64, body: &str) -> Resp {
        self.send("PUT", path, &[("fencing-token", &token.to_string())], body.to_owned()).await
    }

    /// A fenced PUT that the backend holds for `delay_ms` before applying.
    pub async fn slow_put(&self, path: &str, token: u64, delay_ms: u64) -> Resp {
        let token = token.to_string();
        let delay = delay_ms.to_string();
        self.send("PUT", path, &[("fencing-token", &token), (DELAY_HEADER, &delay)], token.clone()).await
    }

    pub async fn get(&self, path: &str) -> Resp {
        self.send("GET", path, &[], Bytes::new()).await
    }

    /// Writes `head` (request line and headers, without the blank line) plus `body` on a fresh
    /// connection, exactly as given, and reads the whole response.
    pub async fn raw(&self, head: &str, body: &str) -> Resp {
        raw_request(self.addr, head, body).await
    }

    /// Waits until the backend has received the write of `token` to `path`. Its advance was
    /// durable before it was forwarded, so `max_seen` already counts it.
    pub async fn wait_received(&self, path: &str, token: u64) {
        let what = format!("the backend receives {path} with token {token}");
        poll_until(&what, || self.backend.requests().iter().any(|r| r.path == path && r.token() == Some(token))).await
    }

    /// Waits until `n` writes hold or wait for the turn of the resource `key`.
    pub async fn wait_queue_len(&self, key: &str, n: usize) {
        let what = format!("{n} writes hold or wait for the turn of {key}");
        poll_until(&what, || self.proxy.queue_len(key) == n).await
    }

    /// Tokens the backend applied to `path`, in the order it applied them.
    pub fn applied_tokens(&self, path: &str) -> Vec<u64> {
        self.backend.applied().iter().filter(|r| r.path == path).filter_map(|r| r.token()).collect()
    }
}

/// A pooling HTTP/1.1 client, as the harness uses.
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// Sends a request to `addr` with `client`, with the given headers.
pub async fn send_headers(
    client: &Client<HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: impl Into<Bytes>,
) -> Resp {
    let url = format!("http://{addr}{path}");
    let mut req = Request::builder().method(Method::from_bytes(method.as_bytes()).unwrap()).uri(url);
    for (k, v) in headers {
        req = req.header(k, v);
    }
    send_with(client, req.body(Full::new(body.into())).unwrap()).await
}

pub async fn send_with(client: &Client<HttpConnector, Full<Bytes>>, req: Request<Full<Bytes>>) -> Resp {
    let resp = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .expect("response within 30 s")
        .expect("HTTP exchange");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Resp { status, headers, body }
}
