//! Memory of the fence table: RSS of a process that has recovered 1,000,000 resources with
//! 30-byte keys, as the proxy does at start-up; then of 100,000 gates (quarantined, so that
//! they stay without a write holding them), against what `store.max_table_bytes` counts.
//!
//! Run: `cargo bench --bench memory` (`FG_MEMORY_KEYS=deep` for keys six segments deep,
//! `FG_MEMORY_KEYS=long` for 200-byte keys). The parent writes the data directory, then runs
//! itself again to measure a fresh process that only recovers it.

use std::sync::Arc;
use std::time::Duration;

use fencegate::fence::{Coverage, Fence, GATE_BYTES, Touch};
use fencegate::store::{FileStore, MARK_BYTES, Mark, MarkBatch, Store, StoreOptions, SyncMode};

const RESOURCES: u64 = 1_000_000;

/// Two segments (`/bucket-NN/object-N`, 30 bytes), or with `FG_MEMORY_KEYS=deep` six
/// (`/t0/t1/t2/t3/t4/kN`, ten branches a level: 111,110 directories above the keys).
fn key(i: u64) -> String {
    match std::env::var("FG_MEMORY_KEYS").as_deref() {
        Ok("deep") => {
            format!("/t{}/t{}/t{}/t{}/t{}/k{i}", i % 10, i / 10 % 10, i / 100 % 10, i / 1000 % 10, i / 10000 % 10)
        }
        Ok("long") => format!("/bucket-{:02}/{}/object-{:012}", i % 100, "x".repeat(170), i),
        _ => format!("/bucket-{:02}/object-{:012}", i % 100, i),
    }
}

/// Gates measured after the table.
const GATES: u64 = 100_000;

fn status(field: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse().ok())
        .unwrap_or(0)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn measure(dir: &std::path::Path) {
    let before = status("VmRSS:");
    let rt = rt();
    let store = Arc::new(rt.block_on(async { FileStore::open(dir, StoreOptions::default()) }).unwrap());
    let fence = Fence::new(Arc::clone(&store) as Arc<dyn Store>);
    let rss = status("VmRSS:");
    let peak = status("VmHWM:");
    println!("resources          {}", fence.len());
    println!("RSS before         {:>8.1} MB", before as f64 / 1024.0);
    println!("RSS after recovery {:>8.1} MB   (target: under 150 MB)", rss as f64 / 1024.0);
    println!("peak RSS           {:>8.1} MB", peak as f64 / 1024.0);
    println!("per resource       {:>8.0} bytes", (rss - before) as f64 * 1024.0 / fence.len() as f64);
    let key_len = key(0).len() as u64;
    println!("counted per resource {:>6} bytes   (key length {key_len} + MARK_BYTES)", key_len + MARK_BYTES);
    let fence = Arc::new(fence);
    let before = status("VmRSS:");
    rt.block_on(async {
        for i in RESOURCES..RESOURCES + GATES {
            let touch = vec![Touch { key: key(i), coverage: Coverage::Key }];
            let mut turn = fence.acquire(touch, Duration::from_secs(1)).await.unwrap();
            turn.quarantine(Duration::from_secs(3600));
        }
    });
    let rss = status("VmRSS:");
    println!("gates              {}", fence.active_gates());
    println!("per gate           {:>8.0} bytes", (rss - before) as f64 * 1024.0 / GATES as f64);
    println!("counted per gate   {:>8} bytes   (key length {key_len} + GATE_BYTES)", key_len + GATE_BYTES);
    rt.block_on(store.close()).unwrap();
}

fn main() {
    if let Some(dir) = std::env::args().skip_while(|a| a != "--measure").nth(1) {
        measure(std::path::Path::new(&dir));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let rt = rt();
    rt.block_on(async {
        let options = StoreOptions { sync: SyncMode::Never, ..StoreOptions::default() };
        let store = Arc::new(FileStore::open(dir.path(), options).unwrap());
        let tasks: Vec<_> = (0..64u64)
            .map(|w| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    for i in (w..RESOURCES).step_by(64) {
                        let key = key(i);
                        store.commit(0, MarkBatch::advance([Mark::key(key.as_str())], i + 1)).await.unwrap();
                        store.commit(0, MarkBatch::answered([Mark::key(key.as_str())], i + 1)).await.unwrap();
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        store.close().await.unwrap();
    });
    let exe = std::env::current_exe().unwrap();
    let status = std::process::Command::new(exe).arg("--measure").arg(dir.path()).status().unwrap();
    assert!(status.success());
}
