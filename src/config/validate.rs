//! Validation: the raw view of the file becomes [`Config`], every value checked and turned
//! into the type the proxy uses; an error names the key.

use std::path::Path;
use std::time::Duration;

use http::Method;
use http::header::HeaderName;

use super::address;
use super::raw::{self, RawAdmin, RawConfig, RawLimits, RawPaths, RawScope};
use super::*;
use crate::fence::keys;
use crate::fence::path::{self, EscapedSlashes, MatrixParams, TrailingSlash};

pub(super) fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.to_owned(), message: message.into() }
}

/// Validates what was read into the settings the proxy uses.
pub(super) fn config(raw: RawConfig) -> Result<Config, ConfigError> {
    let server = ServerConfig {
        listen: ListenAddr::parse(&raw.server.listen).map_err(|e| invalid("server.listen", e))?,
        listen_mode: address::listen_mode("server.listen_mode", raw.server.listen_mode.as_deref())?,
        shutdown_grace: duration("server.shutdown_grace", &raw.server.shutdown_grace)?,
        workers: match raw.server.workers {
            n if n > 1024 => return Err(invalid("server.workers", format!("{n}: at most 1024"))),
            n => n,
        },
        mode: choice(
            "server.mode",
            &raw.server.mode,
            [("proxy", ServerMode::Proxy), ("ext_proc", ServerMode::ExtProc)],
        )?,
        tls: match raw.server.tls {
            Some(t) => {
                // Load them now, so `check` and start-up fail on a file that does not parse.
                crate::tls::server_config(&t.cert, &t.key, t.client_ca.as_deref())
                    .map_err(|e| invalid("server.tls", e))?;
                Some(ServerTls { cert: t.cert, key: t.key, client_ca: t.client_ca })
            }
            None => None,
        },
    };
    let backend = BackendConfig {
        url: raw.backend.url.parse()?,
        connect_timeout: duration("backend.connect_timeout", &raw.backend.connect_timeout)?,
        request_timeout: duration("backend.request_timeout", &raw.backend.request_timeout)?,
        max_connections: bounded("backend.max_connections", raw.backend.max_connections, 1, 1 << 20)?,
        pool_timeout: duration("backend.pool_timeout", &raw.backend.pool_timeout)?,
        tls: backend_tls(&raw.backend.url, raw.backend.tls)?,
        protocol: choice(
            "backend.protocol",
            &raw.backend.protocol,
            [("http", BackendProtocol::Http), ("s3", BackendProtocol::S3)],
        )?,
    };
    let f = raw.fence;
    let header = HeaderName::from_bytes(f.header.as_bytes())
        .map_err(|_| invalid("fence.header", format!("{:?} is not a valid header name", f.header)))?;
    if f.methods.is_some() {
        return Err(invalid(
            "fence.methods",
            "is replaced by fence.unfenced_methods: list the methods that are safe to forward unchecked \
             (default [\"GET\", \"HEAD\", \"OPTIONS\", \"TRACE\", \"PROPFIND\"]); every other method is fenced",
        ));
    }
    let unfenced_methods = methods("fence.unfenced_methods", &f.unfenced_methods)?;
    let subtree_methods = methods("fence.subtree_methods", &f.subtree_methods)?;
    let quarantine = match &f.quarantine {
        Some(q) => duration("fence.quarantine", q)?,
        None => backend.request_timeout,
    };
    let paths = path_policy(&raw.paths)?;
    let scopes: Vec<Scope> = f.scopes.iter().enumerate().map(|(i, s)| scope(i, s, &paths)).collect::<Result<_, _>>()?;
    let rules = rules(&f.rules, &paths)?;
    for (index, rule) in rules.iter().enumerate() {
        // Inside a scope that shortens paths, every key is the scope's: a rule there would
        // name keys that do not exist.
        let key = crate::fence::keys::resource_key(&rule.prefix, &scopes);
        if key != rule.prefix {
            return Err(invalid(
                &format!("fence.rules[{index}].prefix"),
                format!("{:?} lies inside a scope whose key is {key:?}; give the rule that prefix", rule.prefix),
            ));
        }
    }
    let verify = super::verify::verify(raw.verify, &header)?;
    super::verify::rules_can_verify(&rules, &verify)?;
    let fence = FenceConfig {
        header,
        unfenced_methods,
        subtree_methods,
        equal_token: choice("fence.equal_token", &f.equal_token, EQUAL_TOKEN)?,
        missing_token: choice(
            "fence.missing_token",
            &f.missing_token,
            [("reject", MissingToken::Reject), ("forward", MissingToken::Forward)],
        )?,
        queue_timeout: duration("fence.queue_timeout", &f.queue_timeout)?,
        quarantine,
        scopes,
        rules,
    };
    let store = super::store::store(raw.store)?;
    let level = raw.log.level.to_ascii_lowercase();
    if !["error", "warn", "info", "debug", "trace"].contains(&level.as_str()) {
        return Err(invalid("log.level", format!("{level:?}: expected error, warn, info, debug or trace")));
    }
    let limits = limits(&raw.limits)?;
    let log = LogConfig {
        level,
        format: choice("log.format", &raw.log.format, [("text", LogFormat::Text), ("json", LogFormat::Json)])?,
        refusal_interval: duration("log.refusal_interval", &raw.log.refusal_interval)?,
        buffer_lines: match raw.log.buffer_lines {
            0 => return Err(invalid("log.buffer_lines", "must be at least 1")),
            n => n,
        },
        access: raw.log.access,
        access_format: choice(
            "log.access_format",
            &raw.log.access_format,
            [
                ("log", AccessFormat::Log),
                ("combined", AccessFormat::Combined),
                ("combined_fencegate", AccessFormat::CombinedFencegate),
            ],
        )?,
    };
    let admin = admin(raw.admin)?;
    let etcd = super::etcd::etcd(raw.etcd)?;
    verified_rules(&fence, &etcd)?;
    if store.kind == StoreKind::Etcd && etcd.endpoints.is_empty() {
        return Err(invalid("etcd.endpoints", "store.kind = \"etcd\" keeps the fence in etcd: name its members"));
    }
    // A keep-alive is sent a quarter of the lease after the last one was, and must be answered
    // before the trusted part of the lease ends: ttl/4 + request_timeout within ttl - margin.
    if let Some(e) = &store.etcd
        && e.lease_ttl / 4 + etcd.request_timeout > e.lease_ttl.saturating_sub(e.lease_margin)
    {
        return Err(invalid(
            "etcd.request_timeout",
            "with store.lease_ttl / 4 (the keep-alive period) must stay within store.lease_ttl - \
            store.lease_margin, or one slow keep-alive lapses the lease",
        ));
    }
    let s3 = super::s3::s3(raw.s3, backend.protocol)?;
    let headers = super::headers::headers(raw.headers, &[&fence.header, &verify.signature_header])?;
    if let Some(e) = &store.etcd {
        if e.advertise.starts_with("https://") && server.tls.is_none() {
            return Err(invalid(
                "store.advertise",
                format!(
                    "{:?}: an https:// URL needs [server.tls], so that the other instances reach this one over TLS",
                    e.advertise
                ),
            ));
        }
        if let Some(ca) = &e.peer_ca {
            crate::tls::client_config(Some(ca), None, None).map_err(|why| invalid("store.peer_ca", why))?;
        }
    }
    Ok(Config { server, backend, fence, verify, store, log, paths, limits, admin, etcd, s3, headers })
}

