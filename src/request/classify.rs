//! Classification: what a request asks of the fence, decided from its head and the settings
//! alone, without I/O. Everything a request may be refused for before it waits or touches the
//! store is refused here.

use http::header::{CONNECTION, HeaderName, UPGRADE};
use http::uri::PathAndQuery;
use http::{Method, Request};
use hyper::body::Body;

use super::destination::{DESTINATION, Destination, destination};
use super::refusal::Refusal;
use crate::config::{Config, DEFAULT_DOMAIN, FenceConfig, LimitsConfig, MissingToken, Rule};
use crate::fence::token::{self, TokenError};
pub use crate::fence::{Coverage, EqualToken, Touch};
use crate::fence::{keys, path};

/// What is done with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Not a fenced method: forwarded as sent, unchecked.
    Pass {
        /// The request target as the client sent it.
        target: PathAndQuery,
    },
    /// A fenced method without a token under `fence.missing_token = "forward"`: forwarded
    /// unchecked, but at its canonical target and within the body limit.
    Unchecked {
        /// The canonical request target.
        target: PathAndQuery,
        /// Most body bytes forwarded.
        body_limit: Option<u64>,
    },
    /// A fenced write: checked against, and advancing, every key it touches.
    Write(Write),
}

/// A fenced write, as the fence sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// The token the write carries.
    pub token: u64,
    /// Every fence key the backend may change with it.
    pub touches: Vec<Touch>,
    /// The canonical `Destination` (WebDAV MOVE and COPY), when the write has one.
    pub destination: Option<Destination>,
    /// The canonical request target that is forwarded (path and query).
    pub target: PathAndQuery,
    /// Most body bytes forwarded.
    pub body_limit: Option<u64>,
    /// What a token equal to `max_seen` gets: the strictest setting among the keys it touches.
    pub equal: EqualToken,
    /// The etcd locks whose current holder the token must be (`verify = "etcd"`), one per
    /// key; empty when the write's tokens are not verified.
    pub locks: Vec<String>,
}

/// Headers with which web frameworks let a request claim another method than its own. A
/// backend that honours one turns a `GET` into a write, so the method they name is fenced as if
/// it were the request's. Overrides in the query string or the body are not seen here.
static METHOD_OVERRIDES: [HeaderName; 3] = [
    HeaderName::from_static("x-http-method-override"),
    HeaderName::from_static("x-http-method"),
    HeaderName::from_static("x-method-override"),
];

