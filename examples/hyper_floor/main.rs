//! The least a hyper 1.x reverse proxy does per request, to measure fencegate's own cost
//! against: HTTP/1 in, one pooled HTTP/1 connection out, on one current-thread runtime with
//! mimalloc and TCP_NODELAY, like `fencegate run`. Everything else fencegate does counts as
//! fencegate's share: fencing, limits and timeouts (hyper's header-read timer, the backend
//! timeout), HTTP/2 detection, hop-by-hop headers, `X-Forwarded-For`, metrics and logging.
//!
//! Given a file as well, it is about the least a proxy does that makes each write durable
//! before it forwards it: every request but a GET or HEAD appends one record (its path and
//! `Fencing-Token`) to that file and waits for the group commit that covers it (`log.rs`).
//! No check, no table, no answered record: against it, what fencing costs shows, apart from
//! what the sync costs on the disk at hand.
//!
//! `cargo run --release --example hyper_floor -- 127.0.0.1:18084 127.0.0.1:18081 [LOG_FILE]`

mod log;

use std::sync::{Arc, Mutex, mpsc};

use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Idle = Arc<Mutex<Vec<SendRequest<Incoming>>>>;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Sends `req` on an idle connection, or a new one, once its record (if it writes) is durable;
/// an error closes the client's connection.
async fn forward(
    idle: Idle,
    backend: String,
    log: Option<mpsc::Sender<log::Entry>>,
    req: hyper::Request<Incoming>,
) -> Result<hyper::Response<Incoming>, BoxError> {
    if let Some(log) = log.filter(|_| !matches!(*req.method(), hyper::Method::GET | hyper::Method::HEAD)) {
        let mut record = Vec::with_capacity(64);
        record.extend_from_slice(req.uri().path().as_bytes());
        record.push(b' ');
        record.extend_from_slice(req.headers().get("fencing-token").map_or(&b"-"[..], |v| v.as_bytes()));
        record.push(b'\n');
        let (done, durable) = oneshot::channel();
        log.send((record, done))?;
        durable.await?;
    }
    let ready = {
        let mut idle = idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.retain(|s| !s.is_closed());
        idle.iter().rposition(|s| s.is_ready()).map(|i| idle.swap_remove(i))
    };
    let mut sender = match ready {
        Some(s) => s,
        None => {
            let tcp = TcpStream::connect(&backend).await?;
            let _ = tcp.set_nodelay(true);
            let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
            tokio::spawn(conn);
            sender
        }
    };
    let resp = sender.send_request(req).await?;
    idle.lock().unwrap_or_else(|e| e.into_inner()).push(sender);
    Ok(resp)
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (listen, backend, log_path) = match &args[..] {
        [_, listen, backend] => (listen.clone(), backend.clone(), None),
        [_, listen, backend, log] => (listen.clone(), backend.clone(), Some(log.clone())),
        _ => {
            eprintln!("usage: hyper_floor LISTEN BACKEND [LOG_FILE]");
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    // Before it listens, so that a client that connects finds the log ready.
    let log = {
        let _inside = runtime.enter(); // the relay task is spawned on it
        log_path.map(|path| log::open(&path)).transpose()?
    };
    let listener = runtime.block_on(TcpListener::bind(&listen))?;
    runtime.block_on(async move {
        let idle: Idle = Arc::default();
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                // Out of descriptors, say: give connections time to close, as fencegate does.
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let (idle, backend, log) = (Arc::clone(&idle), backend.clone(), log.clone());
            tokio::spawn(async move {
                let service = service_fn(move |req| forward(Arc::clone(&idle), backend.clone(), log.clone(), req));
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tcp), service).await;
            });
        }
    })
}
