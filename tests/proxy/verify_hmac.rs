//! Signed tokens (`verify = "hmac"`) and `max_jump`, over real HTTP: forged, malformed, wrong,
//! expired and foreign signatures are refused without touching `max_seen`; a signed token must
//! still be above it; keys rotate by reload; `fencegate sign` signs what the proxy accepts;
//! docs/tokens.md's test vector agrees with an independent implementation (Python's hmac).

use crate::common;

use std::process::Command;

use common::Harness;
use common::process::BIN;
use common::signing::{KeyFiles, SIGNATURE, now, sign, with_rules};
use common::wait::poll_until;

const OLD: &str = "the-old-secret-of-2026-11-rotation";
const NEW: &str = "the-new-secret-of-2026-12-rotation";

/// `/signed/` asks for signatures by the keys `ids` (files already written); `/open/` does not.
fn signed_rules(keys: &KeyFiles, ids: &[&str], verify: &str) -> String {
    format!("[[fence.rules]]\nprefix = \"/signed/\"\nverify = \"hmac\"\n[verify]\n{verify}{}", keys.toml(ids))
}

async fn signed_harness(keys: &KeyFiles, ids: &[&str], verify: &str) -> Harness {
    let toml = signed_rules(keys, ids, verify);
    Harness::start_with(|c| *c = with_rules(c, &toml)).await
}

#[tokio::test]
async fn a_forged_huge_token_without_a_valid_signature_is_refused_and_changes_nothing() {
    let keys = KeyFiles::new();
    keys.write("2026-12", NEW);
    let h = signed_harness(&keys, &["2026-12"], "").await;
    let huge = u64::MAX.to_string();
    let forged = h.send("PUT", "/signed/a", &[("fencing-token", &huge)], "x").await;
    forged.assert_refused(428, "missing_signature");
    assert!(forged.json()["message"].as_str().unwrap().contains("fencing-token-signature"), "{:?}", forged.body);
    let expiry = now() + 600;
    let good = sign(NEW, "2026-12", "default", 5, expiry);
    let malformed = [
        good.replacen("v1.", "v2.", 1),
        format!("{}!", &good[..good.len() - 1]),
        good.replace(&format!(".{expiry}."), ".soon."),
        good.replacen('.', "..", 1),
    ];
    for bad in &malformed {
        let resp = h.send("PUT", "/signed/a", &[("fencing-token", &huge), (SIGNATURE, bad)], "x").await;
        resp.assert_refused(400, "invalid_signature");
    }
    let twice =
        h.send("PUT", "/signed/a", &[("fencing-token", "5"), (SIGNATURE, &good), (SIGNATURE, &good)], "x").await;
    twice.assert_refused(400, "invalid_signature");
    assert_eq!(h.proxy.max_seen("/signed/a"), None, "nothing moved max_seen");
    assert!(h.backend.requests().is_empty(), "nothing reached the backend");

    // Outside the rule a number is still a number; a write across the two is refused.
    assert_eq!(h.put("/open/a", 7, "v").await.status, 200);
    let moved = h
        .send("MOVE", "/signed/a", &[("fencing-token", "5"), (SIGNATURE, &good), ("destination", "/open/b")], "")
        .await;
    moved.assert_refused(400, "cross_verify_write");
    let deleted = h.send("DELETE", "/", &[("fencing-token", "9")], "").await;
    deleted.assert_refused(400, "cross_verify_write");
    assert_eq!(h.proxy.max_seen("/open/b"), None);
}