/// Decides what to do with a request, from its method, target, headers and declared body size.
pub fn classify<B: Body>(req: &Request<B>, config: &Config) -> Result<Plan, Refusal> {
    check_limits(req, &config.limits)?;
    check_connection(req, config)?;
    let overridden = method_override(req)?;
    let unfenced = |m: &[u8]| listed(&config.fence.unfenced_methods, m);
    if unfenced(req.method().as_str().as_bytes()) && overridden.is_none_or(unfenced) {
        let target = req.uri().path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        return Ok(Plan::Pass { target });
    }
    let body_limit = check_fenced(req, &config.limits)?;

    // The key and the forwarded path come from the same canonical string.
    let canonical = path::canonicalize(req.uri().path(), &config.paths)?;
    let key = keys::resource_key(&canonical, &config.fence.scopes).to_owned();
    // The backend may act on the request's own method or on the one an override names (web
    // frameworks upper-case override values; WebDAV servers ignore overrides): fence what
    // either may change.
    let real = req.method().as_str().as_bytes();
    let claimed = overridden.map(<[u8]>::to_ascii_uppercase);
    let methods = || std::iter::once(real).chain(claimed.as_deref());
    let subtree = methods().any(|m| listed(&config.fence.subtree_methods, m));
    let touch = |key: String, path: &str| {
        // A key a scope shortened already holds the whole subtree of the path.
        let coverage = if subtree && key == path { Coverage::Subtree } else { Coverage::Key };
        Touch { key, coverage }
    };
    let source = touch(key, &canonical);
    let destination = match methods().any(|m| m == b"MOVE" || m == b"COPY") {
        true => Some(destination(req, config)?.ok_or_else(|| Refusal::InvalidHeader {
            name: DESTINATION.to_string(),
            reason: "MOVE and COPY need one".into(),
        })?),
        false => None,
    };
    let mut touches = Vec::with_capacity(2);
    // COPY only reads its source: fencing it would refuse other locks' holders copying from it.
    if !methods().all(|m| m == b"COPY") {
        touches.push(source);
    }
    if let Some(d) = &destination {
        touches.push(touch(keys::resource_key(&d.path, &config.fence.scopes).to_owned(), &d.path));
    }
    one_domain(&touches, &config.fence.rules)?;
    let target = match req.uri().query() {
        Some(q) => format!("{canonical}?{q}"),
        None => canonical,
    };
    let target = PathAndQuery::try_from(target)
        .map_err(|e| Refusal::InvalidPath(path::PathError::Unparseable(e.to_string())))?;

    let values = req.headers().get_all(&config.fence.header).iter().map(|v| v.as_bytes());
    let token = match token::from_values(values) {
        Ok(token) => token,
        Err(TokenError::Missing) if config.fence.missing_token == MissingToken::Forward => {
            return Ok(Plan::Unchecked { target, body_limit });
        }
        Err(TokenError::Missing) => return Err(Refusal::MissingToken { header: config.fence.header.to_string() }),
        Err(e) => return Err(e.into()),
    };
    let locks = super::locks::lock_names(&touches, &config.fence).map_err(Refusal::Lock)?;
    // Only the verified holder can present its own revision: equal passes where it is checked.
    let equal = if locks.is_empty() { equal_token(&touches, &config.fence) } else { EqualToken::Accept };
    Ok(Plan::Write(Write { token, touches, destination, target, body_limit, equal, locks }))
}

/// What a token equal to `max_seen` gets in a write of `touches`: `Reject` if any key it may
/// change is under `Reject`. A key's setting is that of the longest rule prefix over it that
/// sets one, else `fence.equal_token`; a subtree's is that of its node and of every rule inside
/// it, since its check covers every key below.
fn equal_token(touches: &[Touch], fence: &FenceConfig) -> EqualToken {
    if !fence.rules.iter().any(|r| r.equal_token.is_some()) {
        return fence.equal_token;
    }
    let setting = |key: &str| {
        let rules = fence.rules.iter().filter(|r| r.equal_token.is_some() && keys::in_scope(key, &r.prefix));
        rules.max_by_key(|r| r.prefix.len()).and_then(|r| r.equal_token).unwrap_or(fence.equal_token)
    };
    let strict = touches.iter().any(|touch| {
        setting(&touch.key) == EqualToken::Reject
            || touch.coverage == Coverage::Subtree && {
                let here = crate::fence::node(&touch.key);
                fence.rules.iter().any(|r| {
                    r.equal_token == Some(EqualToken::Reject)
                        && crate::fence::covers(here, crate::fence::node(&r.prefix))
                })
            }
    });
    if strict { EqualToken::Reject } else { EqualToken::Accept }
}

/// Whether `method` is one of `methods`, compared exactly: method names are case-sensitive.
fn listed(methods: &[Method], method: &[u8]) -> bool {
    methods.iter().any(|m| m.as_str().as_bytes() == method)
}

/// Refuses a write whose keys' tokens come from different counters: a subtree that holds keys
/// of another token domain, or a MOVE between domains. Comparing tokens across them means
/// nothing, and a floor would lock the other domain's holders out for good.
fn one_domain(touches: &[Touch], rules: &[Rule]) -> Result<(), Refusal> {
    if rules.is_empty() {
        return Ok(());
    }
    let domain_of = |key: &str| {
        let rule = rules.iter().filter(|r| keys::in_scope(key, &r.prefix)).max_by_key(|r| r.prefix.len());
        rule.map_or(DEFAULT_DOMAIN, |r| r.token_domain.as_str())
    };
    let mut first: Option<&str> = None;
    for touch in touches {
        let domain = domain_of(&touch.key);
        if touch.coverage == Coverage::Subtree {
            let here = crate::fence::node(&touch.key);
            if let Some(inner) = rules
                .iter()
                .find(|r| r.token_domain != domain && crate::fence::covers(here, crate::fence::node(&r.prefix)))
            {
                return Err(Refusal::CrossDomain(format!(
                    "the subtree at {} (token domain {domain}) holds {} (token domain {})",
                    touch.key, inner.prefix, inner.token_domain
                )));
            }
        }
        match first {
            Some(other) if other != domain => {
                return Err(Refusal::CrossDomain(format!("it changes keys of token domains {other} and {domain}")));
            }
            _ => first = Some(domain),
        }
    }
    Ok(())
}

