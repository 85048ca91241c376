//! Micro benchmarks of the fence path: token parse, canonicalisation, and in-memory
//! check-and-reserve (precheck, wait for the resource's turn, check, release), uncontended and
//! with N tasks on one key or on distinct keys; and a write six segments deep into a fence that
//! holds 1,000,000 keys (`depth6_1m_keys`), its check alone and the whole write but the forward
//! (store never synced); and what a signed token adds to a write (`verify`): parsing and
//! checking its HMAC signature, alone and in front of check-and-reserve. The store has its own
//! bench (`benches/store.rs`).
//!
//! Run: `cargo bench --bench fence`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fencegate::fence::{Coverage, EqualToken, Fence, Outcome, Touch, path};
use fencegate::store::{FileStore, Mark, MarkBatch, Store, StoreOptions, SyncMode};

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
    let touches = vec![Touch { key: key.to_owned(), coverage: Coverage::Key }];
    table.precheck(&touches, token, equal).unwrap();
    let mut turn = table.acquire(touches, Duration::from_secs(10)).await.unwrap();
    black_box(turn.check(token, equal)).unwrap();
}

/// A whole fenced write but the forward: precheck, turn, check, the durable advance (never
/// synced) with the tree raised, answered, release.
async fn write(table: &Arc<Fence>, key: &str, token: u64) {
    let touches = vec![Touch { key: key.to_owned(), coverage: Coverage::Key }];
    table.precheck(&touches, token, EqualToken::Reject).unwrap();
    let turn = table.acquire(touches, Duration::from_secs(10)).await.unwrap();
    let done = turn.finish(token, EqualToken::Reject, Duration::from_secs(1), async { Ok::<_, Failed>(()) }, answered);
    done.await.unwrap();
}

#[derive(Debug)]
struct Failed;

impl From<fencegate::fence::FenceError> for Failed {
    fn from(_: fencegate::fence::FenceError) -> Self {
        Failed
    }
}

impl From<fencegate::store::StoreError> for Failed {
    fn from(_: fencegate::store::StoreError) -> Self {
        Failed
    }
}

fn answered(_: &Result<(), Failed>) -> Outcome {
    Outcome::Answered
}

/// Six segments deep: `/t0/t1/t2/t3/t4/k` with ten branches per level.
fn deep_key(i: u64) -> String {
    format!("/t{}/t{}/t{}/t{}/t{}/k{i}", i % 10, i / 10 % 10, i / 100 % 10, i / 1000 % 10, i / 10000 % 10)
}

