//! Micro benchmarks of the fence path: token parse, canonicalisation, and in-memory
//! check-and-reserve (precheck, wait for the resource's turn, check, release), uncontended and
//! with N tasks on one key or on distinct keys. The store has its own bench (`benches/store.rs`).
//!
//! Run: `cargo bench --bench fence`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fencegate::fence::{EqualToken, Fence, path};
use fencegate::store::{FileStore, StoreOptions, SyncMode};

fn parsing(c: &mut Criterion) {
    c.bench_function("token_parse", |b| b.iter(|| fencegate::fence::token::parse(black_box(b"18446744073709551615"))));
    let mut g = c.benchmark_group("canonicalize");
    for p in ["/accounts/42", "/buckets/b1/objects/2024/11/30/report.csv", "//a/./b/%2e%2e/c/%7Euser"] {
        g.bench_with_input(BenchmarkId::from_parameter(p), p, |b, p| {
            b.iter(|| path::canonicalize(black_box(p), &path::PathPolicy::default()))
        });
    }
    g.finish();
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// The in-memory part of a fenced write: precheck, wait for the turn, check, release.
async fn reserve(table: &Arc<Fence>, key: &str, token: u64, equal: EqualToken) {
    table.precheck(key, token, equal).unwrap();
    let mut turn = table.acquire(key, Duration::from_secs(10)).await.unwrap();
    black_box(turn.check(token, equal)).unwrap();
}

/// A fence over a real store (never synced: only the in-memory part is measured here), and
/// its directory, removed when dropped.
fn fence_table(rt: &tokio::runtime::Runtime) -> (Arc<Fence>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let options = StoreOptions { sync: SyncMode::Never, ..StoreOptions::default() };
    let store = rt.block_on(async { FileStore::open(dir.path(), options) }).unwrap();
    (Arc::new(Fence::new(Arc::new(store))), dir)
}

fn check_and_reserve(c: &mut Criterion) {
    let rt = rt();
    let mut g = c.benchmark_group("check_and_reserve");
    g.throughput(Throughput::Elements(1));
    g.bench_function("uncontended", |b| {
        let (table, _dir) = fence_table(&rt);
        let mut token = 0;
        b.iter(|| {
            token += 1;
            rt.block_on(reserve(&table, "/accounts/42", token, EqualToken::Reject))
        })
    });
    for tasks in [2u64, 8, 64] {
        for shared_key in [true, false] {
            let name = if shared_key { "one_key" } else { "distinct_keys" };
            g.bench_function(BenchmarkId::new(name, tasks), |b| {
                b.iter_custom(|iters| {
                    let (table, _dir) = fence_table(&rt);
                    let per_task = iters.div_ceil(tasks);
                    let start = Instant::now();
                    rt.block_on(async {
                        let handles: Vec<_> = (0..tasks)
                            .map(|t| {
                                let table = Arc::clone(&table);
                                let key = if shared_key { "/hot".to_string() } else { format!("/k{t}") };
                                tokio::spawn(async move {
                                    for i in 0..per_task {
                                        reserve(&table, &key, i / tasks, EqualToken::Accept).await;
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

criterion_group!(benches, parsing, check_and_reserve);
criterion_main!(benches);
