//! An open-loop load generator for `benches/load.sh`: requests at a fixed rate, whatever the
//! server's latency, each one's latency measured from the moment it was due to be sent, so a
//! server that stalls is charged for every request the stall held up (no coordinated
//! omission). wrk's closed loop sends the next request only when the last answer is in, which
//! hides a stall behind the requests it never sent.
//!
//! Request `i` is due at `start + i / rate`; a thread keeps the schedule (the runtime's timer
//! ticks in milliseconds) and hands each request, when due, to the first of `conns`
//! connections that is free. A request due while all are busy waits for one, and its latency
//! includes the wait. Nothing is sent ahead of schedule.
//!
//! ```text
//! open_loop URL RATE SECONDS CONNS [put|get]
//! ```
//!
//! `put` sends `PUT URL/put/r{i mod 1000}` with 100 bytes and `Fencing-Token: base + i`
//! (the base from the clock, so tokens climb across runs), as `benches/load.sh`'s wrk script
//! does; `get` sends `GET URL`. It prints one line: `sent ok non2xx errors rate_achieved p50_us
//! p90_us p99_us max_us queued_us_p50 pacer_late_us_p50`. Latencies are of the 2xx answers
//! only (a fast refusal would pull them down); `queued` is how long requests waited, from
//! their due time, for a free connection (near 0 while `conns` exceed what is in flight);
//! `pacer_late` is how late the schedule itself ran (the thread's sleep and hand-off, charged
//! to every target alike).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What one connection measured, in µs: each 2xx answer's latency from its due time, and
/// each request's wait from its due time for a free connection; and the counts.
#[derive(Default)]
struct Measured {
    latency: Vec<u64>,
    queued: Vec<u64>,
    ok: u64,
    non2xx: u64,
    errors: u64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        eprintln!("usage: open_loop URL RATE SECONDS CONNS [put|get]");
        std::process::exit(2);
    }
    let url: hyper::Uri = args[1].parse()?;
    let rate: f64 = args[2].parse()?;
    let seconds: f64 = args[3].parse()?;
    let conns: u64 = args[4].parse()?;
    let put = args.get(5).is_none_or(|w| w == "put");
    let authority = url.authority().ok_or("the URL needs host:port")?.to_string();
    let base_path = url.path().trim_end_matches('/').to_owned();
    let total = (rate * seconds) as u64;
    let token_base = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() * 1_000_000;
    let start = Instant::now() + Duration::from_millis(50);

    // The schedule is kept by a thread of its own: the runtime's timer ticks in milliseconds,
    // which would send most requests up to a millisecond late; a thread's sleep is precise to
    // tens of microseconds.
    let (due_tx, due_rx) = tokio::sync::mpsc::unbounded_channel::<(u64, Instant)>();
    let pacer = std::thread::spawn(move || {
        let mut late = Vec::with_capacity(total as usize);
        for i in 0..total {
            let due = start + Duration::from_secs_f64(i as f64 / rate);
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            late.push(Instant::now().saturating_duration_since(due).as_micros() as u64);
            if due_tx.send((i, due)).is_err() {
                break;
            }
        }
        late
    });
    // Every connection takes the next request due: a request waits only while all are busy.
    let due_rx = std::sync::Arc::new(tokio::sync::Mutex::new(due_rx));
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let (authority, base_path, due_rx) = (authority.clone(), base_path.clone(), due_rx.clone());
        tasks.push(tokio::spawn(async move {
            let mut m = Measured::default();
            let mut sender = None;
            loop {
                let Some((i, due)) = due_rx.lock().await.recv().await else {
                    return m;
                };
                m.queued.push(Instant::now().saturating_duration_since(due).as_micros() as u64);
                // A connection the server closed is replaced before the request goes out.
                if sender.as_ref().is_none_or(|s: &http1::SendRequest<Full<Bytes>>| s.is_closed()) {
                    sender = connect(&authority).await.ok();
                }
                let outcome = match sender.as_mut() {
                    Some(s) => exchange(s, &authority, &base_path, put, i, token_base).await,
                    None => Err("connect failed".into()),
                };
                match outcome {
                    Ok(status) if (200..300).contains(&status) => {
                        m.ok += 1;
                        m.latency.push(Instant::now().saturating_duration_since(due).as_micros() as u64);
                    }
                    Ok(_) => m.non2xx += 1,
                    Err(_) => {
                        m.errors += 1;
                        sender = None;
                    }
                }
            }
        }));
    }
    let mut all = Measured::default();
    for t in tasks {
        let m = t.await?;
        all.latency.extend(m.latency);
        all.queued.extend(m.queued);
        all.ok += m.ok;
        all.non2xx += m.non2xx;
        all.errors += m.errors;
    }
    let mut pacer_late = pacer.join().map_err(|_| "the pacer thread panicked")?;
    let elapsed = start.elapsed().as_secs_f64();
    let sent = all.queued.len();
    all.latency.sort_unstable();
    all.queued.sort_unstable();
    pacer_late.sort_unstable();
    let q =
        |v: &[u64], p: f64| v.get(((v.len() as f64 * p) as usize).min(v.len().saturating_sub(1))).copied().unwrap_or(0);
    println!(
        "{} {} {} {} {:.0} {} {} {} {} {} {}",
        sent,
        all.ok,
        all.non2xx,
        all.errors,
        sent as f64 / elapsed,
        q(&all.latency, 0.50),
        q(&all.latency, 0.90),
        q(&all.latency, 0.99),
        all.latency.last().copied().unwrap_or(0),
        q(&all.queued, 0.50),
        q(&pacer_late, 0.50),
    );
    Ok(())
}

async fn connect(authority: &str) -> Result<http1::SendRequest<Full<Bytes>>, BoxError> {
    let tcp = TcpStream::connect(authority).await?;
    tcp.set_nodelay(true)?;
    let (sender, conn) = http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

/// Sends request `i` and reads its whole response; the status.
async fn exchange(
    sender: &mut http1::SendRequest<Full<Bytes>>,
    authority: &str,
    base_path: &str,
    put: bool,
    i: u64,
    token_base: u64,
) -> Result<u16, BoxError> {
    sender.ready().await?;
    let req = if put {
        hyper::Request::put(format!("{base_path}/put/r{}", i % 1000))
            .header("host", authority)
            .header("fencing-token", (token_base + i).to_string())
            .body(Full::new(Bytes::from_static(&[b'v'; 100])))?
    } else {
        hyper::Request::get(if base_path.is_empty() { "/" } else { base_path })
            .header("host", authority)
            .body(Full::new(Bytes::new()))?
    };
    let resp = sender.send_request(req).await?;
    let status = resp.status().as_u16();
    resp.into_body().collect().await?;
    Ok(status)
}