#[tokio::test]
async fn wrong_unknown_and_expired_signatures_are_refused_saying_which_and_never_the_secret() {
    let keys = KeyFiles::new();
    keys.write("2026-12", NEW);
    let h = signed_harness(&keys, &["2026-12"], "").await;
    let later = now() + 600;
    let cases = [
        (sign(OLD, "2026-12", "default", 50, later), "wrong_mac", "does not match"),
        (sign(NEW, "2026-12", "default", 49, later), "wrong_mac", "another token"),
        (sign(NEW, "2026-11", "default", 50, later), "unknown_key", "no key \"2026-11\""),
        (sign(NEW, "2026-12", "default", 50, now() - 3600), "expired", "expired at"),
    ];
    for (signature, reason, says) in cases {
        let resp = h.signed_put("/signed/a", 50, &signature).await;
        resp.assert_refused(403, "signature_rejected");
        let body = resp.json();
        assert_eq!((body["reason"].as_str(), body["resource"].as_str()), (Some(reason), Some("/signed/a")), "{body}");
        assert!(body["message"].as_str().unwrap().contains(says), "{body}");
        let text = String::from_utf8_lossy(&resp.body).into_owned();
        assert!(!text.contains(NEW) && !text.contains(OLD), "a secret in {text}");
    }
    assert_eq!(h.proxy.max_seen("/signed/a"), None);
    assert!(h.backend.requests().is_empty());
}

#[tokio::test]
async fn a_signed_token_is_accepted_and_must_still_be_above_max_seen() {
    let keys = KeyFiles::new();
    keys.write("2026-12", NEW);
    let h = signed_harness(&keys, &["2026-12"], "").await;
    let later = now() + 600;
    assert_eq!(h.signed_put("/signed/a", 100, &sign(NEW, "2026-12", "default", 100, later)).await.status, 200);
    assert_eq!(h.proxy.max_seen("/signed/a"), Some(100));
    let lower = h.signed_put("/signed/a", 50, &sign(NEW, "2026-12", "default", 50, later)).await;
    lower.assert_refused(409, "stale_token");
    assert_eq!(lower.json()["max_seen"], 100);
    let replayed = h.signed_put("/signed/a", 100, &sign(NEW, "2026-12", "default", 100, later)).await;
    replayed.assert_refused(409, "stale_token");
    // A signature binds the token, not the path: it is good on any key of its domain.
    assert_eq!(h.signed_put("/signed/b", 100, &sign(NEW, "2026-12", "default", 100, later)).await.status, 200);
    assert_eq!(h.applied_tokens("/signed/a"), [100]);
}

#[tokio::test]
async fn a_signature_made_for_another_token_domain_is_refused() {
    let keys = KeyFiles::new();
    keys.write("k", NEW);
    let toml = format!(
        "[[fence.rules]]\nprefix = \"/etcd/\"\ntoken_domain = \"etcd\"\nverify = \"hmac\"\n{}",
        keys.toml(&["k"])
    );
    let h = Harness::start_with(|c| *c = with_rules(c, &toml)).await;
    let later = now() + 600;
    let foreign = h.signed_put("/etcd/a", 7, &sign(NEW, "k", "default", 7, later)).await;
    foreign.assert_refused(403, "signature_rejected");
    assert_eq!(foreign.json()["reason"], "wrong_mac");
    assert_eq!(h.signed_put("/etcd/a", 7, &sign(NEW, "k", "etcd", 7, later)).await.status, 200);
}

