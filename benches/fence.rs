//! Micro benchmarks of the fence path: token parse, canonicalisation, in-memory
//! check-and-reserve (uncontended and with N tasks), and the store's durable advance with N
//! concurrent writers (group commit).
//!
//! Run: `cargo bench --bench fence` (add `-- store` etc. to filter).

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fencegate::config::{EqualToken, SyncMode};
use fencegate::fence::FenceTable;
use fencegate::path;
use fencegate::store::{FileStore, Store};

fn parsing(c: &mut Criterion) {
    c.bench_function("token_parse", |b| b.iter(|| fencegate::token::parse(black_box(b"18446744073709551615"))));
    let mut g = c.benchmark_group("canonicalize");
    for p in ["/accounts/42", "/buckets/b1/objects/2024/11/30/report.csv", "//a/./b/%2e%2e/c/%7Euser"] {
        g.bench_with_input(BenchmarkId::from_parameter(p), p, |b, p| b.iter(|| path::canonicalize(black_box(p))));
    }
    g.finish();
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// One full in-memory fenced write: precheck, turn, check, record, release.
async fn reserve(table: &Arc<FenceTable>, key: &str, token: u64) {
    table.precheck(key, token).unwrap();
    let mut turn = table.acquire(key, Duration::from_secs(10)).await.unwrap();
    if turn.check(token).is_ok() {
        turn.record(token);
    }
}

fn check_and_reserve(c: &mut Criterion) {
    let rt = rt();
    let mut g = c.benchmark_group("check_and_reserve");
    g.throughput(Throughput::Elements(1));
    g.bench_function("uncontended", |b| {
        let table = Arc::new(FenceTable::new([], EqualToken::Reject));
        let mut token = 0;
        b.iter(|| {
            token += 1;
            rt.block_on(reserve(&table, "/accounts/42", token))
        })
    });
    for tasks in [2u64, 8, 64] {
        for shared_key in [true, false] {
            let name = if shared_key { "one_key" } else { "distinct_keys" };
            g.bench_function(BenchmarkId::new(name, tasks), |b| {
                b.iter_custom(|iters| {
                    let table = Arc::new(FenceTable::new([], EqualToken::Accept));
                    let per_task = iters.div_ceil(tasks);
                    let start = Instant::now();
                    rt.block_on(async {
                        let handles: Vec<_> = (0..tasks)
                            .map(|t| {
                                let table = Arc::clone(&table);
                                let key = if shared_key { "/hot".to_string() } else { format!("/k{t}") };
                                tokio::spawn(async move {
                                    for i in 0..per_task {
                                        // Equal tokens are accepted here so contention is real work.
                                        reserve(&table, &key, i / tasks).await;
                                    }
                                })
                            })
                            .collect();
                        for h in handles {
                            h.await.unwrap();
                        }
                    });
                    start.elapsed()
                })
            });
        }
    }
    g.finish();
}

fn durable_advance(c: &mut Criterion) {
    let rt = rt();
    let mut g = c.benchmark_group("store_advance_fsync");
    g.sample_size(10).measurement_time(Duration::from_secs(5));
    g.throughput(Throughput::Elements(1));
    for writers in [1u64, 16, 64, 256] {
        g.bench_function(BenchmarkId::from_parameter(writers), |b| {
            let dir = tempfile::tempdir().unwrap();
            let (store, _) = FileStore::open(dir.path(), SyncMode::Always).unwrap();
            let store = Arc::new(store);
            b.iter_custom(|iters| {
                let per_writer = iters.div_ceil(writers);
                let start = Instant::now();
                rt.block_on(async {
                    let handles: Vec<_> = (0..writers)
                        .map(|w| {
                            let store = Arc::clone(&store);
                            tokio::spawn(async move {
                                let key = format!("/resource/{w:08}");
                                for t in 0..per_writer {
                                    store.advance(&key, t).await.unwrap();
                                }
                            })
                        })
                        .collect();
                    for h in handles {
                        h.await.unwrap();
                    }
                });
                // Normalise to the requested iteration count so figures are per advance.
                start.elapsed().mul_f64(iters as f64 / (per_writer * writers) as f64)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, parsing, check_and_reserve, durable_advance);
criterion_main!(benches);
