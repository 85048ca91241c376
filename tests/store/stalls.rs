//! A stalled disk or a blocked thread delays only what has to wait for it: a held log sync
//! leaves pass-through requests and the admin API answering, and the admin API answers even
//! while every thread that serves requests is blocked.

use crate::common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::wait::DEADLINE;
use common::{Harness, Resp, eventually, raw_request};

async fn get(addr: SocketAddr, path: &str) -> Resp {
    raw_request(addr, &format!("GET {path} HTTP/1.1\r\nHost: t"), "").await
}

#[tokio::test]
async fn a_stalled_log_sync_holds_fenced_writes_and_nothing_else() {
    let h = Harness::start_with(|c| c.store.stall_after = Duration::from_millis(50)).await;
    let admin = h.start_admin().await;
    assert_eq!(h.put("/a", 1, "one").await.status, 200);

    let held = fencegate::store::hold(&h.config.store.dir);
    let proxy = h.addr;
    let write =
        tokio::spawn(async move { raw_request(proxy, "PUT /a HTTP/1.1\r\nHost: t\r\nFencing-Token: 2", "two").await });
    eventually("/readyz reports the stalled store", async || {
        let r = get(admin, "/readyz").await;
        r.status == 503 && r.json()["problems"][0].as_str().is_some_and(|p| p.starts_with("store stalled"))
    })
    .await;
    assert_eq!(get(admin, "/readyz").await.json()["checks"]["store"], false);
    let r = h.get("/a").await;
    assert_eq!(r.status, 200, "a read passes while the log is held");
    assert_eq!(r.body, "one");
    assert_eq!(get(admin, "/healthz").await.status, 200, "liveness is not the disk's");
    assert_eq!(get(admin, "/metrics").await.status, 200);
    assert!(!write.is_finished(), "the fenced write waits for its advance to be durable");
    assert_eq!(h.proxy.max_seen("/a"), Some(1), "nothing is raised before it is durable");

    drop(held);
    let r = write.await.unwrap();
    assert_eq!(r.status, 200, "{:?}", r.body);
    assert_eq!(h.proxy.max_seen("/a"), Some(2));
    assert_eq!(h.get("/a").await.body, "two");
    eventually("/readyz is ready again", async || get(admin, "/readyz").await.status == 200).await;
}

/// `GET path` over a plain blocking socket, from a thread that is not the proxy's.
fn blocking_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(DEADLINE))?;
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n").as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

#[tokio::test(flavor = "current_thread")]
async fn the_admin_api_answers_while_the_proxy_thread_is_blocked() {
    let h = Harness::start().await;
    let admin = h.start_admin().await;
    let (done, finished) = std::sync::mpsc::channel();
    let prober = std::thread::spawn(move || {
        let answers = ["/healthz", "/readyz", "/metrics"].map(|p| blocking_get(admin, p));
        let _ = done.send(());
        answers
    });
    // This test's runtime is the proxy's only thread: block it until the prober is done, as a
    // request stuck in a blocking call would.
    let _ = finished.recv();
    for answer in prober.join().unwrap() {
        let answer = answer.expect("the admin API answers");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    assert_eq!(h.put("/a", 1, "one").await.status, 200, "the proxy goes on once unblocked");
}
