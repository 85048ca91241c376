//! The access log (`log.access`): one line per proxied request, forwarded or refused, with
//! the fields an operator greps for, in text and in JSON, or in nginx's combined format
//! (`log.access_format`); none when it is off. Durations have three decimals in every format.

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
    let raw = d.proxy().log_lines("fencegate::access");
    let three_decimals = regex::Regex::new(r#""duration_ms":\d+\.\d{3},"#).unwrap();
    assert!(raw.iter().all(|l| three_decimals.is_match(l)), "{raw:#?}");
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
    let three_decimals = regex::Regex::new(r" duration_ms=\d+\.\d{3}$").unwrap();
    assert!(three_decimals.is_match(&stale), "{stale}");

    let mut off = Deployment::builder().start().await;
    three_requests(&off).await;
    // A process that exits has written every line it queued.
    assert!(off.terminate().success());
    assert!(off.proxy().log_contains("refused stale token"), "the log was read to its end");
    assert!(!off.proxy().log_contains("fencegate::access"));
}

/// nginx's `combined`: `$remote_addr - $remote_user [$time_local] "$request" $status
/// $body_bytes_sent "$http_referer" "$http_user_agent"`, as log parsers read it (GoAccess's
/// `COMBINED`, the ELK `COMBINEDAPACHELOG` pattern); `rest` is what follows it.
fn combined(rest: &str) -> regex::Regex {
    regex::Regex::new(&format!(
        r#"^(?P<addr>\S+) - (?P<user>\S+) \[(?P<time>\d{{2}}/[A-Z][a-z]{{2}}/\d{{4}}:\d{{2}}:\d{{2}}:\d{{2}} [+-]\d{{4}})\] "(?P<request>(?:[^"\\]|\\.)*)" (?P<status>\d{{3}}) (?P<bytes>\d+|-) "(?P<referer>(?:[^"\\]|\\.)*)" "(?P<agent>(?:[^"\\]|\\.)*)"{rest}$"#
    ))
    .unwrap()
}

/// A PUT that is forwarded, a stale one, and a GET with a query, a referrer and a user agent
/// holding a quote; the lines they left, found by their request line.
async fn combined_lines(d: &Deployment) -> (Vec<String>, u16, usize) {
    let addr = d.addr();
    assert_eq!(put(addr, "/doc", 5).await, 200);
    let stale = common::raw::put_response(addr, "/doc", 4).await.unwrap();
    assert_eq!(stale.status, 409);
    let head = "GET /doc?v=1 HTTP/1.1\r\nHost: x\r\nReferer: http://app/page\r\nUser-Agent: curl/8.5 \"q\"";
    let get = raw_request(addr, head, "").await;
    d.proxy().wait_for_log(" HTTP/1.1\" ", 3).await;
    (d.proxy().log_lines(" HTTP/1.1\" "), get.status, stale.body.len())
}

#[tokio::test]
async fn combined_access_lines_read_as_nginx_combined_ones() {
    let d = Deployment::builder().config_extra("[log]\naccess = true\naccess_format = \"combined\"").start().await;
    let (lines, get_status, stale_bytes) = combined_lines(&d).await;
    assert_eq!(lines.len(), 3, "{lines:#?}");
    let re = combined("");
    let fields: Vec<regex::Captures> =
        lines.iter().map(|l| re.captures(l).unwrap_or_else(|| panic!("not combined: {l}"))).collect();
    let (put, stale, get) = (&fields[0], &fields[1], &fields[2]);
    assert_eq!(
        (&put["addr"], &put["user"], &put["request"], &put["status"]),
        ("127.0.0.1", "-", "PUT /doc HTTP/1.1", "200")
    );
    assert_eq!((&put["referer"], &put["agent"]), ("-", "-"));
    assert_eq!((&stale["request"], &stale["status"]), ("PUT /doc HTTP/1.1", "409"));
    assert_eq!(stale["bytes"], stale_bytes.to_string(), "the refusal's body");
    assert_eq!((&get["request"], &get["status"]), ("GET /doc?v=1 HTTP/1.1", get_status.to_string().as_str()));
    assert_eq!(
        (&get["referer"], &get["agent"]),
        ("http://app/page", r#"curl/8.5 \x22q\x22"#),
        "quotes escaped as nginx does"
    );
    assert!(get["time"].ends_with(" +0000"), "{}", &get["time"]);
    assert!(lines.iter().all(|l| !l.contains("duration_ms") && !l.contains("fencegate::access")), "{lines:#?}");
}

#[tokio::test]
async fn combined_fencegate_lines_append_the_outcome_token_and_duration() {
    let extra = "[log]\naccess = true\naccess_format = \"combined_fencegate\"";
    let d = Deployment::builder().config_extra(extra).start().await;
    let (lines, _, _) = combined_lines(&d).await;
    let re = combined(r" outcome=(?P<outcome>\S+) token=(?P<token>\d+|-) duration_ms=(?P<ms>\d+\.\d{3})");
    let fields: Vec<regex::Captures> =
        lines.iter().map(|l| re.captures(l).unwrap_or_else(|| panic!("not combined_fencegate: {l}"))).collect();
    let got: Vec<(&str, &str, &str)> = fields.iter().map(|f| (&f["status"], &f["outcome"], &f["token"])).collect();
    assert_eq!(got, [("200", "forwarded", "5"), ("409", "stale_token", "4"), ("200", "forwarded", "-")]);
}
