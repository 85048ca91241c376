//! S3 mode against a real S3 server that checks signatures (moto), driven by boto3 as a user
//! would, each trace judged by what the server holds afterwards (`tests/common/s3/client.py`).

use crate::common::s3::{S3Proxy, scenario, start_moto};

/// Starts moto and fencegate in front of it, and runs the scenario `name`.
async fn run(name: &str) {
    let Some(moto) = start_moto().await else { return };
    let proxy = S3Proxy::start(&moto.url, "[s3]\nvirtual_host_suffixes = [\"s3.test\"]").await;
    scenario(name, &proxy, &moto).await;
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
async fn a_copy_fences_its_destination_and_reads_its_source() {
    run("copies").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_delete_with_one_stale_key_deletes_nothing() {
    run("batch_delete").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_and_virtual_host_style_share_one_fence() {
    run("styles").await;
}