/// The one method a request's override headers name, if they name any; more than one value,
/// or one that is not a method name, is refused: the backend's reading of it is unknowable.
fn method_override<B>(req: &Request<B>) -> Result<Option<&[u8]>, Refusal> {
    // Most requests carry no `x-` header at all: one pass over the names spares them three
    // hashed lookups.
    if !req.headers().keys().any(|name| name.as_str().starts_with("x-")) {
        return Ok(None);
    }
    let mut found: Option<(&HeaderName, &[u8])> = None;
    for name in &METHOD_OVERRIDES {
        for value in req.headers().get_all(name) {
            let bad = |reason: &str| Refusal::InvalidHeader { name: name.to_string(), reason: reason.to_owned() };
            if let Some((first, _)) = found {
                let reason = format!("a method override is already given in {first}; send one value in one header");
                return Err(bad(&reason));
            }
            let method = value.as_bytes();
            if method.is_empty() || Method::from_bytes(method).is_err() || method.contains(&b',') {
                return Err(bad("not one method name"));
            }
            found = Some((name, method));
        }
    }
    Ok(found.map(|(_, method)| method))
}

/// Refuses a `Connection` header that names a header fencegate reads (the token, a method
/// override, the Destination): hop-by-hop headers are dropped on the way to the backend, after
/// the check that read them, so the backend would act on another request than the one checked.
fn check_connection<B>(req: &Request<B>, config: &Config) -> Result<(), Refusal> {
    for value in req.headers().get_all(CONNECTION) {
        // A value that is not text names nothing: nothing is dropped for it either.
        let Ok(text) = value.to_str() else { continue };
        for name in text.split(',').map(str::trim) {
            let read = |h: &HeaderName| name.eq_ignore_ascii_case(h.as_str());
            if read(&config.fence.header) || read(&DESTINATION) || METHOD_OVERRIDES.iter().any(read) {
                return Err(Refusal::InvalidHeader {
                    name: CONNECTION.to_string(),
                    reason: format!("names {name}, which fencegate reads: the header would be dropped after the check"),
                });
            }
        }
    }
    Ok(())
}

/// Refuses what no request may carry: tunnels, and heads beyond the configured limits.
fn check_limits<B>(req: &Request<B>, limits: &LimitsConfig) -> Result<(), Refusal> {
    // In any spelling: a backend that reads method names without regard to case could open a
    // tunnel for `connect`.
    if req.method().as_str().eq_ignore_ascii_case("CONNECT") {
        return Err(Refusal::MethodNotAllowed(req.method().to_string()));
    }
    // The authority counts too (absolute form, HTTP/2's :authority): it becomes Host upstream.
    let authority = req.uri().authority().map_or(0, |a| a.as_str().len());
    let uri = authority + req.uri().path_and_query().map_or(0, |pq| pq.as_str().len());
    if uri > limits.max_uri_bytes {
        return Err(Refusal::UriTooLong { size: uri, limit: limits.max_uri_bytes });
    }
    // As it was sent: request line, then "name: value\r\n" per field.
    let head = req.method().as_str().len() + uri + 12;
    let size = head + req.headers().iter().map(|(k, v)| k.as_str().len() + v.len() + 4).sum::<usize>();
    if size > limits.max_header_bytes {
        return Err(Refusal::HeadersTooLarge { size, limit: limits.max_header_bytes });
    }
    Ok(())
}

