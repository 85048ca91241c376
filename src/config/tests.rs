//! Loading, defaults, validation messages and environment overrides.

use super::*;

const MINIMAL: &str = "[backend]\nurl = \"http://127.0.0.1:9000\"\n";

#[test]
fn minimal_file_gets_documented_defaults() {
    let c = Config::from_toml_str(MINIMAL).unwrap();
    assert_eq!(c.server.listen, "127.0.0.1:8080".parse().unwrap());
    assert_eq!(c.backend.connect_timeout, Duration::from_secs(2));
    assert_eq!(c.backend.request_timeout, Duration::from_secs(30));
    assert_eq!(c.fence.header.as_str(), "fencing-token");
    let unfenced: Vec<&str> = c.fence.unfenced_methods.iter().map(Method::as_str).collect();
    assert_eq!(unfenced, ["GET", "HEAD", "OPTIONS", "TRACE", "PROPFIND"]);
    assert_eq!(c.fence.equal_token, EqualToken::Reject);
    assert_eq!(c.fence.missing_token, MissingToken::Reject);
    assert_eq!(c.fence.quarantine, c.backend.request_timeout);
    assert_eq!(c.store.dir, PathBuf::from("data"));
    assert_eq!(c.store.sync, SyncMode::Always);
    assert_eq!(c.store.writer_scheduling, WriterScheduling::Batch);
    assert_eq!(c.store.max_table_bytes, 1 << 30);
    assert_eq!(c.backend.protocol, BackendProtocol::Http);
}

#[test]
fn the_backend_protocol_is_one_fencegate_knows() {
    let with =
        |p: &str| Config::from_toml_str(&format!("[backend]\nurl = \"http://127.0.0.1:9000\"\nprotocol = \"{p}\"\n"));
    assert_eq!(with("HTTP").unwrap().backend.protocol, BackendProtocol::Http);
    let err = with("ftp").unwrap_err().to_string();
    assert!(err.contains("backend.protocol") && err.contains("\"http\""), "{err}");
}

#[test]
fn unknown_key_is_named_in_the_error() {
    let err = Config::from_toml_str(&format!("{MINIMAL}[fence]\nequal_tokens = \"accept\"\n")).unwrap_err();
    assert!(err.to_string().contains("equal_tokens"), "{err}");
}

#[test]
fn bad_values_name_their_key() {
    for (extra, key) in [
        ("[fence]\nequal_token = \"maybe\"\n", "fence.equal_token: \"maybe\": expected \"reject\" or \"accept\""),
        ("[store]\nsync = \"sometimes\"\n", "store.sync"),
        (
            "[store]\nwriter_scheduling = \"idle\"\n",
            "store.writer_scheduling: \"idle\": expected \"batch\" or \"normal\"",
        ),
        ("[store]\nmax_table_bytes = 1048575\n", "store.max_table_bytes: must be at least 1048576"),
        ("[backend]\nurl = \"ftp://x\"\n", "backend.url"),
        ("[fence]\nqueue_timeout = \"soon\"\n", "fence.queue_timeout"),
        ("[[fence.scopes]]\nprefix = \"/a/../b/\"\n", "fence.scopes[0].prefix"),
        ("[[fence.scopes]]\nprefix = \"/a/b/\"\nsegments = 1\n", "fence.scopes[0].segments"),
        ("[server]\nlisten = \"localhost\"\n", "server.listen"),
        ("[fence]\nquarantine = \"400000000000years\"\n", "fence.quarantine"),
        ("[limits]\nheader_read_timeout = \"366days\"\n", "365 days"),
        ("[limits]\nmax_header_bytes = 10\n", "limits.max_header_bytes"),
        ("[paths]\ntrailing_slash = \"sometimes\"\n", "paths.trailing_slash"),
        ("[paths]\nmerge_slashes = \"maybe\"\n", "merge_slashes"),
        ("[fence]\nmethods = [\"PUT\"]\n", "fence.methods: is replaced by fence.unfenced_methods"),
        ("[fence]\nunfenced_methods = [\"GET\", \"connect\"]\n", "fence.unfenced_methods: CONNECT"),
        ("[fence]\nunfenced_methods = [\"GE T\"]\n", "fence.unfenced_methods"),
        ("[[fence.scopes]]\nprefix = \"/db\"\n[[fence.rules]]\nprefix = \"/db/q/\"\n", "fence.rules[0].prefix"),
        ("[[fence.rules]]\nprefix = \"/q/\"\n[[fence.rules]]\nprefix = \"/q/\"\n", "fence.rules[1].prefix"),
    ] {
        let text = if extra.starts_with("[backend]") { extra.to_string() } else { format!("{MINIMAL}{extra}") };
        let err = Config::from_toml_str(&text).unwrap_err();
        assert!(err.to_string().contains(key), "{extra:?} gave {err}");
    }
}

