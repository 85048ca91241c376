//! `fencegate demo`: the canonical zombie race, replayed over real HTTP on loopback.
//!
//! One process starts a dumb in-memory store, puts fencegate in front of it with a temporary
//! data dir (initialised as `fencegate init` does), lets two clients race for one resource,
//! then restarts the proxy on the same dir to show that what it learned survived. Every step
//! is checked, not just printed.

use std::io::Write;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;

use crate::app::Error;
use crate::config::Config;
pub use backend::{DELAY_HEADER, MemBackend, Received};

mod backend;
use crate::app::Proxy;

const RESOURCE: &str = "/accounts/42";

struct Running {
    proxy: Proxy,
    url: String,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), Error>>,
}

async fn start(config: &Config) -> Result<Running, Error> {
    let proxy = Proxy::open(config.clone()).await?;
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(proxy.clone().serve(listener, async {
        let _ = stopped.await;
    }));
    Ok(Running { proxy, url, stop, task })
}

impl Running {
    async fn stop(self) -> Result<(), Error> {
        let _ = self.stop.send(());
        self.task.await.map_err(|e| Error::Io(std::io::Error::other(e)))?
    }
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn put(client: &HttpClient, base: &str, token: u64, body: &str) -> Result<(StatusCode, String), Error> {
    let req = Request::builder()
        .method(Method::PUT)
        .uri(format!("{base}{RESOURCE}"))
        .header("fencing-token", token)
        .body(Full::new(Bytes::from(body.to_owned())))
        .map_err(|e| Error::Io(std::io::Error::other(e)))?;
    let resp = client.request(req).await.map_err(|e| Error::Io(std::io::Error::other(e)))?;
    let status = resp.status();
    let code = resp.headers().get("fencegate-error").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let _ = resp.into_body().collect().await;
    Ok((status, code))
}

/// Tracks whether every step went as the fencing pattern says it must.
struct Checker<'a, W: Write> {
    out: &'a mut W,
    all_ok: bool,
}

impl<W: Write> Checker<'_, W> {
    fn line(&mut self, text: &str) -> std::io::Result<()> {
        writeln!(self.out, "{text}")
    }

    #[allow(clippy::too_many_arguments)]
    fn write_step(
        &mut self,
        t: &str,
        who: &str,
        token: u64,
        got: (StatusCode, String),
        want: StatusCode,
        max_seen: Option<u64>,
        verdict: &str,
    ) -> std::io::Result<()> {
        let ok = got.0 == want;
        self.all_ok &= ok;
        let status = format!("{} {}", got.0.as_u16(), got.0.canonical_reason().unwrap_or(""));
        let max = max_seen.map_or("none".into(), |m| m.to_string());
        let mark = if ok { "" } else { "   <-- UNEXPECTED" };
        writeln!(
            self.out,
            "{t:<4}{who} PUT {RESOURCE} token={token:<3} -> {status:<14} max_seen = {max:<4} {verdict}{}{mark}",
            if got.1.is_empty() { String::new() } else { format!(" [{}]", got.1) }
        )
    }
}

/// Runs the demo, printing to `out`. Returns whether every step behaved as expected.
pub async fn run(out: &mut impl Write) -> Result<bool, Error> {
    let backend = MemBackend::start().await?;
    let dir = DataDir::create()?;
    // A new deployment's data dir, as `fencegate init --dir D` makes it: the proxy refuses an
    // empty one, which could be a lost one.
    crate::app::init_data_dir(dir.path(), 0)?;
    let config = Config::from_toml_str(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[backend]\nurl = \"{}\"\n[store]\ndir = {:?}\n",
        backend.url(),
        dir.path().display().to_string()
    ))?;
    let proxy = start(&config).await?;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let mut c = Checker { out, all_ok: true };

    c.line("fencegate demo: a zombie lock holder against a fenced backend, over real HTTP\n")?;
    c.line(&format!("  backend  {}  an in-memory object store that knows nothing of tokens", backend.url()))?;
    c.line(&format!(
        "  proxy    {}  fencegate, data dir {} (made by fencegate init)\n",
        proxy.url,
        dir.path().display()
    ))?;

    // The lock service: every acquire returns a strictly larger token.
    let mut next_token = 33u64;
    let mut acquire = || {
        next_token += 1;
        next_token - 1
    };
    let t1 = acquire();
    c.line(&format!("t0  Client1 acquires the lock -> token {t1}   (max_seen = none)"))?;
    c.line("t1  Client1 pauses: a stop-the-world GC outlives its lease")?;
    let wake = Arc::new(Notify::new());
    let zombie = {
        let (wake, client, url) = (Arc::clone(&wake), client.clone(), proxy.url.clone());
        tokio::spawn(async move {
            wake.notified().await;
            put(&client, &url, t1, "balance=0   (client1, stale)").await
        })
    };
    c.line(&format!("t2  lease({t1}) expires; the lock service moves on"))?;
    let t2 = acquire();
    c.line(&format!("t3  Client2 acquires the lock -> token {t2}"))?;
    let got = put(&client, &proxy.url, t2, "balance=200 (client2)").await?;
    c.write_step("t4", "Client2", t2, got, StatusCode::OK, proxy.proxy.max_seen(RESOURCE), "ACCEPT")?;
    c.line("t5  Client1 wakes up, still believing it holds the lock")?;
    wake.notify_one();
    let got = zombie.await.map_err(|e| Error::Io(std::io::Error::other(e)))??;
    let max = proxy.proxy.max_seen(RESOURCE);
    c.write_step("t6", "Client1", t1, got, StatusCode::CONFLICT, max, &format!("REJECT ({t1} <= {t2})"))?;

    c.line("\nbackend contents:")?;
    for (path, body) in backend.objects() {
        c.line(&format!("  {path} = {:?}", String::from_utf8_lossy(&body)))?;
    }
    let applied: Vec<_> = backend.applied().iter().filter_map(|r| r.token()).collect();
    c.line(&format!("  writes the backend applied, by token: {applied:?}"))?;
    let contents_ok = backend.object(RESOURCE).is_some_and(|b| b.starts_with(b"balance=200")) && applied == [t2];
    c.all_ok &= contents_ok;
    if !contents_ok {
        c.line("  <-- UNEXPECTED: the backend should hold only Client2's write")?;
    }

    proxy.stop().await?;
    c.line(&format!("\nrestart: the proxy stops; a new one recovers max_seen from {}", dir.path().display()))?;
    let proxy = start(&config).await?;
    for (who, token) in [("Client1", t1), ("Client2", t2)] {
        let got = put(&client, &proxy.url, token, "replayed after restart").await?;
        let max = proxy.proxy.max_seen(RESOURCE);
        let verdict = if token == t2 { "REJECT (equal is not above)" } else { "REJECT" };
        c.write_step("", who, token, got, StatusCode::CONFLICT, max, verdict)?;
    }
    let survived = proxy.proxy.max_seen(RESOURCE) == Some(t2) && backend.applied().len() == 1;
    c.all_ok &= survived;
    proxy.stop().await?;

    if c.all_ok {
        c.line("\nresult: the zombie's write never reached the backend, and the fence survived a restart.")?;
    } else {
        c.line("\nresult: FAILED: some step did not behave as the fencing pattern requires.")?;
    }
    Ok(c.all_ok)
}

/// The demo's data directory: a fresh one under the system's temporary directory, removed
/// when the demo ends.
struct DataDir(std::path::PathBuf);

impl DataDir {
    fn create() -> std::io::Result<Self> {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let path = std::env::temp_dir().join(format!("fencegate-demo-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&path)?;
        Ok(DataDir(path))
    }

    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
