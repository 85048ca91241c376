//! The durable store: advances per second with group commit at 1, 16, 64 and 256 concurrent
//! writers on distinct resources (`sync = "always"`, every advance fsync'd before it returns),
//! and recovery time of a data directory holding 1,000,000 resources.
//!
//! Run: `cargo bench --bench store` (filter with `-- advance` or `-- recovery`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fencegate::store::{FileStore, Mark, MarkBatch, Store, StoreOptions, SyncMode};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// A 30-byte key, the size the memory and recovery targets are stated for.
fn key(i: u64) -> String {
    format!("/bucket-{:02}/object-{:012}", i % 100, i)
}

fn durable_advance(c: &mut Criterion) {
    // One thread for the writers, as `fencegate run` has with `server.workers = 1`; the
    // store's writer has a thread of its own (`fencegate-log`), as it has there.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut g = c.benchmark_group("store_advance_fsync");
    g.sample_size(10).measurement_time(Duration::from_secs(6));
    g.throughput(Throughput::Elements(1));
    for writers in [1u64, 16, 64, 256] {
        g.bench_function(BenchmarkId::new("writers", writers), |b| {
            let dir = tempfile::tempdir().unwrap();
            let store = Arc::new(rt.block_on(async { FileStore::open(dir.path(), StoreOptions::default()) }).unwrap());
            let mut next_token = 0u64;
            b.iter_custom(|iters| {
                let per_writer = iters.div_ceil(writers);
                let first = next_token;
                next_token += per_writer;
                let start = Instant::now();
                rt.block_on(async {
                    let tasks: Vec<_> = (0..writers)
                        .map(|w| {
                            let store = Arc::clone(&store);
                            tokio::spawn(async move {
                                let key = key(w);
                                for t in first..first + per_writer {
                                    store.commit(0, MarkBatch::advance([Mark::key(key.as_str())], t)).await.unwrap();
                                }
                            })
                        })
                        .collect();
                    for t in tasks {
                        t.await.unwrap();
                    }
                });
                // Per advance: scale to the iterations criterion asked for.
                start.elapsed().mul_f64(iters as f64 / (per_writer * writers) as f64)
            });
            rt.block_on(store.close()).unwrap();
        });
    }
    g.finish();
}

/// Writes `n` resources through the store (unsynced, for speed) and closes it.
pub fn populate(dir: &std::path::Path, n: u64, segment_bytes: u64) {
    let rt = rt();
    let options = StoreOptions { sync: SyncMode::Never, segment_bytes, ..StoreOptions::default() };
    let store = Arc::new(FileStore::open(dir, options).unwrap());
    rt.block_on(async {
        let tasks: Vec<_> = (0..64u64)
            .map(|w| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    for i in (w..n).step_by(64) {
                        store.commit(0, MarkBatch::advance([Mark::key(key(i))], i + 1)).await.unwrap();
                        // As the proxy does once the backend has answered.
                        store.commit(0, MarkBatch::answered([Mark::key(key(i))], i + 1)).await.unwrap();
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        // Let the last compaction finish before closing.
        tokio::time::sleep(Duration::from_secs(2)).await;
        store.close().await.unwrap();
    });
}

fn recovery(c: &mut Criterion) {
    let mut g = c.benchmark_group("store_recovery_1m");
    g.sample_size(10).measurement_time(Duration::from_secs(10));
    for (name, segment_bytes) in [("log_only", 1u64 << 30), ("snapshot_plus_tail", 8 << 20)] {
        let dir = tempfile::tempdir().unwrap();
        populate(dir.path(), 1_000_000, segment_bytes);
        g.bench_function(name, |b| {
            b.iter_with_large_drop(|| {
                let found = fencegate::store::inspect(dir.path()).unwrap();
                assert_eq!(found.table.len(), 1_000_000);
                found
            })
        });
    }
    g.finish();
}

criterion_group!(benches, durable_advance, recovery);
criterion_main!(benches);