#[tokio::test]
async fn two_keys_are_valid_at_once_and_a_reload_rotates_them() {
    let keys = KeyFiles::new();
    keys.write("2026-11", OLD);
    keys.write("2026-12", NEW);
    let h = signed_harness(&keys, &["2026-11", "2026-12"], "").await;
    let later = now() + 600;
    let put = async |token: u64, secret: &str, kid: &str| {
        h.signed_put("/signed/a", token, &sign(secret, kid, "default", token, later)).await
    };
    assert_eq!(put(1, OLD, "2026-11").await.status, 200);
    assert_eq!(put(2, NEW, "2026-12").await.status, 200);

    // Drop the old key: its signatures are refused, the new one's honoured.
    let report = h.proxy.reload(with_rules(&h.config, &signed_rules(&keys, &["2026-12"], ""))).unwrap();
    assert!(report.applied.iter().any(|l| l.starts_with("verify.hmac_keys")), "{report:?}");
    let dropped = put(3, OLD, "2026-11").await;
    dropped.assert_refused(403, "signature_rejected");
    assert_eq!(dropped.json()["reason"], "unknown_key");
    assert_eq!(put(3, NEW, "2026-12").await.status, 200);

    // Rotate the secret in place: a reload reads the file again.
    const NEWER: &str = "a-rotated-secret-in-the-same-file";
    keys.write("2026-12", NEWER);
    let report = h.proxy.reload(with_rules(&h.config, &signed_rules(&keys, &["2026-12"], ""))).unwrap();
    assert!(report.applied.iter().any(|l| l.contains("secret of key \"2026-12\" changed")), "{report:?}");
    assert!(!format!("{report:?}").contains(NEWER));
    put(4, NEW, "2026-12").await.assert_refused(403, "signature_rejected");
    assert_eq!(put(4, NEWER, "2026-12").await.status, 200);

    // A key file that no longer loads refuses the whole reload: the running keys stay.
    keys.write("2026-12", "short");
    let text = format!("[backend]\nurl = \"http://127.0.0.1:9\"\n{}", signed_rules(&keys, &["2026-12"], ""));
    let err = fencegate::Config::from_toml_str(&text).unwrap_err().to_string();
    assert!(err.contains("verify.hmac_keys[0].secret_file") && err.contains("2026-12"), "{err}");
    assert_eq!(put(5, NEWER, "2026-12").await.status, 200);
    assert_eq!(h.applied_tokens("/signed/a"), [1, 2, 3, 4, 5]);
}

#[tokio::test]
async fn deleting_a_key_file_and_reloading_revokes_the_key() {
    let keys = KeyFiles::new();
    let old = keys.write("2026-11", OLD);
    keys.write("2026-12", NEW);
    let h = signed_harness(&keys, &["2026-11", "2026-12"], "").await;
    let later = now() + 600;
    let put = async |token: u64, secret: &str, kid: &str| {
        h.signed_put("/signed/a", token, &sign(secret, kid, "default", token, later)).await
    };
    assert_eq!(put(1, OLD, "2026-11").await.status, 200);

    // The operator deletes the compromised key's file and reloads, the entry still written.
    std::fs::remove_file(&old).unwrap();
    let report = h.proxy.reload(with_rules(&h.config, &signed_rules(&keys, &["2026-11", "2026-12"], ""))).unwrap();
    assert!(report.applied.iter().any(|l| l.contains("key \"2026-11\" revoked")), "{report:?}");
    let revoked = put(2, OLD, "2026-11").await;
    revoked.assert_refused(403, "signature_rejected");
    assert_eq!(revoked.json()["reason"], "unknown_key");
    assert_eq!(put(2, NEW, "2026-12").await.status, 200, "the other key is untouched");

    // The last key's file deleted too: every signature is refused, and the config still loads
    // (a restart after the revocation starts).
    std::fs::remove_file(keys.path("2026-12")).unwrap();
    h.proxy.reload(with_rules(&h.config, &signed_rules(&keys, &["2026-11", "2026-12"], ""))).unwrap();
    put(3, NEW, "2026-12").await.assert_refused(403, "signature_rejected");
    assert_eq!(h.applied_tokens("/signed/a"), [1, 2]);
}

#[tokio::test]
async fn a_longer_rule_that_sets_no_domain_keeps_its_parents() {
    let keys = KeyFiles::new();
    keys.write("k", NEW);
    let toml = format!(
        "[[fence.rules]]\nprefix = \"/signed/\"\nverify = \"hmac\"\n\
         [[fence.rules]]\nprefix = \"/signed/own/\"\ntoken_domain = \"own\"\n\
         [[fence.rules]]\nprefix = \"/signed/own/tuned/\"\nmax_jump = 1000\n{}",
        keys.toml(&["k"])
    );
    let h = Harness::start_with(|c| *c = with_rules(c, &toml)).await;
    let later = now() + 600;
    let default = h.signed_put("/signed/own/tuned/a", 7, &sign(NEW, "k", "default", 7, later)).await;
    default.assert_refused(403, "signature_rejected");
    assert_eq!(h.signed_put("/signed/own/tuned/a", 7, &sign(NEW, "k", "own", 7, later)).await.status, 200);
}