/// Refuses a fenced write that asks to switch protocols or declares a body over the limit,
/// before it can touch `max_seen`; returns the body limit to enforce while forwarding.
fn check_fenced<B: Body>(req: &Request<B>, limits: &LimitsConfig) -> Result<Option<u64>, Refusal> {
    if let Some(upgrade) = req.headers().get(UPGRADE) {
        return Err(Refusal::UpgradeRefused(String::from_utf8_lossy(upgrade.as_bytes()).into_owned()));
    }
    let limit = (limits.max_body_bytes > 0).then_some(limits.max_body_bytes);
    let declared = req.body().size_hint().upper();
    if let (Some(limit), Some(declared)) = (limit, declared)
        && declared > limit
    {
        return Err(Refusal::BodyTooLarge { limit });
    }
    Ok(limit)
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http_body_util::Full;

    use super::*;
    use crate::fence::Scope;

    fn config(extra: &str) -> Config {
        let text = format!("[backend]\nurl = \"http://127.0.0.1:9\"\n[store]\ndir = \"/tmp/x\"\n{extra}");
        Config::from_toml_str(&text).unwrap()
    }

    fn request(method: &str, target: &str, headers: &[(&str, &str)], body: &'static str) -> Request<Full<Bytes>> {
        let mut req = Request::builder().method(method).uri(target);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        req.body(Full::new(Bytes::from_static(body.as_bytes()))).unwrap()
    }

    fn write(token: u64, key: &str, target: &'static str) -> Plan {
        touching(token, &[(key, Coverage::Key)], target)
    }

    fn touching(token: u64, touches: &[(&str, Coverage)], target: &'static str) -> Plan {
        Plan::Write(Write {
            token,
            touches: touches.iter().map(|(k, coverage)| Touch { key: (*k).into(), coverage: *coverage }).collect(),
            destination: None,
            target: PathAndQuery::from_static(target),
            body_limit: None,
            equal: EqualToken::Reject,
            locks: Vec::new(),
        })
    }

    /// The touches of a write plan, and its forwarded Destination.
    fn touches(plan: Plan) -> (Vec<(String, Coverage)>, Option<String>) {
        let Plan::Write(w) = plan else { panic!("not a write: {plan:?}") };
        let forwarded = w.destination.map(|d| d.forwarded.to_str().unwrap().to_owned());
        (w.touches.into_iter().map(|t| (t.key, t.coverage)).collect(), forwarded)
    }

    #[test]
    fn a_fenced_write_touches_its_canonical_key_and_forwards_the_canonical_target() {
        let c = config("");
        let put = request("PUT", "/a/./b//c?x=1", &[("fencing-token", "34")], "v");
        assert_eq!(classify(&put, &c).unwrap(), write(34, "/a/b/c", "/a/b/c?x=1"));
        let delete = request("DELETE", "/d/", &[("fencing-token", "7")], "");
        assert_eq!(classify(&delete, &c).unwrap(), touching(7, &[("/d/", Coverage::Subtree)], "/d/"));
    }

    #[test]
    fn move_changes_its_source_and_destination_subtrees_and_copy_only_its_destination() {
        let c = config("");
        let token = ("fencing-token", "5");
        let sub = |k: &str| (k.to_owned(), Coverage::Subtree);
        let moved = request("MOVE", "/scratch", &[token, ("destination", "/%61cct"), ("host", "h")], "");
        assert_eq!(touches(classify(&moved, &c).unwrap()), (vec![sub("/scratch"), sub("/acct")], Some("/acct".into())));
        let copied = request("COPY", "/template/", &[token, ("destination", "http://h/d//x/"), ("host", "h")], "");
        assert_eq!(touches(classify(&copied, &c).unwrap()), (vec![sub("/d/x/")], Some("http://h/d/x/".into())));
        let code = |req: Request<Full<Bytes>>| classify(&req, &c).unwrap_err().code();
        assert_eq!(code(request("MOVE", "/a", &[token], "")), "invalid_header", "a MOVE needs a Destination");
        assert_eq!(
            code(request("COPY", "/a", &[token, ("destination", "http://elsewhere/a"), ("host", "h")], "")),
            "invalid_header"
        );
        let overridden = request("POST", "/a", &[token, ("x-http-method-override", "MOVE"), ("destination", "/b")], "");
        assert_eq!(
            touches(classify(&overridden, &c).unwrap()).0,
            [sub("/a"), sub("/b")],
            "fenced as the method it claims"
        );
        let put = request("PUT", "/a", &[token, ("destination", "/b")], "v");
        assert_eq!(classify(&put, &c).unwrap(), write(5, "/a", "/a"), "only MOVE and COPY name a second resource");
    }

    #[test]
    fn a_write_across_token_domains_is_refused() {
        let c = config(
            "[[fence.rules]]\nprefix = \"/consul/\"\ntoken_domain = \"consul\"\n\
             [[fence.rules]]\nprefix = \"/consul/etcd\"\ntoken_domain = \"default\"\n",
        );
        let token = ("fencing-token", "5");
        let code = |method: &str, path: &str, dest: &str| {
            classify(&request(method, path, &[token, ("destination", dest)], ""), &c).map_err(|e| e.code())
        };
        assert!(code("PUT", "/consul/a", "/x").is_ok(), "one key is always in one domain");
        assert!(code("DELETE", "/consul/a/", "/x").is_ok(), "a subtree within one domain");
        assert!(code("MOVE", "/consul/a", "/consul/b").is_ok());
        assert_eq!(code("MOVE", "/consul/a", "/elsewhere").unwrap_err(), "cross_domain_write");
        assert_eq!(code("DELETE", "/", "/x").unwrap_err(), "cross_domain_write", "a subtree holding another domain");
        assert_eq!(code("DELETE", "/consul/", "/x").unwrap_err(), "cross_domain_write", "and one nested in it");
        assert!(code("DELETE", "/consul/etcd/x/", "/x").is_ok(), "the longest prefix names the domain");
        assert!(code("COPY", "/consul/a", "/b").is_ok(), "a COPY's source is read, not fenced");
    }

    #[test]
    fn equal_tokens_follow_the_strictest_rule_over_what_a_write_may_change() {
        let c = config(
            "[[fence.rules]]\nprefix = \"/tenure/\"\nequal_token = \"accept\"\n\
             [[fence.rules]]\nprefix = \"/tenure/once\"\nequal_token = \"reject\"\n\
             [[fence.rules]]\nprefix = \"/tenure/domain\"\ntoken_domain = \"default\"\n",
        );
        let token = ("fencing-token", "5");
        let equal = |method: &str, path: &str, dest: &str| {
            let Plan::Write(w) = classify(&request(method, path, &[token, ("destination", dest)], ""), &c).unwrap()
            else {
                panic!("{method} {path} is a write")
            };
            w.equal
        };
        use EqualToken::{Accept, Reject};
        assert_eq!(equal("PUT", "/tenure/doc", "/x"), Accept);
        assert_eq!(equal("PUT", "/elsewhere", "/x"), Reject, "fence.equal_token where no rule sets it");
        assert_eq!(equal("PUT", "/tenure/once/doc", "/x"), Reject, "the longest prefix that sets it");
        assert_eq!(equal("PUT", "/tenure/domain/doc", "/x"), Accept, "a rule that does not set it inherits");
        assert_eq!(equal("MOVE", "/tenure/a", "/tenure/b"), Accept);
        assert_eq!(equal("MOVE", "/tenure/a", "/elsewhere"), Reject, "a Destination under reject");
        assert_eq!(equal("DELETE", "/tenure/a/", "/x"), Accept);
        assert_eq!(equal("DELETE", "/tenure/", "/x"), Reject, "a subtree holding a prefix under reject");
        assert_eq!(equal("PUT", "/tenure/doc", "/x"), Accept);
        let plain = config("[fence]\nequal_token = \"accept\"\n");
        let Plan::Write(w) = classify(&request("PUT", "/a", &[token], ""), &plain).unwrap() else { panic!() };
        assert_eq!(w.equal, Accept, "no rule: fence.equal_token");
    }

    #[test]
    fn a_write_is_fenced_for_what_its_own_method_and_its_override_may_change() {
        let c = config("");
        let token = ("fencing-token", "5");
        let sub = |k: &str| (k.to_owned(), Coverage::Subtree);
        let plan = |method: &str, claimed: &str| {
            let headers = [token, ("x-http-method-override", claimed), ("destination", "/%61cct")];
            touches(classify(&request(method, "/scratch", &headers, ""), &c).unwrap())
        };
        // nginx ignores the override and moves /scratch onto /acct: both are fenced.
        assert_eq!(plan("MOVE", "PUT"), (vec![sub("/scratch"), sub("/acct")], Some("/acct".into())));
        assert_eq!(plan("DELETE", "GET").0, [sub("/scratch")], "a DELETE under a safe claim is still a DELETE");
        assert_eq!(plan("MOVE", "COPY").0, [sub("/scratch"), sub("/acct")], "the MOVE's source is fenced");
        assert_eq!(plan("COPY", "COPY").0, [sub("/acct")]);
        // Frameworks upper-case override values before they act on them.
        assert_eq!(plan("POST", "delete").0, [sub("/scratch")]);
        assert_eq!(plan("POST", "move"), (vec![sub("/scratch"), sub("/acct")], Some("/acct".into())));
    }

    #[test]
    fn subtrees_follow_the_configured_methods_and_compose_with_scopes() {
        let mut c = config("[fence]\nsubtree_methods = [\"DELETE\"]\n");
        c.fence.scopes.push(Scope { prefix: "/buckets/".into(), segments: Some(2) });
        let token = ("fencing-token", "5");
        let plan = |method: &str, path: &str| {
            touches(classify(&request(method, path, &[token, ("destination", "/z")], ""), &c).unwrap()).0
        };
        assert_eq!(
            plan("DELETE", "/buckets/"),
            [("/buckets/".to_owned(), Coverage::Subtree)],
            "above the scope's keys"
        );
        assert_eq!(plan("DELETE", "/buckets/b1/dir/"), [("/buckets/b1".to_owned(), Coverage::Key)], "inside one key");
        assert_eq!(plan("MOVE", "/a"), [("/a".to_owned(), Coverage::Key), ("/z".to_owned(), Coverage::Key)]);
    }

    #[test]
    fn every_method_not_known_to_be_safe_is_fenced_and_method_names_are_case_sensitive() {
        let c = config("");
        for method in ["PUT", "POST", "PATCH", "DELETE", "MKCOL", "PROPPATCH", "LOCK", "UNLOCK", "PURGE", "FROB", "get"]
        {
            let tokenless = request(method, "/a", &[], "");
            assert_eq!(classify(&tokenless, &c).unwrap_err().code(), "missing_token", "{method}");
            let with_token = request(method, "/a", &[("fencing-token", "3")], "");
            let coverage = if method == "DELETE" { Coverage::Subtree } else { Coverage::Key };
            assert_eq!(classify(&with_token, &c).unwrap(), touching(3, &[("/a", coverage)], "/a"), "{method}");
        }
        for method in ["GET", "HEAD", "OPTIONS", "TRACE", "PROPFIND"] {
            assert!(matches!(classify(&request(method, "/a", &[], ""), &c), Ok(Plan::Pass { .. })), "{method}");
        }
        for connect in ["CONNECT", "connect", "Connect"] {
            let code = classify(&request(connect, "/a", &[("fencing-token", "3")], ""), &c).unwrap_err().code();
            assert_eq!(code, "method_not_allowed", "{connect}");
        }
    }

    #[test]
    fn a_method_override_is_fenced_as_the_method_it_names() {
        let c = config("");
        for header in ["X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override"] {
            let tokenless = request("GET", "/a", &[(header, "PUT")], "");
            assert_eq!(classify(&tokenless, &c).unwrap_err().code(), "missing_token", "{header}");
            let delete = request("GET", "/a", &[(header, "DELETE"), ("fencing-token", "9")], "");
            assert_eq!(classify(&delete, &c).unwrap(), touching(9, &[("/a", Coverage::Subtree)], "/a"), "{header}");
            let safe = request("POST", "/a", &[(header, "GET")], "");
            assert_eq!(classify(&safe, &c).unwrap_err().code(), "missing_token", "POST stays a write: {header}");
            let read = request("GET", "/a", &[(header, "HEAD")], "");
            assert!(matches!(classify(&read, &c), Ok(Plan::Pass { .. })), "{header}");
        }
        let code = |headers: &[(&str, &str)]| classify(&request("GET", "/a", headers, ""), &c).unwrap_err().code();
        assert_eq!(code(&[("X-HTTP-Method-Override", "PUT"), ("X-HTTP-Method-Override", "GET")]), "invalid_header");
        assert_eq!(code(&[("X-HTTP-Method-Override", "GET"), ("X-HTTP-Method", "GET")]), "invalid_header");
        assert_eq!(code(&[("X-HTTP-Method-Override", "GET, PUT")]), "invalid_header");
        assert_eq!(code(&[("X-Method-Override", "")]), "invalid_header");
    }

    #[test]
    fn a_connection_header_may_not_drop_a_header_the_check_read() {
        let c = config("");
        let token = ("fencing-token", "5");
        for named in ["Fencing-Token", "destination", "x-http-method-override", "keep-alive, X-Method-Override"] {
            let req = request("PUT", "/a", &[token, ("connection", named)], "");
            assert_eq!(classify(&req, &c).unwrap_err().code(), "invalid_header", "{named}");
            let read = request("GET", "/a", &[("connection", named)], "");
            assert_eq!(classify(&read, &c).unwrap_err().code(), "invalid_header", "reads too: {named}");
        }
        let fine = request("PUT", "/a", &[token, ("connection", "keep-alive, x-trace")], "");
        assert_eq!(classify(&fine, &c).unwrap(), write(5, "/a", "/a"));
    }

    #[test]
    fn a_scope_names_the_key_while_the_target_keeps_the_whole_path() {
        let mut c = config("");
        c.fence.scopes.push(Scope { prefix: "/buckets/".into(), segments: Some(2) });
        let put = request("PUT", "/buckets/b1/obj", &[("fencing-token", "5")], "v");
        assert_eq!(classify(&put, &c).unwrap(), write(5, "/buckets/b1", "/buckets/b1/obj"));
    }

    #[test]
    fn reads_pass_as_sent_and_tokenless_writes_follow_the_missing_token_policy() {
        let c = config("");
        let get = request("GET", "/a/../b", &[], "");
        assert_eq!(classify(&get, &c).unwrap(), Plan::Pass { target: PathAndQuery::from_static("/a/../b") });
        let put = request("PUT", "/a", &[], "v");
        assert_eq!(classify(&put, &c).unwrap_err().code(), "missing_token");
        let forward = config("[fence]\nmissing_token = \"forward\"\n[limits]\nmax_body_bytes = 10\n");
        let unchecked = Plan::Unchecked { target: PathAndQuery::from_static("/b"), body_limit: Some(10) };
        assert_eq!(classify(&request("PUT", "/a/../b", &[], "v"), &forward).unwrap(), unchecked);
    }

    #[test]
    fn what_cannot_be_fenced_is_refused_before_anything_waits() {
        let c = config("[limits]\nmax_body_bytes = 4\nmax_uri_bytes = 64\n");
        let token = [("fencing-token", "1")];
        let code = |req: Request<Full<Bytes>>| classify(&req, &c).unwrap_err().code();
        assert_eq!(code(request("CONNECT", "127.0.0.1:1", &[], "")), "method_not_allowed");
        assert_eq!(code(request("PUT", "/a", &[("fencing-token", "1"), ("fencing-token", "2")], "")), "invalid_token");
        assert_eq!(code(request("PUT", "/a", &[("fencing-token", "-1")], "")), "invalid_token");
        assert_eq!(code(request("PUT", "/a%2Fb", &token, "")), "invalid_path");
        assert_eq!(code(request("PUT", "/a", &token, "too long")), "body_too_large");
        assert_eq!(code(request("PUT", "/a", &[("fencing-token", "1"), ("upgrade", "h2c")], "")), "upgrade_refused");
        assert_eq!(code(request("PUT", &format!("/{}", "a".repeat(64)), &token, "")), "uri_too_long");
    }
}
