//! The pool's bound and its reuse of connections, against backends on loopback.

use std::sync::atomic::Ordering::SeqCst;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::sync::watch;

use super::*;

/// What a test backend saw.
#[derive(Default)]
struct Seen {
    accepted: AtomicUsize,
    requests: AtomicUsize,
    open: AtomicUsize,
    most_open: AtomicUsize,
}

/// A backend that counts its connections and answers every request with an empty 200 once
/// `gate` is open (closing the connection after it if `close`).
async fn backend(close: bool, gate: watch::Receiver<bool>) -> (u16, Arc<Seen>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Seen::default());
    let counts = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            counts.accepted.fetch_add(1, SeqCst);
            let open = counts.open.fetch_add(1, SeqCst) + 1;
            counts.most_open.fetch_max(open, SeqCst);
            let (counts, served, gate) = (Arc::clone(&counts), Arc::clone(&counts), gate.clone());
            let answer = hyper::service::service_fn(move |_| {
                let (counts, mut gate) = (Arc::clone(&served), gate.clone());
                async move {
                    counts.requests.fetch_add(1, SeqCst);
                    gate.wait_for(|open| *open).await.unwrap();
                    let mut resp = Response::new(Empty::<Bytes>::new());
                    if close {
                        // Counted closed before the answer is written: the pool can only
                        // learn of the close, and open another connection, after that.
                        counts.open.fetch_sub(1, SeqCst);
                        resp.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
                    }
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tcp), answer).await;
                if !close {
                    counts.open.fetch_sub(1, SeqCst);
                }
            });
        }
    });
    (port, seen)
}

/// A backend that answers at once.
async fn open_backend(close: bool) -> (u16, Arc<Seen>) {
    let (gate, opened) = watch::channel(true);
    std::mem::forget(gate); // open for good
    backend(close, opened).await
}

fn pool(port: u16, max_connections: usize) -> Arc<Pool<Empty<Bytes>>> {
    let bounds = Bounds {
        max_connections,
        pool_timeout: Duration::from_secs(20),
        idle_timeout: Duration::from_secs(60),
        unacked: Duration::from_secs(30),
    };
    Pool::new(tcp(port), Duration::from_secs(5), bounds, None)
}

/// Sends a GET and reads the whole response.
async fn get(pool: &Arc<Pool<Empty<Bytes>>>) -> Result<(), SendError> {
    let req = Request::get("/").header("host", "backend").body(Empty::new()).unwrap();
    let conn = pool.checkout().await?;
    pool.send(conn, req, || true).await?.into_body().collect().await?;
    Ok(())
}

/// Waits until every open connection is idle in the list again.
async fn settle(pool: &Arc<Pool<Empty<Bytes>>>) {
    for _ in 0..5000 {
        let open = pool.bounds.max_connections - pool.limit.available_permits();
        if pool.lock_idle().len() == open {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("a connection never went back to the pool or closed");
}

#[tokio::test]
async fn an_idle_connection_is_reused_until_it_has_been_idle_longer_than_the_idle_timeout() {
    let (port, seen) = open_backend(false).await;
    let pool = pool(port, 4);
    for _ in 0..2 {
        get(&pool).await.unwrap();
        settle(&pool).await;
    }
    assert_eq!(seen.accepted.load(SeqCst), 1, "a fresh idle connection is reused");
    // Listed 61 s ago, as far as the pool can tell; the heartbeat has not pruned it.
    for c in pool.lock_idle().iter_mut() {
        c.since = c.since.checked_sub(Duration::from_secs(61)).unwrap();
    }
    get(&pool).await.unwrap();
    settle(&pool).await;
    assert_eq!(seen.accepted.load(SeqCst), 2, "one idle past the timeout is not");
    get(&pool).await.unwrap();
    assert_eq!(seen.accepted.load(SeqCst), 2);
}

#[tokio::test]
async fn connections_the_backend_closed_are_never_listed_and_give_their_room_back() {
    let (port, seen) = open_backend(true).await;
    let pool = pool(port, 1);
    for _ in 0..20 {
        get(&pool).await.unwrap();
    }
    assert_eq!(seen.accepted.load(SeqCst), 20, "a closed connection is never reused");
    settle(&pool).await;
    assert!(pool.lock_idle().is_empty());
    assert_eq!(pool.limit.available_permits(), 1, "the one connection allowed is free again");
}

/// Eight requests at once through a pool of two, against a backend that holds every answer
/// until all eight are in: the backend never has more than two connections open, whether
/// it keeps them (the waiters get them back) or closes each after one answer (the waiters
/// get the room to open a new one).
#[tokio::test]
async fn the_backend_never_has_more_connections_open_than_the_bound() {
    for close in [false, true] {
        let (gate, opened) = watch::channel(false);
        let (port, seen) = backend(close, opened).await;
        let pool = pool(port, 2);
        let requests: Vec<_> = (0..8)
            .map(|_| {
                let pool = Arc::clone(&pool);
                tokio::spawn(async move { get(&pool).await })
            })
            .collect();
        for _ in 0..5000 {
            if seen.requests.load(SeqCst) == 2 && pool.waiting.load(SeqCst) == 6 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!((seen.requests.load(SeqCst), pool.waiting.load(SeqCst)), (2, 6), "two sent, six waiting");
        gate.send(true).unwrap();
        for request in requests {
            request.await.unwrap().unwrap();
        }
        assert_eq!(seen.most_open.load(SeqCst), 2, "close: {close}");
        assert_eq!(seen.accepted.load(SeqCst), if close { 8 } else { 2 }, "close: {close}");
        assert_eq!(seen.requests.load(SeqCst), 8);
    }
}

#[tokio::test]
async fn a_request_that_finds_every_connection_in_use_for_the_pool_timeout_is_busy() {
    let (gate, opened) = watch::channel(false);
    let (port, seen) = backend(false, opened).await;
    let bounds = Bounds {
        max_connections: 1,
        pool_timeout: Duration::from_millis(50),
        idle_timeout: Duration::from_secs(60),
        unacked: Duration::from_secs(30),
    };
    let pool: Arc<Pool<Empty<Bytes>>> = Pool::new(tcp(port), Duration::from_secs(5), bounds, None);
    let held = tokio::spawn({
        let pool = Arc::clone(&pool);
        async move { get(&pool).await }
    });
    while seen.requests.load(SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(matches!(pool.checkout().await, Err(SendError::Busy(_))));
    gate.send(true).unwrap();
    held.await.unwrap().unwrap();
    settle(&pool).await;
    get(&pool).await.unwrap();
    assert_eq!(seen.accepted.load(SeqCst), 1, "the connection, free again, was reused");
}

fn tcp(port: u16) -> Target {
    Target::Tcp { host: "127.0.0.1".into(), port, tls: None }
}
