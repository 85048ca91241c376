//! Unix sockets on both sides: a backend at `unix:/path` (nginx listening on one), the proxy's
//! and the admin API's listeners on one with their `listen_mode`, what binding does with a
//! file already at the path, and `listen = "localhost:PORT"`.

use crate::common;

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use fencegate::Config;
use fencegate::app::{Listener, Proxy, bind};
use fencegate::config::ListenAddr;
use fencegate::demo::MemBackend;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use common::nginx::start_nginx_unix;
use common::{Resp, config_for};

/// One request on a new connection to the Unix socket at `socket`.
async fn over_unix(socket: &Path, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    let stream = UnixStream::connect(socket).await.unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(conn);
    let mut req = Request::builder().method(method).uri(path).header("host", "fencegate.test");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = sender.send_request(req.body(Full::new(Bytes::from(body.to_owned()))).unwrap()).await.unwrap();
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Resp { status, headers, body }
}

async fn put(socket: &Path, path: &str, token: u64) -> Resp {
    over_unix(socket, "PUT", path, &[("fencing-token", &token.to_string())], &format!("t{token}")).await
}

/// A proxy served in-process on `listener` until [`Served::stop`].
struct Served {
    proxy: Proxy,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), fencegate::Error>>,
}

impl Served {
    /// Opens a proxy for `config` (its data dir initialised first) and serves it, with its admin
    /// API if `admin.listen` is set, as `fencegate run` does.
    async fn start(config: Config, listener: impl Into<Listener>) -> Served {
        fencegate::app::init_data_dir(&config.store.dir, 0).unwrap();
        let proxy = Proxy::open(config).await.unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(proxy.clone().run(listener.into(), async {
            let _ = stopped.await;
        }));
        Served { proxy, stop, task }
    }

