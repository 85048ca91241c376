//! The access log (`log.access`): one line per proxied request, forwarded or refused, with
//! the fields an operator greps for, in text and in JSON; none when it is off.

use crate::common;

use common::builder::Deployment;
use common::raw::put;
use common::raw_request;

async fn three_requests(d: &Deployment) {
    let addr = d.addr();
    assert_eq!(put(addr, "/doc", 5).await, 200);
    assert_eq!(put(addr, "//doc", 4).await, 409);
    assert_eq!(raw_request(addr, "GET /doc HTTP/1.1\r\nHost: x", "").await.status, 200);
}

#[tokio::test]
async fn json_access_lines_carry_every_field_at_the_top_level() {
    let d = Deployment::builder().config_extra("[log]\nformat = \"json\"\naccess = true").start().await;
    three_requests(&d).await;
    d.proxy().wait_for_log("fencegate::access", 3).await;
    let lines: Vec<serde_json::Value> =
        d.proxy().log_lines("fencegate::access").iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3, "{lines:#?}");
    let (put, stale, get) = (&lines[0], &lines[1], &lines[2]);
    assert_eq!(
        (put["method"].as_str(), put["path"].as_str(), put["keys"].as_str()),
        (Some("PUT"), Some("/doc"), Some("/doc"))
    );
    assert_eq!((put["token"].as_u64(), put["outcome"].as_str()), (Some(5), Some("forwarded")));
    assert_eq!((put["status"].as_u64(), put["backend_status"].as_u64()), (Some(200), Some(200)));
    assert!(put["duration_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{put}");
    assert_eq!((stale["path"].as_str(), stale["keys"].as_str()), (Some("//doc"), Some("/doc")), "as sent, and its key");
    assert_eq!((stale["outcome"].as_str(), stale["status"].as_u64()), (Some("stale_token"), Some(409)));
    assert!(stale.get("backend_status").is_none(), "never sent: {stale}");
    assert_eq!(
        (get["method"].as_str(), get["keys"].as_str(), get["outcome"].as_str()),
        (Some("GET"), Some(""), Some("forwarded"))
    );
    assert!(get.get("token").is_none(), "{get}");
}

#[tokio::test]
async fn text_access_lines_read_as_key_value_pairs_and_none_are_written_when_off() {
    let d = Deployment::builder().config_extra("[log]\naccess = true").start().await;
    three_requests(&d).await;
    d.proxy().wait_for_log("fencegate::access", 3).await;
    let stale = d.proxy().log_lines("fencegate::access").remove(1);
    for field in ["method=PUT", "path=//doc", "keys=/doc", "token=4", "outcome=stale_token", "status=409"] {
        assert!(stale.contains(field), "{field} in {stale}");
    }
    assert!(!stale.contains("Some(") && !stale.contains("None"), "{stale}");

    let mut off = Deployment::builder().start().await;
    three_requests(&off).await;
    // A process that exits has written every line it queued.
    assert!(off.terminate().success());
    assert!(off.proxy().log_contains("refused stale token"), "the log was read to its end");
    assert!(!off.proxy().log_contains("fencegate::access"));
}