const EQUAL_TOKEN: [(&str, EqualToken); 2] = [("reject", EqualToken::Reject), ("accept", EqualToken::Accept)];

pub(super) fn choice<T: Copy, const N: usize>(
    key: &str,
    text: &str,
    options: [(&str, T); N],
) -> Result<T, ConfigError> {
    options.iter().find(|(name, _)| name.eq_ignore_ascii_case(text)).map(|(_, v)| *v).ok_or_else(|| {
        let names: Vec<String> = options.iter().map(|(name, _)| format!("{name:?}")).collect();
        invalid(key, format!("{text:?}: expected {}", names.join(" or ")))
    })
}

const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

pub(super) fn duration(key: &str, text: &str) -> Result<Duration, ConfigError> {
    let d = humantime::parse_duration(text)
        .map_err(|e| invalid(key, format!("{text:?}: {e} (write e.g. \"500ms\", \"2s\", \"1m\")")))?;
    if d.is_zero() {
        return Err(invalid(key, "must be greater than zero"));
    }
    // Deadlines are `now + d`: an absurd duration must fail here, not overflow at run time.
    if d > MAX_DURATION {
        return Err(invalid(key, format!("{text:?} is more than the maximum of 365 days")));
    }
    Ok(d)
}

/// Method names are case-sensitive (RFC 9110 §9.1): each is kept exactly as written.
fn methods(key: &str, names: &[String]) -> Result<Vec<Method>, ConfigError> {
    let mut methods = Vec::with_capacity(names.len());
    for name in names {
        let method = Method::from_bytes(name.as_bytes())
            .map_err(|_| invalid(key, format!("{name:?} is not an HTTP method name")))?;
        if name.eq_ignore_ascii_case("CONNECT") {
            return Err(invalid(key, "CONNECT is always refused: fencegate is not a tunnel"));
        }
        if !methods.contains(&method) {
            methods.push(method);
        }
    }
    Ok(methods)
}