    /// Graceful shutdown, as on SIGTERM.
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

fn socket_in(dir: &tempfile::TempDir, name: &str) -> PathBuf {
    dir.path().join(name)
}

/// The permission bits of the file at `path`, which must be a socket.
fn socket_mode(path: &Path) -> u32 {
    let meta = std::fs::symlink_metadata(path).unwrap();
    assert!(meta.file_type().is_socket(), "{} is not a socket", path.display());
    meta.permissions().mode() & 0o777
}

#[tokio::test]
async fn fenced_writes_reach_nginx_on_a_unix_socket_through_a_unix_listener() {
    let Some(nginx) = start_nginx_unix().await else { return };
    let backend = nginx.socket.clone().unwrap();
    let (dir, sockets) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut config = config_for(&format!("unix:{}", backend.display()), dir.path());
    let listen = socket_in(&sockets, "fg.sock");
    config.server.listen = ListenAddr::Unix(listen.clone());
    let listener = bind("server.listen", &config.server.listen, 0o600).await.unwrap();
    let served = Served::start(config, listener).await;

    assert_eq!(put(&listen, "/dav/doc.txt", 3).await.status, 201, "created in nginx's root");
    // t0..t6 in order: up to the level (3, equal counts as stale) refused, then each one higher
    // accepted.
    for token in 0..=6 {
        let r = put(&listen, "/dav/doc.txt", token).await;
        match token {
            0..=3 => r.assert_refused(409, "stale_token"),
            _ => assert_eq!(r.status, 204, "t{token} replaces the file: {:?}", r.body),
        }
    }
    put(&listen, "/dav/doc.txt", 5).await.assert_refused(409, "stale_token");
    assert_eq!(std::fs::read_to_string(nginx.root.join("dav/doc.txt")).unwrap(), "t6", "only accepted writes landed");
    let got = over_unix(&listen, "GET", "/dav/doc.txt", &[], "").await;
    assert_eq!((got.status, &got.body[..]), (200, &b"t6"[..]), "reads pass through the socket too");
    assert_eq!(served.proxy.max_seen("/dav/doc.txt"), Some(6));
    served.stop().await;
}

#[tokio::test]
async fn a_unix_listener_gets_its_mode_and_its_file_goes_at_shutdown() {
    let backend = MemBackend::start().await.unwrap();
    let (dir, sockets) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let listen = socket_in(&sockets, "fg.sock");
    let text = format!(
        "[server]\nlisten = \"unix:{}\"\nlisten_mode = \"0640\"\n[backend]\nurl = \"{}\"\n[store]\ndir = {:?}\n",
        listen.display(),
        backend.url(),
        dir.path().display().to_string()
    );
    let config = Config::from_toml_str(&text).unwrap();
    assert_eq!(config.server.listen_mode, 0o640);
    let listener = bind("server.listen", &config.server.listen, config.server.listen_mode).await.unwrap();
    assert_eq!(socket_mode(&listen), 0o640, "listen_mode is applied to the socket file");
    let served = Served::start(config, listener).await;
    assert_eq!(put(&listen, "/doc", 1).await.status, 200);
    assert_eq!(backend.object("/doc").unwrap(), "t1");
    served.stop().await;
    assert!(!listen.exists(), "a clean shutdown removes the socket file");
}

#[tokio::test]
async fn a_stale_socket_file_nobody_accepts_on_is_replaced() {
    let sockets = tempfile::tempdir().unwrap();
    let at = |name: &str| ListenAddr::Unix(socket_in(&sockets, name));

    // Left behind by a process that did not remove it: nobody accepts on it.
    let stale = socket_in(&sockets, "stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let listener = bind("server.listen", &at("stale.sock"), 0o660).await.unwrap();
    assert!(UnixStream::connect(&stale).await.is_ok(), "bound anew on the stale path");
    drop(listener);
}

#[tokio::test]
async fn a_socket_another_server_accepts_on_is_refused() {
    let sockets = tempfile::tempdir().unwrap();
    let at = |name: &str| ListenAddr::Unix(socket_in(&sockets, name));
    let live = socket_in(&sockets, "live.sock");
    let other = tokio::net::UnixListener::bind(&live).unwrap();
    let e = bind("server.listen", &at("live.sock"), 0o660).await.unwrap_err().to_string();
    assert!(e.contains("server.listen") && e.contains("another server is accepting"), "{e}");
    let (client, accepted) = tokio::join!(UnixStream::connect(&live), other.accept());
    assert!(client.is_ok() && accepted.is_ok(), "the other server keeps its socket");
}

#[tokio::test]
async fn a_file_that_is_not_a_socket_is_refused_and_kept() {
    let sockets = tempfile::tempdir().unwrap();
    let at = |name: &str| ListenAddr::Unix(socket_in(&sockets, name));
    let file = socket_in(&sockets, "data.txt");
    std::fs::write(&file, "keep me").unwrap();
    let e = bind("server.listen", &at("data.txt"), 0o660).await.unwrap_err().to_string();
    assert!(e.contains("is not a socket"), "{e}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
}

#[tokio::test]
async fn the_admin_api_listens_on_a_unix_socket() {
    let backend = MemBackend::start().await.unwrap();
    let (dir, sockets) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let admin = socket_in(&sockets, "admin.sock");
    let mut config = config_for(&backend.url(), dir.path());
    config.admin.listen = Some(ListenAddr::Unix(admin.clone()));
    let proxy_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let served = Served::start(config, proxy_listener).await;
    common::wait::poll_until("the admin socket", || admin.exists()).await;
    assert_eq!(socket_mode(&admin), 0o660, "the default listen_mode");
    let health = over_unix(&admin, "GET", "/healthz", &[], "").await;
    assert_eq!(health.status, 200, "{:?}", health.body);
    served.stop().await;
    assert!(!admin.exists(), "removed when the admin API stops");
}

#[tokio::test]
async fn listen_mode_is_kept_by_a_reload_and_reported() {
    let backend = MemBackend::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = config_for(&backend.url(), dir.path());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let served = Served::start(config.clone(), listener).await;
    let mut changed = config;
    changed.server.listen_mode = 0o600;
    let report = served.proxy.reload(changed).unwrap();
    assert!(report.kept.iter().any(|k| k.starts_with("server.listen_mode")), "{report:?}");
    assert_eq!(served.proxy.config().server.listen_mode, 0o660, "restart-only");
    served.stop().await;
}

#[tokio::test]
async fn localhost_is_bound_on_every_address_it_resolves_to() {
    let backend = MemBackend::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut config = config_for(&backend.url(), dir.path());
    config.server.listen = "localhost:0".parse().unwrap();
    let listener = bind("server.listen", &config.server.listen, 0o660).await.unwrap();
    let addrs = listener.local_addrs();
    let resolved: Vec<_> = tokio::net::lookup_host("localhost:0").await.unwrap().map(|a| a.ip()).collect();
    assert!(!addrs.is_empty() && addrs.iter().all(|a| resolved.contains(&a.ip())), "{addrs:?} vs {resolved:?}");
    assert!(addrs.iter().all(|a| a.port() == addrs[0].port() && a.port() != 0), "one port for all: {addrs:?}");
    let served = Served::start(config, listener).await;
    for addr in &addrs {
        let r = common::raw_request(*addr, "PUT /doc HTTP/1.1\r\nHost: x\r\nfencing-token: 1", "via").await;
        assert!(r.status == 200 || r.status == 409, "{addr}: {}", r.status);
    }
    assert_eq!(backend.object("/doc").unwrap(), "via");
    served.stop().await;
}
