//! S3 mode against two real S3 servers that check signatures (moto and s3s-fs), driven by
//! boto3 as a user would, each trace judged by what the server holds afterwards
//! (`tests/common/s3/client.py`).

use crate::common::s3::{S3Proxy, S3Server, scenario, start_moto, start_s3s};

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
    use crate::common::backend::{Reply, StubBackend};
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