fn backend_tls(url: &str, raw: Option<raw::RawBackendTls>) -> Result<BackendTls, ConfigError> {
    let tls = raw.map(|t| BackendTls { ca: t.ca, cert: t.cert, key: t.key }).unwrap_or_default();
    let https = url.starts_with("https://");
    if !https && (tls.ca.is_some() || tls.cert.is_some() || tls.key.is_some()) {
        return Err(invalid("backend.tls", "only applies to an https:// backend.url"));
    }
    if https {
        crate::tls::client_config(tls.ca.as_deref(), tls.cert.as_deref(), tls.key.as_deref())
            .map_err(|e| invalid("backend.tls", e))?;
    }
    Ok(tls)
}

fn admin(raw: RawAdmin) -> Result<AdminConfig, ConfigError> {
    let listen = match raw.listen.as_deref() {
        None | Some("") => None,
        Some(text) => Some(ListenAddr::parse(text).map_err(|e| invalid("admin.listen", e))?),
    };
    let listen_mode = address::listen_mode("admin.listen_mode", raw.listen_mode.as_deref())?;
    let token = bearer_token("admin.token_file", raw.token, raw.token_file.as_deref())?;
    let read_token = bearer_token("admin.read_token_file", raw.read_token, raw.read_token_file.as_deref())?;
    if read_token.is_some() && read_token == token {
        return Err(invalid("admin.read_token_file", "the read token must differ from admin.token: it grants less"));
    }
    Ok(AdminConfig {
        listen,
        listen_mode,
        token_file: raw.token_file,
        token,
        read_token_file: raw.read_token_file,
        read_token,
    })
}

/// An admin bearer token: the environment's (`FENCEGATE_ADMIN__TOKEN`, say), which wins, or
/// the trimmed contents of its file; at least 16 characters.
fn bearer_token(key: &str, given: Option<String>, file: Option<&Path>) -> Result<Option<String>, ConfigError> {
    let token = match (given, file) {
        (Some(t), _) => Some(t),
        (None, Some(file)) => Some(
            std::fs::read_to_string(file)
                .map_err(|e| invalid(key, format!("{}: {e}", file.display())))?
                .trim()
                .to_owned(),
        ),
        (None, None) => None,
    };
    if token.as_deref().is_some_and(|t| t.len() < 16) {
        return Err(invalid(key, "an admin token must be at least 16 characters"));
    }
    Ok(token)
}

