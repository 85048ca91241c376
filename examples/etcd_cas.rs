//! The baseline of benches/cluster.sh: what fencing every write with its own etcd transaction
//! costs, the per-write design docs/cluster.md rejected. CONNS clients, each in a loop, raise
//! one of 1,000 keys with `If(value(k) < token) Then(put k = token)` (created first if absent),
//! for SECONDS; it prints the committed transactions per second and their p50 and p99.
//!
//!     cargo run --release --example etcd_cas -- http://127.0.0.1:2379[,URL...] CONNS SECONDS

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fencegate::etcd_client::{Client, Compare, Op};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(urls), Some(conns), Some(secs)) = (args.get(1), args.get(2), args.get(3)) else {
        eprintln!("usage: etcd_cas URL[,URL...] CONNS SECONDS");
        std::process::exit(2);
    };
    let endpoints: Vec<String> = urls.split(',').map(str::to_owned).collect();
    let conns: usize = conns.parse().expect("CONNS is a number");
    let secs: u64 = secs.parse().expect("SECONDS is a number");
    let client = Client::new(&endpoints, Duration::from_secs(5));
    let counter = Arc::new(AtomicU64::new(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64),
    ));
    let until = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let (client, counter) = (client.clone(), Arc::clone(&counter));
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut failed = 0u64;
            while Instant::now() < until {
                let token = counter.fetch_add(1, Ordering::Relaxed);
                let key = format!("/bench-cas/k/r{}", token % 1000).into_bytes();
                let value = format!("{token:020}").into_bytes();
                let put = [Op::Put { key: key.clone(), value: value.clone(), lease: 0 }];
                let started = Instant::now();
                let lower = client.txn(&[Compare::ValueLess(key.clone(), value.clone())], &put, &[]).await;
                let done = match lower {
                    Ok(r) if r.succeeded => true,
                    // Absent (a value compare on a missing key fails): create it.
                    Ok(_) => client.txn(&[Compare::CreateRevision(key, 0)], &put, &[]).await.is_ok_and(|r| r.succeeded),
                    Err(_) => false,
                };
                match done {
                    true => latencies.push(started.elapsed()),
                    false => failed += 1,
                }
            }
            (latencies, failed)
        }));
    }
    let mut all = Vec::new();
    let mut failed = 0;
    for t in tasks {
        let (l, f) = t.await.expect("a client task");
        all.extend(l);
        failed += f;
    }
    all.sort();
    let at = |q: f64| {
        all.get(((all.len() as f64 * q) as usize).min(all.len().saturating_sub(1))).copied().unwrap_or_default()
    };
    // The same columns as wrk's summary in the benchmark scripts: req/s, p50 and p99 in µs, failures.
    println!("{:.0} {} {} {}", all.len() as f64 / secs as f64, at(0.50).as_micros(), at(0.99).as_micros(), failed);
}
