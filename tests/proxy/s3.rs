//! S3 mode against two real S3 servers that check signatures (moto and s3s-fs), driven by
//! boto3 as a user would, each trace judged by what the server holds afterwards
//! (`tests/common/s3/client.py`).

use crate::common::backend::{Reply, StubBackend};
use crate::common::s3::{S3Proxy, S3Server, scenario, start_moto, start_s3s};
use crate::common::{RawConn, eventually, poll_until, raw_request};

/// Runs the scenario `name` through a fencegate in front of `server`.
async fn against(name: &str, server: Option<S3Server>) {
    let Some(server) = server else { return };
    // s3s-fs stores objects as files, and reads a//b as a/b.
    let flat = server.kind != "s3s";
    // The databases of the zombie traces keep one fence for their prefix, whose writers each
    // write many objects under one token.
    let mut config = format!("[s3]\nvirtual_host_suffixes = [\"s3.test\"]\nflat_keys = {flat}\n");
    for db in ["/slatedb/db", "/lance/db"] {
        config.push_str(&format!(
            "[[fence.scopes]]\nprefix = \"{db}\"\n[[fence.rules]]\nprefix = \"{db}\"\nequal_token = \"accept\"\n"
        ));
    }
    let proxy = S3Proxy::start(&server.url, &config).await;
    scenario(name, &proxy, &server).await;
}