#[tokio::test]
async fn refused_signatures_do_not_hold_a_signer_back() {
    // A MAC cannot be walked as an etcd revision can: counting its refusals would only let
    // anyone hold the key's signer back with garbage.
    let keys = KeyFiles::new();
    keys.write("k", NEW);
    let h = signed_harness(&keys, &["k"], "client_refusal_burst = 2\nkey_refusal_burst = 2\n").await;
    let later = now() + 600;
    for token in 1..=20 {
        let wrong = h.signed_put("/signed/a", token, &sign(OLD, "k", "default", token, later)).await;
        wrong.assert_refused(403, "signature_rejected");
    }
    assert_eq!(h.signed_put("/signed/a", 21, &sign(NEW, "k", "default", 21, later)).await.status, 200);
}

#[tokio::test]
async fn the_clock_skew_extends_an_expiry_by_its_allowance_and_no_more() {
    let keys = KeyFiles::new();
    keys.write("k", NEW);
    let h = signed_harness(&keys, &["k"], "clock_skew = \"2m\"\n").await;
    // 90 s ago is within 2 minutes (and past the default 30 s); 10 minutes ago is not.
    let recent = h.signed_put("/signed/a", 1, &sign(NEW, "k", "default", 1, now() - 90)).await;
    assert_eq!(recent.status, 200, "{:?}", recent.body);
    let stale = h.signed_put("/signed/a", 2, &sign(NEW, "k", "default", 2, now() - 600)).await;
    stale.assert_refused(403, "signature_rejected");
    let body = stale.json();
    assert_eq!((body["reason"].as_str(), body["clock_skew_s"].as_u64()), (Some("expired"), Some(120)), "{body}");
}

#[tokio::test]
async fn max_jump_bounds_a_token_by_max_seen_or_else_by_its_domain_counted_at_open_and_on_reload() {
    let rule =
        |domain: &str| format!("[[fence.rules]]\nprefix = \"/j/\"\ntoken_domain = \"{domain}\"\nmax_jump = 100\n");
    let first = rule("etcd");
    let mut h = Harness::start_with(|c| *c = with_rules(c, &first)).await;
    assert_eq!(h.put("/j/a", 1_000_000, "v").await.status, 200, "a domain without tokens has no bound");
    let jumped = h.put("/j/a", 1_000_101, "v").await;
    jumped.assert_refused(409, "token_jump");
    let body = jumped.json();
    assert_eq!(
        (body["token"].as_u64(), body["max_seen"].as_u64(), body["max_jump"].as_u64()),
        (Some(1_000_101), Some(1_000_000), Some(100))
    );
    assert_eq!(h.put("/j/a", 1_000_100, "v").await.status, 200);
    let fresh = h.put("/j/b", 1_000_201, "v").await;
    fresh.assert_refused(409, "token_jump");
    let body = fresh.json();
    assert_eq!((body["token_domain"].as_str(), body["domain_max"].as_u64()), (Some("etcd"), Some(1_000_100)), "{body}");
    assert_eq!(h.put("/j/b", 1_000_200, "v").await.status, 200, "the domain's highest token rises with each write");
    assert_eq!(h.put("/elsewhere", u64::MAX - 1, "v").await.status, 200, "no rule, no bound, another domain");
    assert_eq!(h.proxy.max_seen("/j/a"), Some(1_000_100));

    // Counted again from the table when the proxy opens.
    h.restart().await;
    h.put("/j/c", 1_000_301, "v").await.assert_refused(409, "token_jump");

    // And when a reload moves keys to another domain: /j/ keys are now counted in "zk".
    assert_eq!(h.proxy.domain_max("zk"), None);
    h.proxy.reload(with_rules(&h.config, &rule("zk"))).unwrap();
    poll_until("the reload counts the domain zk", || h.proxy.domain_max("zk") == Some(1_000_200)).await;
    let moved = h.put("/j/c", 1_000_301, "v").await;
    moved.assert_refused(409, "token_jump");
    assert_eq!(moved.json()["token_domain"], "zk");
    assert_eq!(h.put("/j/c", 1_000_300, "v").await.status, 200);
    assert_eq!(h.applied_tokens("/j/a"), [1_000_000, 1_000_100]);
}