#[test]
fn environment_overrides_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f.toml");
    std::fs::write(&file, MINIMAL).unwrap();
    let env = HashMap::from([
        ("FENCEGATE_FENCE__EQUAL_TOKEN".to_string(), "accept".to_string()),
        ("FENCEGATE_BACKEND__URL".to_string(), "http://127.0.0.1:9100".to_string()),
        ("FENCEGATE_FENCE__UNFENCED_METHODS".to_string(), "GET,HEAD".to_string()),
    ]);
    let c = Config::load(&file, Some(env)).unwrap();
    assert_eq!(c.fence.equal_token, EqualToken::Accept);
    assert_eq!(c.backend.url.port_u16(), Some(9100));
    assert_eq!(c.fence.unfenced_methods, vec![Method::GET, Method::HEAD]);
    let old = HashMap::from([("FENCEGATE_FENCE__METHODS".to_string(), "PUT,DELETE".to_string())]);
    let err = Config::load(&file, Some(old)).unwrap_err().to_string();
    assert!(err.contains("fence.unfenced_methods"), "the message names the key that replaced it: {err}");
    let typo = HashMap::from([
        ("FENCEGATE_FENCE__EQUAL".to_string(), "accept".to_string()),
        ("FENCEGATE_BACKEND__URL".to_string(), "http://127.0.0.1:9100".to_string()),
    ]);
    let err = Config::load(&file, Some(typo)).unwrap_err().to_string();
    assert!(err.starts_with("environment variable FENCEGATE_FENCE__EQUAL:"), "names the variable: {err}");
    // Kubernetes service links, and strays without `__`, are not settings: the file loads.
    let links = HashMap::from([
        ("FENCEGATE_SERVICE_HOST".to_string(), "10.0.0.1".to_string()),
        ("FENCEGATE_PORT_8080_TCP".to_string(), "tcp://10.0.0.1:8080".to_string()),
        ("FENCEGATE_BACKEND_URL".to_string(), "not a url".to_string()),
    ]);
    assert_eq!(Config::load(&file, Some(links)).unwrap(), Config::from_toml_str(MINIMAL).unwrap());
}

#[test]
fn effective_settings_round_trip() {
    let c = Config::from_toml_str(MINIMAL).unwrap();
    let again = Config::from_toml_str(&c.to_toml()).unwrap();
    assert_eq!(c.to_toml(), again.to_toml());
}

#[test]
fn the_admin_token_comes_from_its_file_and_is_never_printed() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("token");
    std::fs::write(&file, "s3cret-admin-token-value\n").unwrap();
    let text =
        format!("{MINIMAL}[admin]\nlisten = \"127.0.0.1:8081\"\ntoken_file = {:?}\n", file.display().to_string());
    let c = Config::from_toml_str(&text).unwrap();
    assert_eq!(c.admin.token.as_deref(), Some("s3cret-admin-token-value"));
    assert!(!c.to_toml().contains("s3cret"), "check must not print the token");
    std::fs::write(&file, "short").unwrap();
    let err = Config::from_toml_str(&text).unwrap_err();
    assert!(err.to_string().contains("at least 16"), "{err}");
    assert!(Config::from_toml_str(MINIMAL).unwrap().admin.listen.is_none(), "off unless configured");
}

#[test]
fn the_backend_connection_bound_has_a_default_a_floor_and_a_wait() {
    let c = Config::from_toml_str(MINIMAL).unwrap();
    assert_eq!((c.backend.max_connections, c.backend.pool_timeout), (1024, Duration::from_secs(5)));
    let with = |keys: &str| Config::from_toml_str(&format!("{MINIMAL}{keys}"));
    let c = with("max_connections = 1\npool_timeout = \"250ms\"\n").unwrap();
    assert_eq!((c.backend.max_connections, c.backend.pool_timeout), (1, Duration::from_millis(250)));
    for (keys, error) in [
        ("max_connections = 0\n", "backend.max_connections: 0 is outside 1..=1048576"),
        ("max_connections = 2000000\n", "backend.max_connections"),
        ("pool_timeout = \"0s\"\n", "backend.pool_timeout: must be greater than zero"),
        ("pool_timeout = \"later\"\n", "backend.pool_timeout"),
    ] {
        let err = with(keys).unwrap_err().to_string();
        assert!(err.contains(error), "{keys:?} gave {err}");
    }
    assert!(with("max_connections = -1\n").is_err(), "not a count");
}