/// Writes of a key six segments deep into a fence that already holds 1,000,000 such keys,
/// each with the tree raised, as a proxy that has run a while has.
fn deep(c: &mut Criterion) {
    let rt = rt();
    let dir = tempfile::tempdir().unwrap();
    let options = StoreOptions { sync: SyncMode::Never, max_resources: 2_000_000, ..StoreOptions::default() };
    let store = Arc::new(rt.block_on(async { FileStore::open(dir.path(), options) }).unwrap());
    rt.block_on(async {
        let tasks: Vec<_> = (0..64u64)
            .map(|w| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    for i in (w..1_000_000).step_by(64) {
                        store.commit(0, MarkBatch::advance([Mark::key(deep_key(i))], 1)).await.unwrap();
                        store.commit(0, MarkBatch::answered([Mark::key(deep_key(i))], 1)).await.unwrap();
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    let table = Arc::new(Fence::new(store as Arc<dyn Store>));
    let mut g = c.benchmark_group("depth6_1m_keys");
    g.throughput(Throughput::Elements(1));
    let mut token = 1;
    g.bench_function("check_and_reserve", |b| {
        b.iter(|| {
            token += 1;
            rt.block_on(reserve(&table, &deep_key(token % 1_000_000), token, EqualToken::Reject))
        })
    });
    g.bench_function("write_without_forward", |b| {
        b.iter(|| {
            token += 1;
            rt.block_on(write(&table, &deep_key(token % 1_000_000), token))
        })
    });
    g.finish();
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

/// What verification adds to a write: classifying a PUT with and without a `verify = "etcd"`
/// rule (the lock name made from the key), and the lookup of the lock's holder in a mirror of
/// 10,000 locks, each with a holder and a waiter.
fn etcd_verification(c: &mut Criterion) {
    use fencegate::etcd_client::{Mirror, Mirrors};
    use fencegate::request::classify::Plan;
    use fencegate::request::protocol::http::classify;
    let base = "[backend]\nurl = \"http://127.0.0.1:9\"\n";
    let plain = fencegate::Config::from_toml_str(base).unwrap();
    let etcd = fencegate::Config::from_toml_str(&format!(
        "{base}[etcd]\nendpoints = [\"http://127.0.0.1:2379\"]\n[[fence.rules]]\nprefix = \"/accounts/\"\n\
         verify = \"etcd\"\nlock = \"/locks/accounts/{{2}}\"\n"
    ))
    .unwrap();
    let keys = (0..10_000i64).flat_map(|i| {
        let name = format!("/locks/accounts/{i}");
        [
            (format!("{name}/694d7a1b{i:08x}").into_bytes(), 100 + 2 * i),
            (format!("{name}/794d7a1b{i:08x}").into_bytes(), 101 + 2 * i),
        ]
    });
    let mirrors = Mirrors::of(Mirror::fixed(b"/locks/accounts/".to_vec(), keys));
    let req = || {
        http::Request::put("/accounts/4242")
            .header("fencing-token", "8584")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap()
    };
    let mut g = c.benchmark_group("verify_etcd");
    g.bench_function("classify_unverified", |b| b.iter(|| classify(black_box(&req()), &plain).unwrap()));
    g.bench_function("classify_etcd", |b| b.iter(|| classify(black_box(&req()), &etcd).unwrap()));
    let Plan::Write(w) = classify(&req(), &etcd).unwrap() else { panic!("a write") };
    assert_eq!(w.locks, ["/locks/accounts/4242"]);
    g.bench_function("etcd_holder_check", |b| {
        b.iter(|| fencegate::request::holders::check(&mirrors, black_box(&w.locks), black_box(8584)).unwrap())
    });
    g.finish();
}

/// The per-write cost of `verify = "hmac"`: the signature header parsed and its MAC checked
/// (what `request::proof` does before the precheck), against no verification, alone and in
/// front of an uncontended check-and-reserve.
fn verification(c: &mut Criterion) {
    use fencegate::fence::signature::{HmacKeys, Secret, Signature, sign, unix_now};
    let secret = Secret::new(b"a-secret-of-32-bytes-for-benches".to_vec()).unwrap();
    let keys = HmacKeys::new([("2026-11", &secret), ("2026-12", &secret)], Duration::from_secs(30));
    let expiry = unix_now() + 3600;
    let header = sign(&secret, "2026-12", "default", 48213, expiry).unwrap();
    let verify = |token: u64, header: &str| {
        let signature = Signature::parse(black_box(header.as_bytes())).unwrap();
        keys.verify(&signature, "default", token, unix_now()).unwrap();
    };
    let mut g = c.benchmark_group("verify");
    g.bench_function("none", |b| b.iter(|| black_box(48213u64)));
    g.bench_function("hmac", |b| b.iter(|| verify(48213, &header)));
    let rt = rt();
    let (table, _dir) = fence_table(&rt);
    // Signed ahead, so that signing is not measured: a ring of tokens, each above the last.
    let headers: Vec<(u64, String)> =
        (1..=4096u64).map(|t| (t, sign(&secret, "2026-12", "default", t, expiry).unwrap())).collect();
    let mut round = 0u64;
    g.bench_function("none_then_check_and_reserve", |b| {
        b.iter(|| {
            round += 1;
            rt.block_on(reserve(&table, "/accounts/none", round, EqualToken::Reject))
        })
    });
    let mut i = 0usize;
    g.bench_function("hmac_then_check_and_reserve", |b| {
        b.iter(|| {
            let (token, header) = &headers[i % headers.len()];
            i += 1;
            verify(*token, header);
            rt.block_on(reserve(&table, "/accounts/hmac", *token, EqualToken::Reject))
        })
    });
    g.finish();
}

criterion_group!(benches, parsing, check_and_reserve, deep, verification, etcd_verification);
criterion_main!(benches);