#[tokio::test]
async fn max_jump_applies_to_signed_tokens_after_their_signature() {
    let keys = KeyFiles::new();
    keys.write("k", NEW);
    let toml =
        format!("[[fence.rules]]\nprefix = \"/signed/\"\nverify = \"hmac\"\nmax_jump = 10\n{}", keys.toml(&["k"]));
    let h = Harness::start_with(|c| *c = with_rules(c, &toml)).await;
    let later = now() + 600;
    assert_eq!(h.signed_put("/signed/a", 5, &sign(NEW, "k", "default", 5, later)).await.status, 200);
    h.signed_put("/signed/a", 16, &sign(NEW, "k", "default", 16, later)).await.assert_refused(409, "token_jump");
    h.signed_put("/signed/a", 16, &sign(NEW, "k", "default", 17, later))
        .await
        .assert_refused(403, "signature_rejected");
    assert_eq!(h.signed_put("/signed/a", 15, &sign(NEW, "k", "default", 15, later)).await.status, 200);
}

#[tokio::test]
async fn fencegate_sign_prints_a_signature_the_proxy_accepts() {
    let keys = KeyFiles::new();
    let file = keys.write("2026-12", NEW);
    let toml = format!(
        "[[fence.rules]]\nprefix = \"/zk/\"\ntoken_domain = \"zk\"\nverify = \"hmac\"\n{}",
        keys.toml(&["2026-12"])
    );
    let h = Harness::start_with(|c| *c = with_rules(c, &toml)).await;
    let run = |args: &[&str]| {
        let mut cmd = Command::new(BIN);
        cmd.arg("sign").arg("--key-file").arg(&file).args(["--kid", "2026-12"]).args(args);
        let out = cmd.output().unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).trim().to_owned();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    };
    let (ok, signature, err) = run(&["--domain", "zk", "--token", "4242", "--expires-in", "10m"]);
    assert!(ok, "{err}");
    assert_eq!(h.signed_put("/zk/a", 4242, &signature).await.status, 200, "{signature}");
    let expiry = now() + 600;
    let (ok, signature, err) = run(&["--domain", "zk", "--token", "4243", "--expiry", &expiry.to_string()]);
    assert!(ok, "{err}");
    assert_eq!(signature, sign(NEW, "2026-12", "zk", 4243, expiry), "the library's signature");
    assert_eq!(h.signed_put("/zk/a", 4243, &signature).await.status, 200);
    let (_, unbound, _) = run(&["--token", "4244", "--expires-in", "10m"]);
    h.signed_put("/zk/a", 4244, &unbound).await.assert_refused(403, "signature_rejected");

    let (ok, _, err) = run(&["--token", "1"]);
    assert!(!ok && err.contains("--expires-in"), "an expiry is required: {err}");
    std::fs::write(&file, "short\n").unwrap();
    let (ok, _, err) = run(&["--token", "1", "--expires-in", "1m"]);
    assert!(!ok && err.contains("at least 16"), "{err}");
}