#[test]
fn rules_that_verify_against_etcd_are_checked_whole() {
    const ETCD: &str = "[etcd]\nendpoints = [\"http://127.0.0.1:2379\"]\n";
    let rule = |prefix: &str, lock: &str| {
        format!("[[fence.rules]]\nprefix = {prefix:?}\nverify = \"etcd\"\nlock = {lock:?}\n")
    };
    let ok = Config::from_toml_str(&format!("{MINIMAL}{ETCD}{}", rule("/accounts/", "/locks/accounts/{2}"))).unwrap();
    let r = &ok.fence.rules[0];
    assert_eq!((r.verify, r.lock.as_ref().map(|t| t.as_str())), (Some(Verify::Etcd), Some("/locks/accounts/{2}")));
    assert_eq!(ok.verify.max_lag, Duration::from_secs(2));
    assert_eq!(ok.etcd.request_timeout, Duration::from_secs(2));
    for (text, key, says) in [
        (rule("/a/", "/locks/a/{2}"), "etcd.endpoints", "name its members"),
        (format!("{ETCD}{}", rule("/a/", "locks/{2}")), "fence.rules[0].lock", "must start with /"),
        (
            format!("{ETCD}[[fence.rules]]\nprefix = \"/a/\"\nverify = \"etcd\"\n"),
            "fence.rules[0].lock",
            "needs the lock",
        ),
        (format!("{ETCD}[[fence.rules]]\nprefix = \"/a/\"\nlock = \"/l/{{2}}\"\n"), "fence.rules[0].lock", "only with"),
        (
            format!("{ETCD}[[fence.rules]]\nprefix = \"/a/\"\nverify = \"chubby\"\n"),
            "fence.rules[0].verify",
            "expected",
        ),
        (
            format!("{ETCD}{}{}", rule("/a/", "/locks/{2}"), rule("/b/", "/locks/{2}/sub")),
            "fence.rules[0].lock",
            "prefix of the",
        ),
        (
            format!("{ETCD}[[fence.scopes]]\nprefix = \"/a/\"\n{}", rule("/", "/locks/{2}")),
            "fence.rules[0].lock",
            "keys of 1 segments",
        ),
        ("[etcd]\nendpoints = [\"127.0.0.1:2379\"]\n".to_owned(), "etcd.endpoints[0]", "expected http://"),
        ("[verify]\nmax_lag = \"0s\"\n".to_owned(), "verify.max_lag", "greater than zero"),
    ] {
        let err = Config::from_toml_str(&format!("{MINIMAL}{text}")).unwrap_err().to_string();
        assert!(err.contains(key) && err.contains(says), "{text}: {err}");
    }
}

#[test]
fn the_etcd_store_takes_its_own_settings_and_none_of_the_file_store_s() {
    let etcd = "[etcd]\nendpoints = [\"http://127.0.0.1:2379\"]\n";
    let store = |extra: &str| {
        format!("{MINIMAL}{etcd}[store]\nkind = \"etcd\"\nadvertise = \"http://127.0.0.1:8080\"\n{extra}")
    };
    let c = Config::from_toml_str(&store("")).unwrap();
    let e = c.store.etcd.as_ref().unwrap();
    assert_eq!((c.store.kind, e.prefix.as_str()), (StoreKind::Etcd, "/fencegate/"));
    assert_eq!((e.lease_ttl, e.lease_margin), (Duration::from_secs(5), Duration::from_secs(1)));
    for (extra, refused) in [
        ("dir = \"data\"\n", "store.dir: a file store's setting"),
        ("sync = \"never\"\n", "store.sync: a file store's setting"),
        ("writer_scheduling = \"normal\"\n", "store.writer_scheduling: a file store's setting"),
        ("prefix = \"/fg\"\n", "store.prefix: \"/fg\": must end with \"/\""),
        ("lease_ttl = \"1s\"\n", "store.lease_ttl: must be whole seconds, at least 2s"),
        ("lease_ttl = \"2500ms\"\n", "store.lease_ttl"),
        ("lease_margin = \"3s\"\n", "store.lease_margin: must be at most half"),
    ] {
        let err = Config::from_toml_str(&store(extra)).unwrap_err().to_string();
        assert!(err.contains(refused), "{extra}: {err}");
    }
    for advertise in ["http://127.0.0.1:8080/x", "ftp://127.0.0.1:8080", "127.0.0.1:8080"] {
        let text = format!("{MINIMAL}{etcd}[store]\nkind = \"etcd\"\nadvertise = \"{advertise}\"\n");
        let err = Config::from_toml_str(&text).unwrap_err().to_string();
        assert!(err.contains("store.advertise"), "{advertise}: {err}");
    }
    let none = format!("{MINIMAL}[store]\nkind = \"etcd\"\n");
    assert!(Config::from_toml_str(&none).unwrap_err().to_string().contains("store.advertise"));
    let no_endpoints = format!("{MINIMAL}[store]\nkind = \"etcd\"\nadvertise = \"http://127.0.0.1:8080\"\n");
    assert!(Config::from_toml_str(&no_endpoints).unwrap_err().to_string().contains("etcd.endpoints"));
    let slow = format!(
        "{MINIMAL}[etcd]\nendpoints = [\"http://127.0.0.1:2379\"]\nrequest_timeout = \"4s\"\n[store]\nkind = \"etcd\"\nadvertise = \"http://127.0.0.1:8080\"\n"
    );
    assert!(Config::from_toml_str(&slow).unwrap_err().to_string().contains("etcd.request_timeout"));
    let file = format!("{MINIMAL}[store]\nprefix = \"/fg/\"\n");
    assert!(Config::from_toml_str(&file).unwrap_err().to_string().contains("store.prefix: an etcd store's setting"));
}