/// Runs the scenario `name` against moto, then against s3s-fs.
async fn run(name: &str) {
    against(name, start_moto().await).await;
    against(name, start_s3s().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_zombie_holders_write_is_refused_in_s3s_own_words() {
    run("zombie").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_requests_reach_the_server_unchanged_and_keyed_as_s3_keys_them() {
    run("signatures").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_overtaken_mid_upload_cannot_complete_it() {
    run("multipart").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_id_leads_only_where_and_for_whom_it_was_created() {
    run("decoys").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_fences_its_destination_and_reads_its_source() {
    run("copies").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_delete_with_one_stale_key_deletes_nothing() {
    run("batch_delete").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_and_virtual_host_style_share_one_fence() {
    // s3s-fs reads a virtual-host bucket from a Host with a port as an invalid bucket name, even
    // sent to it directly.
    against("styles", start_moto().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slatedb_352_a_fenced_writers_next_wal_object_is_refused() {
    run("slatedb_352").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lance_6432_a_fenced_writer_cannot_go_on_with_plain_puts() {
    run("lance_6432").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_and_presigned_urls_pass_signed_and_fenced() {
    run("transfers").await;
}

/// A raw S3 request through `addr` with the token 5 and an empty body.
async fn s3_request(addr: std::net::SocketAddr, method: &str, target: &str) -> crate::common::Resp {
    let head = format!("{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nFencing-Token: 5\r\nContent-Length: 0");
    crate::common::raw_request(addr, &head, "").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parts_of_an_upload_reach_the_server_side_by_side() {
    const CREATED: &str = "<InitiateMultipartUploadResult><Bucket>bkt</Bucket><Key>k</Key>\
        <UploadId>u1</UploadId></InitiateMultipartUploadResult>";
    // The server holds its answer to every part until released.
    let server = StubBackend::start_with(|seen| match seen.head.split(' ').nth(1) {
        Some(t) if t.ends_with("?uploads") => Reply::Answer(200, CREATED),
        Some(t) if t.contains("partNumber=") => Reply::Hold(200, ""),
        _ => Reply::Answer(200, ""),
    })
    .await;
    let proxy = S3Proxy::start(&server.url(), "").await;
    let addr = proxy.addr;
    let created = s3_request(addr, "POST", "/bkt/k?uploads").await;
    assert_eq!(created.status, 200, "{}", String::from_utf8_lossy(&created.body));
    let parts: Vec<_> = (1..=2)
        .map(|n| {
            tokio::spawn(async move { s3_request(addr, "PUT", &format!("/bkt/k?partNumber={n}&uploadId=u1")).await })
        })
        .collect();
    let at_server = || server.requests().iter().filter(|s| s.head.contains("partNumber=")).count();
    crate::common::poll_until("both parts are at the server at once", || at_server() == 2).await;
    server.release();
    for part in parts {
        assert_eq!(part.await.unwrap().status, 200);
    }
    // A part of an id the creation did not answer is refused before it reaches the server.
    let r = s3_request(addr, "PUT", "/bkt/k?partNumber=3&uploadId=u2").await;
    assert_eq!((r.status, r.headers["fencegate-error"].to_str().unwrap()), (404, "no_such_upload"));
    assert_eq!(s3_request(addr, "POST", "/bkt/k?uploadId=u1").await.status, 200);
    assert_eq!(server.requests().len(), 4, "the creation, two parts and the completion");
}

/// S3 answers a CompleteMultipartUpload `200` before it has finished, and keeps the connection
/// with whitespace until it has (AWS does; moto and s3s-fs answer once done, so a stub plays the
/// server here). The object's turn is held until that answer has ended: a newer write sent at
/// the `200` could reach the server before the completion it follows is done, and be
/// overwritten by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_write_waits_until_a_completion_has_ended() {
    const CREATED: &str = "<InitiateMultipartUploadResult><Bucket>bk1</Bucket><Key>k</Key>\
        <UploadId>u1</UploadId></InitiateMultipartUploadResult>";
    let stub = StubBackend::start_with(|seen| match seen.head.split(' ').nth(1) {
        Some("/bk1/k?uploads") => Reply::Answer(200, CREATED),
        Some("/bk1/k?uploadId=u1") => Reply::HeadThenHold(200, "<CompleteMultipartUploadResult/>"),
        _ => Reply::Answer(200, ""),
    })
    .await;
    let proxy = S3Proxy::start(&stub.url(), "").await;
    let send = |line: &'static str, token: u64| {
        let addr = proxy.addr;
        tokio::spawn(async move {
            raw_request(addr, &format!("{line}\r\nHost: 127.0.0.1\r\nFencing-Token: {token}"), "").await
        })
    };
    let created = send("POST /bk1/k?uploads HTTP/1.1", 41).await.unwrap();
    assert_eq!(created.status, 200, "{:?}", created.body);
    let complete = send("POST /bk1/k?uploadId=u1 HTTP/1.1", 41);
    let reached = |path: &str| stub.requests().iter().any(|r| r.head.split(' ').nth(1) == Some(path));
    poll_until("the completion reaches the server", || reached("/bk1/k?uploadId=u1")).await;
    let newer = send("PUT /bk1/k HTTP/1.1", 42);
    poll_until("the newer write reaches the server or waits for the turn", || {
        reached("/bk1/k") || proxy.proxy.queue_len("/bk1/k") == 2
    })
    .await;
    assert!(!reached("/bk1/k"), "the newer write reached the server before the completion had ended");
    stub.release();
    assert_eq!(complete.await.unwrap().status, 200);
    assert_eq!(newer.await.unwrap().status, 200);
}

/// S3 may fail a CompleteMultipartUpload after its `200`, with an `<Error>` in the body; the
/// upload is then still open and the SDKs send the completion again (boto3 does). The binding
/// stays for that retry, and goes once a completion has succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_that_failed_after_its_200_may_be_sent_again() {
    const CREATED: &str = "<InitiateMultipartUploadResult><Bucket>bk1</Bucket><Key>k</Key>\
        <UploadId>u1</UploadId></InitiateMultipartUploadResult>";
    const FAILED: &str = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n\n<Error><Code>InternalError</Code>\
        <Message>We encountered an internal error. Please try again.</Message></Error>";
    let completions = std::sync::atomic::AtomicUsize::new(0);
    let stub = StubBackend::start_with(move |seen| match seen.head.split(' ').nth(1) {
        Some("/bk1/k?uploads") => Reply::Answer(200, CREATED),
        Some("/bk1/k?uploadId=u1") => match completions.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => Reply::Answer(200, FAILED),
            _ => Reply::Answer(200, "<CompleteMultipartUploadResult/>"),
        },
        _ => Reply::Answer(200, ""),
    })
    .await;
    let proxy = S3Proxy::start(&stub.url(), "").await;
    let send = async |line: &str| {
        raw_request(proxy.addr, &format!("{line}\r\nHost: 127.0.0.1\r\nFencing-Token: 41"), "").await
    };
    assert_eq!(send("POST /bk1/k?uploads HTTP/1.1").await.status, 200);
    let failed = send("POST /bk1/k?uploadId=u1 HTTP/1.1").await;
    let text = |r: &crate::common::Resp| String::from_utf8_lossy(&r.body).into_owned();
    assert_eq!((failed.status, text(&failed).contains("InternalError")), (200, true), "{}", text(&failed));
    let again = send("POST /bk1/k?uploadId=u1 HTTP/1.1").await;
    assert_eq!((again.status, text(&again).as_str()), (200, "<CompleteMultipartUploadResult/>"), "the retry");
    let after = send("POST /bk1/k?uploadId=u1 HTTP/1.1").await;
    assert_eq!(after.status, 404, "once completed, the binding is gone: {}", text(&after));
    assert_eq!(stub.requests().len(), 3, "the third completion did not reach the server");
}

/// A completion's client that leaves before the answer does not keep its upload's binding:
/// the binding goes with the write, which runs to its end without its client, so it neither
/// counts against `s3.max_uploads` for ever nor lets the completion be sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_whose_client_left_drops_its_binding_all_the_same() {
    const CREATED: &str = "<InitiateMultipartUploadResult><Bucket>bk1</Bucket><Key>k</Key>\
        <UploadId>u1</UploadId></InitiateMultipartUploadResult>";
    let completions = std::sync::atomic::AtomicUsize::new(0);
    let stub = StubBackend::start_with(move |seen| match seen.head.split(' ').nth(1) {
        Some("/bk1/k?uploads") => Reply::Answer(200, CREATED),
        Some("/bk1/k?uploadId=u1") => match completions.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => Reply::Hold(200, "<CompleteMultipartUploadResult/>"),
            _ => Reply::Answer(200, "<CompleteMultipartUploadResult/>"),
        },
        _ => Reply::Answer(200, ""),
    })
    .await;
    let proxy = S3Proxy::start(&stub.url(), "").await;
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin_addr = admin.local_addr().unwrap();
    proxy.proxy.serve_admin(admin, std::future::pending()).unwrap();
    let open = async || {
        let text = raw_request(admin_addr, "GET /metrics HTTP/1.1\r\nHost: x", "").await;
        let text = String::from_utf8_lossy(&text.body).into_owned();
        let series = "fencegate_open_connections{listener=\"proxy\"} ";
        text.lines().find_map(|l| l.strip_prefix(series)).map(|v| v.trim().to_owned())
    };
    let head = |line: &str| format!("{line}\r\nHost: 127.0.0.1\r\nFencing-Token: 41");
    assert_eq!(raw_request(proxy.addr, &head("POST /bk1/k?uploads HTTP/1.1"), "").await.status, 200);
    let mut client = RawConn::open(proxy.addr).await;
    client.send(format!("{}\r\nContent-Length: 0\r\n\r\n", head("POST /bk1/k?uploadId=u1 HTTP/1.1"))).await;
    let completions = || stub.requests().iter().filter(|r| r.head.contains("?uploadId=u1")).count();
    poll_until("the completion reaches the server", || completions() == 1).await;
    drop(client);
    eventually("fencegate has seen its client leave", async || open().await.as_deref() == Some("0")).await;
    stub.release();
    poll_until("the completion has run to its end", || proxy.proxy.queue_len("/bk1/k") == 0).await;
    let again = raw_request(proxy.addr, &head("POST /bk1/k?uploadId=u1 HTTP/1.1"), "").await;
    assert_eq!(again.status, 404, "the binding outlived its upload: {}", String::from_utf8_lossy(&again.body));
    assert_eq!(completions(), 1, "the second completion reached the server");
}

/// At `s3.max_uploads`, a new upload is bound all the same: the oldest binding (the lowest
/// token) is dropped, and its upload's parts are refused; a stale holder's creation is refused
/// as stale (`409`), never let through to the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_bound_the_oldest_upload_makes_room_and_a_stale_one_is_still_stale() {
    let created = |key: &str| {
        format!(
            "<InitiateMultipartUploadResult><Bucket>bk1</Bucket><Key>{key}</Key><UploadId>{key}-id</UploadId>\
             </InitiateMultipartUploadResult>"
        )
    };
    let (a, k) = (created("a").leak() as &'static str, created("k").leak() as &'static str);
    let stub = StubBackend::start_with(move |seen| match seen.head.split(' ').nth(1) {
        Some("/bk1/a?uploads") => Reply::Answer(200, a),
        Some("/bk1/k?uploads") => Reply::Answer(200, k),
        _ => Reply::Answer(200, ""),
    })
    .await;
    let proxy = S3Proxy::start(&stub.url(), "[s3]\nmax_uploads = 1").await;
    let send = async |line: &str, token: u64| {
        let r = raw_request(proxy.addr, &format!("{line}\r\nHost: 127.0.0.1\r\nFencing-Token: {token}"), "").await;
        (r.status, String::from_utf8_lossy(&r.body).into_owned())
    };
    assert_eq!(send("POST /bk1/a?uploads HTTP/1.1", 41).await.0, 200, "the one upload the bound allows");
    assert_eq!(send("PUT /bk1/k HTTP/1.1", 50).await.0, 200);
    let stale = send("POST /bk1/k?uploads HTTP/1.1", 45).await;
    assert_eq!((stale.0, stale.1.contains("<Code>StaleToken</Code>")), (409, true), "{}", stale.1);
    assert_eq!(send("POST /bk1/k?uploads HTTP/1.1", 51).await.0, 200, "the oldest binding made room");
    let evicted = send("PUT /bk1/a?partNumber=1&uploadId=a-id HTTP/1.1", 41).await;
    assert_eq!((evicted.0, evicted.1.contains("<Code>NoSuchUpload</Code>")), (404, true), "{}", evicted.1);
    assert_eq!(send("PUT /bk1/k?partNumber=1&uploadId=k-id HTTP/1.1", 51).await.0, 200);
}