fn path_policy(raw: &RawPaths) -> Result<PathPolicy, ConfigError> {
    Ok(PathPolicy {
        escaped_slashes: choice(
            "paths.escaped_slashes",
            &raw.escaped_slashes,
            [("reject", EscapedSlashes::Reject), ("decode", EscapedSlashes::Decode)],
        )?,
        merge_slashes: raw.merge_slashes,
        case_sensitive: raw.case_sensitive,
        trailing_slash: choice(
            "paths.trailing_slash",
            &raw.trailing_slash,
            [("distinct", TrailingSlash::Distinct), ("strip", TrailingSlash::Strip)],
        )?,
        matrix_params: choice(
            "paths.matrix_params",
            &raw.matrix_params,
            [("reject", MatrixParams::Reject), ("allow", MatrixParams::Allow)],
        )?,
    })
}

fn bounded<T: PartialOrd + std::fmt::Display + Copy>(key: &str, v: T, min: T, max: T) -> Result<T, ConfigError> {
    if v < min || v > max {
        return Err(invalid(key, format!("{v} is outside {min}..={max}")));
    }
    Ok(v)
}

fn limits(raw: &RawLimits) -> Result<LimitsConfig, ConfigError> {
    Ok(LimitsConfig {
        header_read_timeout: duration("limits.header_read_timeout", &raw.header_read_timeout)?,
        keepalive_timeout: duration("limits.keepalive_timeout", &raw.keepalive_timeout)?,
        max_connections: bounded("limits.max_connections", raw.max_connections, 1, 1 << 20)?,
        // hyper's HTTP/1 read buffer must hold the head; it cannot be smaller than 8 KiB.
        max_header_bytes: bounded("limits.max_header_bytes", raw.max_header_bytes, 1024, 1 << 20)?,
        max_uri_bytes: bounded("limits.max_uri_bytes", raw.max_uri_bytes, 64, path::MAX_PATH_LEN)?,
        max_body_bytes: raw.max_body_bytes,
        h2_max_concurrent_streams: bounded(
            "limits.h2_max_concurrent_streams",
            raw.h2_max_concurrent_streams,
            1,
            10_000,
        )?,
    })
}

/// A prefix as written, which must already be a canonical path: a prefix no request path can
/// start with would silently match nothing.
fn canonical_prefix(key: &str, prefix: &str, policy: &PathPolicy) -> Result<String, ConfigError> {
    let canonical = path::canonicalize(prefix, policy).map_err(|e| invalid(key, format!("{prefix:?}: {e}")))?;
    if canonical != prefix {
        return Err(invalid(key, format!("{prefix:?} is not canonical; write {canonical:?}")));
    }
    Ok(canonical)
}

fn rules(raw: &[raw::RawRule], policy: &PathPolicy) -> Result<Vec<Rule>, ConfigError> {
    let mut rules: Vec<Rule> = Vec::with_capacity(raw.len());
    for (index, r) in raw.iter().enumerate() {
        let key = format!("fence.rules[{index}].prefix");
        let canonical = canonical_prefix(&key, &r.prefix, policy)?;
        if rules.iter().any(|other| other.prefix == canonical) {
            return Err(invalid(&key, format!("{canonical:?} has a rule already")));
        }
        // Unset, it is inherited below, once every rule is known.
        let domain = r.token_domain.clone().unwrap_or_default();
        if r.token_domain.as_deref() == Some("") {
            return Err(invalid(&format!("fence.rules[{index}].token_domain"), "must not be empty"));
        }
        let equal_token = r
            .equal_token
            .as_deref()
            .map(|text| choice(&format!("fence.rules[{index}].equal_token"), text, EQUAL_TOKEN))
            .transpose()?;
        let verify = r
            .verify
            .as_deref()
            .map(|text| {
                choice(
                    &format!("fence.rules[{index}].verify"),
                    text,
                    [("none", Verify::None), ("hmac", Verify::Hmac), ("etcd", Verify::Etcd)],
                )
            })
            .transpose()?;
        let lock_key = format!("fence.rules[{index}].lock");
        let lock = match (&r.lock, verify) {
            (Some(text), Some(Verify::Etcd)) => {
                Some(LockTemplate::parse(text).map_err(|e| invalid(&lock_key, e.to_string()))?)
            }
            (Some(_), _) => return Err(invalid(&lock_key, "names an etcd lock: only with verify = \"etcd\"")),
            (None, Some(Verify::Etcd)) => {
                return Err(invalid(
                    &lock_key,
                    "verify = \"etcd\" needs the lock that guards each key, e.g. \"/locks/accounts/{2}\"",
                ));
            }
            (None, _) => None,
        };
        if r.max_jump == Some(0) {
            return Err(invalid(&format!("fence.rules[{index}].max_jump"), "must be at least 1"));
        }
        let pin = r
            .pin
            .as_deref()
            .map(|text| {
                choice(&format!("fence.rules[{index}].pin"), text, [("off", PinMode::Off), ("etag", PinMode::Etag)])
            })
            .transpose()?;
        rules.push(Rule {
            prefix: canonical,
            token_domain: domain,
            equal_token,
            verify,
            lock,
            max_jump: r.max_jump,
            pin,
        });
    }
    // A rule that does not set its token domain inherits the longest shorter rule's that
    // does, as every other setting is inherited: a rule that only tunes `max_jump` must not
    // move its subtree back to the default domain, where other signatures pass.
    let set: Vec<(String, String)> = rules
        .iter()
        .filter(|r| !r.token_domain.is_empty())
        .map(|r| (r.prefix.clone(), r.token_domain.clone()))
        .collect();
    for rule in rules.iter_mut().filter(|r| r.token_domain.is_empty()) {
        let over = set.iter().filter(|(prefix, _)| keys::in_scope(&rule.prefix, prefix));
        rule.token_domain = over.max_by_key(|(prefix, _)| prefix.len()).map_or(DEFAULT_DOMAIN, |(_, d)| d).to_owned();
    }
    Ok(rules)
}

