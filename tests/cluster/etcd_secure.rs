//! The etcd client against a real etcd (started by `common::etcd_server`) as production runs
//! it: TLS with the right CA and only that, client certificates (`--client-cert-auth`),
//! authentication (a wrong password is a clear error, a token etcd invalidated or let expire
//! is renewed once, for calls and watches), a Mirror over all of it across a restart, a member
//! that cannot serve (a learner) passed over for the next, a full database (NOSPACE) returned
//! as it is, and the proxy configured for all of it verifying tokens.
//!
//! Skipped with a message where etcd is not installed; `FG_REQUIRE_SERVICES=1` makes that a
//! failure (`.ci/run` sets it).

use crate::common;

use std::time::Duration;

use common::builder::Deployment;
use common::etcd_server::{Etcd, EtcdSpec, ServerTls, start_etcd_with};
use common::pki::Pki;
use common::wait::DEADLINE;
use common::{eventually, poll_until, raw_request};
use fencegate::etcd_client::{
    Client, ClientOptions, Credentials, EtcdError, Mirror, MirrorOptions, Password, TlsOptions, Watch, prefix_end,
};

const ROOT_PASSWORD: &str = "root-secret";

/// etcd's cheapest bcrypt, so that each authentication costs etcd little.
const CHEAP_BCRYPT: &[&str] = &["--bcrypt-cost", "4"];

fn spec(pki: Option<&Pki>, client_certs: bool, args: &[&str]) -> EtcdSpec {
    let tls = pki.map(|pki| ServerTls {
        cert: pki.path("server.pem"),
        key: pki.path("server-key.pem"),
        client_ca: client_certs.then(|| pki.path("ca.pem")),
    });
    EtcdSpec { tls, args: args.iter().map(|a| a.to_string()).collect() }
}

/// TLS trusting the CA in the file `ca`, presenting the client certificate `cert` (`client`,
/// `client-no-cn`) if any.
fn tls(pki: &Pki, ca: &str, cert: Option<&str>) -> TlsOptions {
    TlsOptions {
        ca_file: Some(pki.path(ca)),
        cert_file: cert.map(|c| pki.path(&format!("{c}.pem"))),
        key_file: cert.map(|c| pki.path(&format!("{c}-key.pem"))),
        server_name: None,
    }
}

fn client(endpoints: &[impl AsRef<str>], tls: Option<TlsOptions>, user: Option<(&str, &str)>) -> Client {
    let credentials = user.map(|(u, p)| Credentials { username: u.into(), password: Password::new(p) });
    let options = ClientOptions {
        endpoints: endpoints.iter().map(|e| e.as_ref().to_owned()).collect(),
        request_timeout: Duration::from_secs(5),
        tls,
        credentials,
    };
    Client::from_options(&options).unwrap()
}