/// The labelled lines of docs/tokens.md's test vector: `key`, `kid`, `domain`, `token`,
/// `expiry`, `header`.
fn documented_vector() -> std::collections::HashMap<String, String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/tokens.md");
    let text = std::fs::read_to_string(path).unwrap();
    let block = text.split("```text\n").find(|b| b.starts_with("key ")).expect("a ```text block starting with `key `");
    let block = block.split("```").next().unwrap();
    block
        .lines()
        .filter_map(|l| l.split_once(char::is_whitespace))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect()
}

#[test]
fn the_documented_test_vector_agrees_with_sign_and_with_python() {
    let v = documented_vector();
    let field = |k: &str| v.get(k).unwrap_or_else(|| panic!("docs/tokens.md's vector has no {k}: {v:?}")).clone();
    let (key, kid, domain, header) = (field("key"), field("kid"), field("domain"), field("header"));
    let (token, expiry): (u64, u64) = (field("token").parse().unwrap(), field("expiry").parse().unwrap());
    assert_eq!(sign(&key, &kid, &domain, token, expiry), header, "fencegate::fence::signature::sign");

    const PYTHON: &str = "import base64, hashlib, hmac, sys\n\
        key, kid, domain, token, expiry = sys.argv[1:]\n\
        msg = '\\n'.join(['v1', kid, domain, str(int(token)), str(int(expiry))]).encode()\n\
        mac = base64.urlsafe_b64encode(hmac.new(key.encode(), msg, hashlib.sha256).digest()).rstrip(b'=').decode()\n\
        print('v1.%s.%s.%s' % (kid, expiry, mac))";
    let out = match Command::new("python3")
        .arg("-c")
        .arg(PYTHON)
        .args([&key, &kid, &domain])
        .arg(token.to_string())
        .arg(expiry.to_string())
        .output()
    {
        Ok(out) => out,
        Err(e) if std::env::var_os("FG_SKIP_PYTHON").is_some() => {
            common::skips::skip(&format!("FG_SKIP_PYTHON is set and python3 cannot run: {e}"));
            return;
        }
        Err(e) => panic!("cannot run python3 ({e}): install it, or set FG_SKIP_PYTHON=1 to skip this check"),
    };
    assert!(out.status.success(), "python3: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(out.stdout).unwrap().trim(), header, "Python's hmac module");
}

/// A signed write that waits for its turn is checked again when the turn comes, against the
/// keys in force then: a key a reload withdrew (after a leak) lets nothing more through.
#[tokio::test]
async fn a_waiting_write_is_checked_again_against_the_keys_in_force_at_its_turn() {
    let keys = KeyFiles::new();
    keys.write("2026-11", OLD);
    keys.write("2026-12", NEW);
    let h = signed_harness(&keys, &["2026-11", "2026-12"], "").await;
    let later = now() + 600;
    let (first, second) = (sign(OLD, "2026-11", "default", 1, later), sign(OLD, "2026-11", "default", 2, later));
    let slow_headers = [("fencing-token", "1"), (SIGNATURE, first.as_str()), (common::DELAY_HEADER, "1500")];
    let queued_headers = [("fencing-token", "2"), (SIGNATURE, second.as_str())];
    let slow = h.send("PUT", "/signed/q", &slow_headers, "v");
    let queued = async {
        h.wait_queue_len("/signed/q", 1).await;
        let waiting = h.send("PUT", "/signed/q", &queued_headers, "v");
        let reload = async {
            h.wait_queue_len("/signed/q", 2).await;
            h.proxy.reload(with_rules(&h.config, &signed_rules(&keys, &["2026-12"], ""))).unwrap();
        };
        tokio::join!(waiting, reload).0
    };
    let (slow, queued) = tokio::join!(slow, queued);
    assert_eq!(slow.status, 200);
    queued.assert_refused(403, "signature_rejected");
    assert_eq!(queued.json()["reason"], "unknown_key");
    assert_eq!(h.applied_tokens("/signed/q"), [1]);
}