#[test]
fn s3_credentials_take_their_secret_from_a_file_and_never_print_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("secret");
    std::fs::write(&file, "s3cret-access-key\n").unwrap();
    let s3 = "[backend]\nurl = \"http://127.0.0.1:9000\"\nprotocol = \"s3\"\n[s3.credentials]\n";
    let with = |lines: &str| Config::from_toml_str(&format!("{s3}{lines}"));
    let file_line = format!("secret_access_key_file = {:?}\n", file.display().to_string());
    let c = with(&format!("access_key_id = \"AKIDEXAMPLE\"\n{file_line}")).unwrap();
    let credentials = c.s3.credentials.as_ref().unwrap();
    assert_eq!(credentials.secret_access_key.expose(), "s3cret-access-key", "trimmed");
    assert_eq!((credentials.region.as_str(), credentials.access_key_id.as_str()), (DEFAULT_REGION, "AKIDEXAMPLE"));
    assert!(!c.to_toml().contains("s3cret") && !format!("{c:?}").contains("s3cret"), "never printed");
    assert!(!c.s3.conditional_deletes, "off by default: s3s-fs deletes whatever If-Match says");
    let region = with(&format!("access_key_id = \"AKIDEXAMPLE\"\nregion = \"eu-west-3\"\n{file_line}")).unwrap();
    assert_eq!(region.s3.credentials.unwrap().region, "eu-west-3");
    let missing = with("access_key_id = \"AKIDEXAMPLE\"\nsecret_access_key_file = \"/nonexistent/s\"\n");
    let err = missing.unwrap_err().to_string();
    assert!(err.contains("s3.credentials.secret_access_key_file") && err.contains("/nonexistent/s"), "{err}");
    let err = with(&format!("access_key_id = \"AK/ID\"\n{file_line}")).unwrap_err().to_string();
    assert!(err.contains("s3.credentials.access_key_id"), "{err}");
    let http = format!("{MINIMAL}[s3.credentials]\naccess_key_id = \"AKIDEXAMPLE\"\n{file_line}");
    let err = Config::from_toml_str(&http).unwrap_err().to_string();
    assert!(err.contains("s3.credentials") && err.contains("\"s3\""), "{err}");
    let err = Config::from_toml_str(&format!("{MINIMAL}[s3]\nconditional_deletes = true\n")).unwrap_err();
    assert!(err.to_string().contains("s3.conditional_deletes"), "{err}");
}

#[test]
fn s3_mode_takes_pin_rules_either_way() {
    let s3 = "[backend]\nurl = \"http://127.0.0.1:9000\"\nprotocol = \"s3\"\n";
    for pin in ["etag", "off"] {
        let c = Config::from_toml_str(&format!("{s3}[[fence.rules]]\nprefix = \"/b/\"\npin = \"{pin}\"\n"));
        assert!(c.is_ok(), "{pin}: {c:?}");
    }
}

#[test]
fn an_https_advertise_needs_the_listener_to_serve_tls() {
    let etcd = "[backend]\nurl = \"http://127.0.0.1:9\"\n[store]\nkind = \"etcd\"\nadvertise = \"https://10.0.0.5:8443\"\n\
                [etcd]\nendpoints = [\"http://127.0.0.1:2379\"]\n";
    let err = Config::from_toml_str(etcd).unwrap_err().to_string();
    assert!(err.contains("store.advertise") && err.contains("[server.tls]"), "{err}");
    let ca = etcd.replace(
        "advertise = \"https://10.0.0.5:8443\"",
        "advertise = \"http://10.0.0.5:8080\"\npeer_ca = \"/nonexistent/ca.pem\"",
    );
    let err = Config::from_toml_str(&ca).unwrap_err().to_string();
    assert!(err.contains("store.peer_ca"), "{err}");
}