/// The authentications etcd has granted, from its metrics.
async fn authentications(etcd: &Etcd) -> u64 {
    etcd.metric(r#"grpc_server_handled_total{grpc_code="OK",grpc_method="Authenticate""#).await
}

#[tokio::test]
async fn over_https_the_client_trusts_the_right_ca_only() {
    let pki = Pki::new();
    let Some(etcd) = start_etcd_with(spec(Some(&pki), false, &[])).await else { return };
    let url = etcd.url();
    assert!(url.starts_with("https://"));
    let good = client(&[&url], Some(tls(&pki, "ca.pem", None)), None);
    let revision = good.put(b"/tls/a", b"1").await.unwrap();
    assert_eq!(good.create_revision(b"/tls/a").await.unwrap(), Some(revision));

    // Another CA, or the system's roots: no connection, and the reason says why.
    for tls in [Some(tls(&pki, "other-ca.pem", None)), None] {
        let wrong = client(&[&url], tls, None);
        match wrong.range(b"/tls/a", None).await {
            Err(EtcdError::Unreachable { reason, .. }) => assert!(reason.contains("certificate"), "{reason}"),
            other => panic!("a server certificate no trusted CA signed was accepted: {other:?}"),
        }
    }
    // The certificate names localhost and 127.0.0.1: a name it does not hold is refused.
    let named = |name: &str| {
        client(&[&url], Some(TlsOptions { server_name: Some(name.into()), ..tls(&pki, "ca.pem", None) }), None)
    };
    named("localhost").range(b"/tls/a", None).await.unwrap();
    let err = named("etcd.example").range(b"/tls/a", None).await.unwrap_err();
    assert!(matches!(&err, EtcdError::Unreachable { reason, .. } if reason.contains("not valid for name")), "{err}");
    // A plain client cannot speak to it, and says so rather than panic.
    assert!(matches!(Client::single(&url).range(b"/tls/a", None).await, Err(EtcdError::Unreachable { .. })));
}

#[tokio::test]
async fn a_member_that_requires_client_certificates_serves_only_clients_with_one() {
    let pki = Pki::new();
    let Some(etcd) = start_etcd_with(spec(Some(&pki), true, &[])).await else { return };
    let without = client(&[etcd.url()], Some(tls(&pki, "ca.pem", None)), None);
    let err = without.put(b"/mtls/a", b"1").await.unwrap_err();
    assert!(matches!(err, EtcdError::Unreachable { .. }), "{err}");

    let with = client(&[etcd.url()], Some(tls(&pki, "ca.pem", Some("client"))), None);
    let revision = with.put(b"/mtls/a", b"1").await.unwrap();
    // The watch goes through the same connector.
    let mut watch = Watch::open(&with, b"/mtls/", &prefix_end(b"/mtls/"), revision + 1).await.unwrap();
    let next = with.put(b"/mtls/b", b"2").await.unwrap();
    let events = watch.next().await.unwrap();
    assert_eq!((events[0].kv.key.as_slice(), events[0].kv.mod_revision), (&b"/mtls/b"[..], next));
}

#[tokio::test]
async fn with_authentication_the_client_signs_in_and_bad_credentials_are_clear_errors() {
    let Some(mut etcd) = start_etcd_with(spec(None, false, CHEAP_BCRYPT)).await else { return };
    let url = [etcd.url()];
    // Credentials for an etcd with authentication off: calls go without a token, until etcd
    // turns it on and refuses them ("user name is empty"); then the client authenticates.
    let root = client(&url, None, Some(("root", ROOT_PASSWORD)));
    root.put(b"/any/key", b"0").await.unwrap();
    etcd.enable_auth(ROOT_PASSWORD);
    etcd.add_user("app", "app-secret", "/app/");
    let revision = root.put(b"/any/key", b"1").await.unwrap();
    assert_eq!(root.range(b"/any/key", None).await.unwrap().0[0].mod_revision, revision);

    let err = client(&url, None, Some(("root", "not-the-password"))).put(b"/any/key", b"2").await.unwrap_err();
    assert!(
        matches!(&err, EtcdError::Unauthenticated { user, message, .. }
        if user == "root" && message.contains("authentication failed")),
        "{err}"
    );
    let err = client(&url, None, Some(("nobody", "x"))).range(b"/any/key", None).await.unwrap_err();
    assert!(matches!(err, EtcdError::Unauthenticated { .. }), "{err}");
    let err = client(&url, None, None).range(b"/any/key", None).await.unwrap_err();
    assert!(matches!(&err, EtcdError::Unauthenticated { message, .. } if message.contains("no credentials")), "{err}");

    // A user whose role covers /app/ only.
    let app = client(&url, None, Some(("app", "app-secret")));
    app.put(b"/app/x", b"1").await.unwrap();
    let err = app.put(b"/any/key", b"3").await.unwrap_err();
    assert!(matches!(&err, EtcdError::PermissionDenied { user, .. } if user == "app"), "{err}");
    assert_eq!(root.range(b"/any/key", None).await.unwrap().0[0].value, b"1", "the refused write did nothing");
}

#[tokio::test]
async fn a_token_etcd_invalidated_is_renewed_once_for_calls_and_watches() {
    let Some(mut etcd) = start_etcd_with(spec(None, false, CHEAP_BCRYPT)).await else { return };
    etcd.enable_auth(ROOT_PASSWORD);
    let c = client(&[etcd.url()], None, Some(("root", ROOT_PASSWORD)));
    let before = authentications(&etcd).await;
    c.put(b"/t/a", b"1").await.unwrap();
    c.put(b"/t/a", b"2").await.unwrap();
    assert_eq!(authentications(&etcd).await - before, 1, "one token for both calls");

    // A password change invalidates the user's tokens: the next call is refused, renews, and
    // goes through; the ones after it use the new token.
    etcd.passwd("root", ROOT_PASSWORD);
    let before = authentications(&etcd).await;
    let revision = c.put(b"/t/a", b"3").await.unwrap();
    c.range(b"/t/a", None).await.unwrap();
    assert_eq!(authentications(&etcd).await - before, 1, "renewed once");

    // So is a watch's creation.
    etcd.passwd("root", ROOT_PASSWORD);
    let before = authentications(&etcd).await;
    let mut watch = Watch::open(&c, b"/t/", &prefix_end(b"/t/"), revision + 1).await.unwrap();
    assert_eq!(authentications(&etcd).await - before, 1);
    let next = c.put(b"/t/b", b"4").await.unwrap();
    assert_eq!(watch.next().await.unwrap()[0].kv.mod_revision, next);
}

#[tokio::test]
async fn a_token_that_expired_is_renewed() {
    let args = [CHEAP_BCRYPT, &["--auth-token-ttl", "1"]].concat();
    let Some(mut etcd) = start_etcd_with(spec(None, false, &args)).await else { return };
    etcd.enable_auth(ROOT_PASSWORD);
    let c = client(&[etcd.url()], None, Some(("root", ROOT_PASSWORD)));
    c.put(b"/e/a", b"1").await.unwrap();

    // etcd forgets a simple token unused for the TTL, and a look with it would keep it alive.
    // So the test takes tokens after the client's last call, each used once: the first one
    // found expired was taken later than the client's, so the client's has expired too.
    const LOOK: Duration = Duration::from_millis(100);
    let body = format!("{{\"name\":\"root\",\"password\":\"{ROOT_PASSWORD}\"}}");
    let mut probes = Vec::new();
    for _ in 0..DEADLINE.as_millis() / LOOK.as_millis() {
        let r = raw_request(etcd.endpoint, "POST /v3/auth/authenticate HTTP/1.1\r\nHost: etcd", &body).await;
        probes.push(r.json()["token"].as_str().unwrap().to_owned());
    }
    let mut expired = false;
    for probe in &probes {
        let head = format!("POST /v3/kv/range HTTP/1.1\r\nHost: etcd\r\nAuthorization: {probe}");
        if raw_request(etcd.endpoint, &head, "{\"key\":\"L2UvYQ==\"}").await.status == 401 {
            expired = true;
            break;
        }
        tokio::time::sleep(LOOK).await;
    }
    assert!(expired, "no token expired within {DEADLINE:?}");
    let before = authentications(&etcd).await;
    assert_eq!(c.range(b"/e/a", None).await.unwrap().0[0].value, b"1");
    assert_eq!(authentications(&etcd).await - before, 1, "renewed once");
}

#[tokio::test]
async fn a_mirror_over_tls_and_authentication_follows_a_holder_across_a_restart() {
    let pki = Pki::new();
    let Some(mut etcd) = start_etcd_with(spec(Some(&pki), true, CHEAP_BCRYPT)).await else { return };
    etcd.enable_auth(ROOT_PASSWORD);
    // fencegate's user may read and write the locks' keys, nothing else.
    etcd.add_user("fencegate", "fg-secret", "/locks/");
    let url = [etcd.url()];
    // Over gRPC the token names the user, whatever Common Name the certificate has.
    let named = client(&url, Some(tls(&pki, "ca.pem", Some("client"))), Some(("fencegate", "fg-secret")));
    named.range(b"/locks/a", None).await.unwrap();
    let err = named.range(b"/other", None).await.unwrap_err();
    assert!(matches!(&err, EtcdError::PermissionDenied { user, .. } if user == "fencegate"), "{err}");

    let tls = || Some(tls(&pki, "ca.pem", Some("client-no-cn")));
    let fencegate = client(&url, tls(), Some(("fencegate", "fg-secret")));
    let holder = client(&url, tls(), Some(("root", ROOT_PASSWORD)));
    let options =
        MirrorOptions { max_lag: Duration::from_millis(800), instance: format!("test-{}", std::process::id()) };
    let mirror = Mirror::start(fencegate, b"/locks/".to_vec(), options);
    poll_until("the mirror catches up", || mirror.holder(b"/locks/a") == Ok(None)).await;

    let lease = holder.grant(Duration::from_secs(60)).await.unwrap();
    let held = holder.lock(b"/locks/a", lease).await.unwrap();
    let token = holder.create_revision(&held.key).await.unwrap().unwrap();
    poll_until("the mirror sees the holder", || mirror.holder(b"/locks/a") == Ok(Some(token))).await;

    // A restart cuts the watch and forgets every token: the mirror signs in again and reads
    // the locks again, and so does the holder's client to release the lock.
    etcd.restart().await;
    holder.unlock(&held).await.unwrap();
    poll_until("the mirror sees the release", || mirror.holder(b"/locks/a") == Ok(None)).await;
}

#[tokio::test]
async fn a_member_that_cannot_serve_passes_the_call_to_the_next() {
    let Some(mut etcd) = start_etcd_with(spec(None, false, CHEAP_BCRYPT)).await else { return };
    etcd.enable_auth(ROOT_PASSWORD);
    // A learner answers nearly everything with "etcdserver: rpc not supported for learner",
    // authentication too.
    let learner = etcd.add_learner().await;
    let alone = client(&[&learner.url], None, Some(("root", ROOT_PASSWORD)));
    let err = alone.put(b"/r/a", b"1").await.unwrap_err();
    assert!(matches!(&err, EtcdError::Unavailable { message, .. } if message.contains("learner")), "{err}");

    let c = client(&[learner.url.clone(), etcd.url()], None, Some(("root", ROOT_PASSWORD)));
    let revision = c.put(b"/r/a", b"1").await.unwrap();
    assert_eq!(c.endpoint(), etcd.url(), "the calls after it go to the member that served");
    let c = client(&[learner.url.clone(), etcd.url()], None, Some(("root", ROOT_PASSWORD)));
    let mut watch = Watch::open(&c, b"/r/", &prefix_end(b"/r/"), revision + 1).await.unwrap();
    let next = c.put(b"/r/b", b"2").await.unwrap();
    assert_eq!(watch.next().await.unwrap()[0].kv.mod_revision, next);
}

/// A loopback address whose handshakes go unanswered: a listener that never accepts, its
/// queue of one full, so the kernel drops every later SYN. Kept open by what it returns.
async fn silent_address() -> (std::net::TcpListener, Vec<tokio::net::TcpStream>, std::net::SocketAddr) {
    use rustix::net::{AddressFamily, SocketType};
    let fd = rustix::net::socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    rustix::net::bind(&fd, &std::net::SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
    rustix::net::listen(&fd, 0).unwrap();
    let listener = std::net::TcpListener::from(fd);
    let addr = listener.local_addr().unwrap();
    let mut queued = Vec::new();
    for _ in 0..16 {
        match tokio::time::timeout(Duration::from_millis(300), tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(stream)) => queued.push(stream),
            Ok(Err(e)) => panic!("connect to the silent listener: {e}"),
            // A handshake that goes unanswered: the queue is full.
            Err(_) => return (listener, queued, addr),
        }
    }
    panic!("the listener's queue never filled")
}

/// A member that never answers the TCP handshake has taken nothing: a write goes on to the
/// next member instead of ending with an unknown outcome.
#[tokio::test]
async fn a_member_that_never_answers_the_handshake_is_passed_over_for_a_write() {
    let Some(etcd) = start_etcd_with(spec(None, false, &[])).await else { return };
    let (_listener, _queued, silent) = silent_address().await;
    let c = client(&[format!("http://{silent}"), etcd.url()], None, None);
    let revision = c.put(b"/silent/a", b"1").await.unwrap();
    assert_eq!(c.endpoint(), etcd.url(), "the write went to the member that answers");
    assert_eq!(c.range(b"/silent/a", None).await.unwrap().1, revision);
}

#[tokio::test]
async fn a_full_database_is_no_space_and_is_not_tried_elsewhere() {
    let Some(etcd) = start_etcd_with(spec(None, false, &["--quota-backend-bytes", "65536"])).await else { return };
    // A second endpoint nothing listens on: were NOSPACE sent on to it, the error would be
    // that one's.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let c = client(&[etcd.url(), format!("http://{dead}")], None, None);
    let value = vec![b'x'; 30_000];
    let mut puts = 0;
    let err = loop {
        match c.put(b"/big", &value).await {
            Ok(_) => puts += 1,
            Err(e) => break e,
        }
        assert!(puts < 100, "etcd never ran out of its 64 KiB");
    };
    assert!(matches!(err, EtcdError::NoSpace { .. }), "{err}");
    assert!(err.to_string().contains("NOSPACE"), "{err}");
    assert_eq!(c.endpoint(), etcd.url());
    assert_eq!(c.range(b"/big", None).await.unwrap().0.len(), 1, "reads still work");
}

#[tokio::test]
async fn the_proxy_verifies_tokens_against_an_etcd_with_tls_and_authentication() {
    let pki = Pki::new();
    let Some(mut etcd) = start_etcd_with(spec(Some(&pki), true, CHEAP_BCRYPT)).await else { return };
    etcd.enable_auth(ROOT_PASSWORD);
    etcd.add_user("fencegate", "fg-secret", "/locks/");
    let password_file = pki.path("etcd-password");
    std::fs::write(&password_file, "fg-secret\n").unwrap();
    const ADMIN: &str = "an-admin-token-of-some-length";
    let extra = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"{ADMIN}\"\n[verify]\nmax_lag = \"800ms\"\n\
         [[fence.rules]]\nprefix = \"/accounts/\"\nverify = \"etcd\"\nlock = \"/locks/accounts/{{2}}\"\n\
         [etcd]\nendpoints = [\"{}\"]\nusername = \"fencegate\"\npassword_file = {:?}\n\
         [etcd.tls]\nca_file = {:?}\ncert_file = {:?}\nkey_file = {:?}\n",
        etcd.url(),
        password_file.display().to_string(),
        pki.path("ca.pem").display().to_string(),
        pki.path("client-no-cn.pem").display().to_string(),
        pki.path("client-no-cn-key.pem").display().to_string(),
    );
    let d = Deployment::builder().config_extra(&extra).start().await;
    let admin = d.proxy().admin_addr().await;
    let holder_seen = async || {
        let head = format!("GET /locks/locks/accounts/42 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}");
        let r = raw_request(admin, &head, "").await;
        (r.status == 200).then(|| r.json()["holder"].as_u64())
    };

    let holder = client(&[etcd.url()], Some(tls(&pki, "ca.pem", Some("client-no-cn"))), Some(("root", ROOT_PASSWORD)));
    let lease = holder.grant(Duration::from_secs(60)).await.unwrap();
    let held = holder.lock(b"/locks/accounts/42", lease).await.unwrap();
    let token = u64::try_from(holder.create_revision(&held.key).await.unwrap().unwrap()).unwrap();
    eventually("the proxy sees the holder", async || holder_seen().await == Some(Some(token))).await;
    let put = async |token: u64| {
        raw_request(d.addr(), &format!("PUT /accounts/42 HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}"), "v").await
    };
    assert_eq!(put(token).await.status, 200);
    put(token + 1).await.assert_refused(409, "not_lock_holder");
}