/// Rules that verify tokens against etcd need an etcd, lock names inside their fence keys,
/// and lock names no other rule's could be a prefix of.
fn verified_rules(fence: &FenceConfig, etcd: &EtcdConfig) -> Result<(), ConfigError> {
    let verified: Vec<(usize, &Rule, &LockTemplate)> =
        (fence.rules.iter().enumerate()).filter_map(|(i, r)| r.lock.as_ref().map(|t| (i, r, t))).collect();
    for (index, rule, template) in &verified {
        let key = format!("fence.rules[{index}].lock");
        if etcd.endpoints.is_empty() {
            return Err(invalid(
                "etcd.endpoints",
                format!("fence.rules[{index}] verifies tokens against etcd: name its members"),
            ));
        }
        // A scope that cuts keys under the prefix short leaves the lock's segment out.
        let n = template.max_segment();
        for scope in &fence.scopes {
            let applies = keys::in_scope(&rule.prefix, &scope.prefix) || keys::in_scope(&scope.prefix, &rule.prefix);
            let kept = scope.segments.unwrap_or_else(|| scope.prefix.split('/').filter(|s| !s.is_empty()).count());
            if applies && kept < n {
                return Err(invalid(
                    &key,
                    format!(
                        "{:?} takes segment {n}, but the scope {:?} makes keys of {kept} segments",
                        template.as_str(),
                        scope.prefix
                    ),
                ));
            }
        }
        for (other_index, _, other) in &verified {
            if other_index > index && template.overlaps(other) {
                return Err(invalid(
                    &key,
                    format!(
                        "{:?} and fence.rules[{other_index}].lock {:?} could name locks one of which is a prefix of the \
                     other, and etcd's lock would count the longer one's holders as the shorter one's",
                        template.as_str(),
                        other.as_str()
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn scope(index: usize, raw: &RawScope, policy: &PathPolicy) -> Result<Scope, ConfigError> {
    let canonical = canonical_prefix(&format!("fence.scopes[{index}].prefix"), &raw.prefix, policy)?;
    if let Some(n) = raw.segments {
        let own = canonical.split('/').filter(|s| !s.is_empty()).count();
        if n == 0 || n < own {
            return Err(invalid(
                &format!("fence.scopes[{index}].segments"),
                format!("{n} must be at least the prefix's own segment count ({own}) and above zero"),
            ));
        }
    }
    Ok(Scope { prefix: canonical, segments: raw.segments })
}
