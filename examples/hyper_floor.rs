//! The least a hyper 1.x reverse proxy does per request, to measure fencegate's own cost
//! against: HTTP/1 in, one pooled HTTP/1 connection out, on one current-thread runtime with
//! mimalloc and TCP_NODELAY, like `fencegate run`. Everything else fencegate does counts as
//! fencegate's share: fencing, limits and timeouts (hyper's header-read timer, the backend
//! timeout), HTTP/2 detection, hop-by-hop headers, `X-Forwarded-For`, metrics and logging.
//!
//! Given a file as well, it is the least a proxy does that makes each write durable before it
//! forwards it: every request but a GET or HEAD appends one record (its path and
//! `Fencing-Token`) to that file and waits for the group commit that covers it, on a writer
//! thread of its own (one `pwrite` and one `fdatasync` a batch, into zeros written ahead, as
//! fencegate's log does), whose answers come back to the runtime with one wake-up a batch.
//! No check, no table, no answered record: against it, what fencing itself costs shows, apart
//! from what the sync costs on the disk at hand.
//!
//! `cargo run --release --example hyper_floor -- 127.0.0.1:18084 127.0.0.1:18081 [LOG_FILE]`

use std::fs::File;
use std::os::unix::fs::FileExt;
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

/// A record to make durable, and whom to tell once it is.
type Entry = (Vec<u8>, oneshot::Sender<()>);

/// A batch's answers, for the relay task to send.
type Answers = tokio::sync::mpsc::UnboundedSender<Vec<oneshot::Sender<()>>>;

/// The zeros written ahead of the log; a batch past them starts over at the front, which
/// overwrites in place and so, like the zeros, commits no file size.
const AHEAD: u64 = 64 << 20;

/// Sends `req` on an idle connection, or a new one, once its record (if it writes) is durable;
/// an error closes the client's connection.
async fn forward(
    idle: Idle,
    backend: String,
    log: Option<mpsc::Sender<Entry>>,
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

/// The writer thread: takes what has arrived, writes it in one `pwrite`, syncs it, and hands
/// the batch's answers to the relay task at once.
fn write(file: File, entries: mpsc::Receiver<Entry>, answers: Answers) {
    let (mut offset, mut buf) = (0u64, Vec::new());
    while let Ok(first) = entries.recv() {
        let mut done = Vec::new();
        for (record, tell) in std::iter::once(first).chain(entries.try_iter()) {
            buf.extend_from_slice(&record);
            done.push(tell);
        }
        if offset + buf.len() as u64 > AHEAD {
            offset = 0;
        }
        if let Err(e) = file.write_all_at(&buf, offset).and_then(|()| file.sync_data()) {
            eprintln!("hyper_floor: the log failed: {e}");
            std::process::exit(1);
        }
        offset += buf.len() as u64;
        buf.clear();
        if answers.send(done).is_err() {
            return;
        }
    }
}

/// Opens the log with its zeros written ahead and starts its writer; answers relayed on the
/// current runtime.
fn open_log(path: &str) -> std::io::Result<mpsc::Sender<Entry>> {
    let file = std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(path)?;
    file.write_all_at(&vec![0; AHEAD as usize], 0)?;
    file.sync_all()?;
    let (tx, entries) = mpsc::channel();
    let (answers, mut relayed) = tokio::sync::mpsc::unbounded_channel::<Vec<oneshot::Sender<()>>>();
    std::thread::Builder::new().name("floor-writer".into()).spawn(move || write(file, entries, answers))?;
    tokio::spawn(async move {
        while let Some(batch) = relayed.recv().await {
            for tell in batch {
                let _ = tell.send(());
            }
        }
    });
    Ok(tx)
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
        log_path.map(|path| open_log(&path)).transpose()?
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
