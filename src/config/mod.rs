//! Configuration: a raw serde view of the TOML file (unknown keys are errors), validated into
//! [`Config`], whose every field is already the type the proxy uses.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::header::HeaderName;
use http::{Method, Uri};
use serde::{Serialize, Serializer};

use crate::fence::path::{self, EscapedSlashes, MatrixParams, PathPolicy, TrailingSlash};

mod raw;
pub mod reload;
use raw::{RawAdmin, RawConfig, RawLimits, RawPaths, RawScope};

/// A configuration that could not be loaded; the message names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read or parsed, or a key is unknown or of the wrong type.
    #[error(transparent)]
    Load(#[from] config::ConfigError),
    /// A key parsed but its value is not acceptable.
    #[error("{key}: {message}")]
    Invalid {
        /// Dotted key, as written in the file (`fence.equal_token`).
        key: String,
        /// What is wrong and what would be accepted.
        message: String,
    },
}

fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key: key.to_owned(), message: message.into() }
}

/// What to do with a token equal to `max_seen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EqualToken {
    /// Refuse it: each lock holder's token admits exactly one accepted write (the default).
    Reject,
    /// Accept it: the current holder may write many times with the same token.
    Accept,
}

/// What to do with a fenced write that carries no token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MissingToken {
    /// Answer 428 (the default).
    Reject,
    /// Forward it unchecked, for a migration period while clients learn to send tokens.
    Forward,
}

/// Whether an advance of `max_seen` is fsync'd before the write is forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    /// fdatasync before forwarding: survives power loss (the default).
    Always,
    /// Leave it to the page cache: survives a process crash only. For benchmarks.
    Never,
}

/// The validated configuration.
#[derive(Debug, Clone, Serialize)]
pub struct Config {
    /// The client-facing listener.
    pub server: ServerConfig,
    /// The protected backend.
    pub backend: BackendConfig,
    /// The fencing policy.
    pub fence: FenceConfig,
    /// Where and how `max_seen` is made durable.
    pub store: StoreConfig,
    /// Logging.
    pub log: LogConfig,
    /// How paths resolve to resources: must match the backend.
    pub paths: PathPolicy,
    /// Bounds on what a client may send and hold.
    pub limits: LimitsConfig,
    /// The operators' listener.
    pub admin: AdminConfig,
}

/// `[admin]`
#[derive(Debug, Clone, Serialize)]
pub struct AdminConfig {
    /// Where the admin API listens; off when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<SocketAddr>,
    /// File the write token was read from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// Bearer token for admin writes (never printed); without one, writes are disabled.
    #[serde(skip)]
    pub token: Option<String>,
}

/// `[limits]`
#[derive(Debug, Clone, Serialize)]
pub struct LimitsConfig {
    /// A client must finish sending request headers within this time (slowloris guard).
    #[serde(serialize_with = "ser_duration")]
    pub header_read_timeout: Duration,
    /// An idle keep-alive connection is closed after this long.
    #[serde(serialize_with = "ser_duration")]
    pub keepalive_timeout: Duration,
    /// Connections served at once; further ones wait in the listen backlog.
    pub max_connections: usize,
    /// Bytes of request line plus headers (431 beyond).
    pub max_header_bytes: usize,
    /// Bytes of request target (414 beyond).
    pub max_uri_bytes: usize,
    /// Body bytes of a fenced write (413 beyond); 0 for no limit.
    pub max_body_bytes: u64,
    /// Concurrent streams per HTTP/2 connection.
    pub h2_max_concurrent_streams: u32,
}

/// `[server]`
#[derive(Debug, Clone, Serialize)]
pub struct ServerConfig {
    /// Address the binary binds (tests bind their own listener and ignore it).
    pub listen: SocketAddr,
    /// On SIGTERM, in-flight requests get this long to finish.
    #[serde(serialize_with = "ser_duration")]
    pub shutdown_grace: Duration,
    /// Threads serving requests: 1 is a single-threaded event loop (like one nginx worker),
    /// 0 one thread per CPU.
    pub workers: usize,
    /// Serve HTTPS with these files (PEM); plain HTTP when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<ServerTls>,
}

/// `[server.tls]`
#[derive(Debug, Clone, Serialize)]
pub struct ServerTls {
    /// Certificate chain, PEM.
    pub cert: PathBuf,
    /// Private key, PEM.
    pub key: PathBuf,
    /// Only clients with a certificate this CA signed may connect.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<PathBuf>,
}

/// `[backend.tls]`: for an `https://` backend.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BackendTls {
    /// CA to trust for the backend's certificate; the system roots when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca: Option<PathBuf>,
    /// Client certificate for mTLS, PEM.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert: Option<PathBuf>,
    /// Its private key, PEM.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<PathBuf>,
}

/// `[backend]`
#[derive(Debug, Clone, Serialize)]
pub struct BackendConfig {
    /// Scheme and authority of the backend; the path of each request is appended.
    #[serde(serialize_with = "ser_display")]
    pub url: Uri,
    /// Bound on establishing a TCP connection to the backend.
    #[serde(serialize_with = "ser_duration")]
    pub connect_timeout: Duration,
    /// Bound on the backend's response head, measured from sending the request.
    #[serde(serialize_with = "ser_duration")]
    pub request_timeout: Duration,
    /// TLS to the backend (only with `https://`).
    pub tls: BackendTls,
}

/// `[fence]`
#[derive(Debug, Clone, Serialize)]
pub struct FenceConfig {
    /// The request header that carries the token.
    #[serde(serialize_with = "ser_display_header")]
    pub header: HeaderName,
    /// Fenced methods, upper case; a request method matches case-insensitively.
    #[serde(serialize_with = "ser_methods")]
    pub methods: Vec<Method>,
    /// Whether a token equal to `max_seen` is accepted.
    pub equal_token: EqualToken,
    /// Whether a tokenless fenced write is refused or forwarded unchecked.
    pub missing_token: MissingToken,
    /// How long a write may wait for earlier writes to the same resource before a 503.
    #[serde(serialize_with = "ser_duration")]
    pub queue_timeout: Duration,
    /// How long a resource stays closed after a write whose outcome is unknown.
    #[serde(serialize_with = "ser_duration")]
    pub quarantine: Duration,
    /// Prefix scopes that map many paths onto one fence key; first match wins.
    pub scopes: Vec<Scope>,
}

/// One `[[fence.scopes]]` entry.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Scope {
    /// Canonical path prefix, matched on segment boundaries.
    pub prefix: String,
    /// Keep this many leading path segments as the key; `None` makes the whole prefix one key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub segments: Option<usize>,
}

/// `[store]`
#[derive(Debug, Clone, Serialize)]
pub struct StoreConfig {
    /// Data directory holding the log and its lock file.
    pub dir: PathBuf,
    /// fsync policy.
    pub sync: SyncMode,
    /// Segment size that triggers rotation and a snapshot.
    pub segment_bytes: u64,
    /// Most resources the table holds; writes to new ones are refused beyond it.
    pub max_resources: usize,
}

/// `[log]`
#[derive(Debug, Clone, Serialize)]
pub struct LogConfig {
    /// `error`, `warn`, `info`, `debug` or `trace`.
    pub level: String,
    /// Whether lines are human-readable text or one JSON object each.
    pub format: LogFormat,
    /// At most one line per resource per this interval for refused requests.
    #[serde(serialize_with = "ser_duration")]
    pub refusal_interval: Duration,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable text (the default).
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

impl Config {
    /// Loads `path`, then applies `FENCEGATE_<SECTION>__<KEY>` overrides from `env`
    /// (the process environment when `None`), then validates.
    pub fn load(path: &Path, env: Option<HashMap<String, String>>) -> Result<Self, ConfigError> {
        let environment = config::Environment::with_prefix("FENCEGATE")
            .prefix_separator("_")
            .separator("__")
            .try_parsing(true)
            .list_separator(",")
            .with_list_parse_key("fence.methods")
            .source(env);
        let raw: RawConfig = config::Config::builder()
            .add_source(config::File::from(path).format(config::FileFormat::Toml))
            .add_source(environment)
            .build()?
            .try_deserialize()?;
        Self::from_raw(raw)
    }

    /// Parses and validates TOML text, without environment overrides.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .build()?
            .try_deserialize()?;
        Self::from_raw(raw)
    }

    /// The effective settings, every default filled in, as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render settings: {e}\n"))
    }

    fn from_raw(raw: RawConfig) -> Result<Self, ConfigError> {
        let server = ServerConfig {
            listen: raw
                .server
                .listen
                .parse()
                .map_err(|e| invalid("server.listen", format!("{e}: expected IP:PORT")))?,
            shutdown_grace: duration("server.shutdown_grace", &raw.server.shutdown_grace)?,
            workers: match raw.server.workers {
                n if n > 1024 => return Err(invalid("server.workers", format!("{n}: at most 1024"))),
                n => n,
            },
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
            url: backend_url(&raw.backend.url)?,
            connect_timeout: duration("backend.connect_timeout", &raw.backend.connect_timeout)?,
            request_timeout: duration("backend.request_timeout", &raw.backend.request_timeout)?,
            tls: backend_tls(&raw.backend.url, raw.backend.tls)?,
        };
        let f = raw.fence;
        let header = HeaderName::from_bytes(f.header.as_bytes())
            .map_err(|_| invalid("fence.header", format!("{:?} is not a valid header name", f.header)))?;
        if f.methods.is_empty() {
            return Err(invalid("fence.methods", "must name at least one method"));
        }
        let methods = f
            .methods
            .iter()
            .map(|m| {
                Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                    .map_err(|_| invalid("fence.methods", format!("{m:?} is not an HTTP method")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let quarantine = match &f.quarantine {
            Some(q) => duration("fence.quarantine", q)?,
            None => backend.request_timeout,
        };
        let paths = path_policy(&raw.paths)?;
        let scopes = f.scopes.iter().enumerate().map(|(i, s)| scope(i, s, &paths)).collect::<Result<_, _>>()?;
        let fence = FenceConfig {
            header,
            methods,
            equal_token: choice(
                "fence.equal_token",
                &f.equal_token,
                [("reject", EqualToken::Reject), ("accept", EqualToken::Accept)],
            )?,
            missing_token: choice(
                "fence.missing_token",
                &f.missing_token,
                [("reject", MissingToken::Reject), ("forward", MissingToken::Forward)],
            )?,
            queue_timeout: duration("fence.queue_timeout", &f.queue_timeout)?,
            quarantine,
            scopes,
        };
        if raw.store.dir.as_os_str().is_empty() {
            return Err(invalid("store.dir", "must not be empty"));
        }
        let sync = choice("store.sync", &raw.store.sync, [("always", SyncMode::Always), ("never", SyncMode::Never)])?;
        if raw.store.segment_bytes < 4096 {
            return Err(invalid("store.segment_bytes", "must be at least 4096"));
        }
        if raw.store.max_resources == 0 {
            return Err(invalid("store.max_resources", "must be at least 1"));
        }
        let store = StoreConfig {
            dir: raw.store.dir,
            sync,
            segment_bytes: raw.store.segment_bytes,
            max_resources: raw.store.max_resources,
        };
        let level = raw.log.level.to_ascii_lowercase();
        if !["error", "warn", "info", "debug", "trace"].contains(&level.as_str()) {
            return Err(invalid("log.level", format!("{level:?}: expected error, warn, info, debug or trace")));
        }
        let limits = limits(&raw.limits)?;
        let log = LogConfig {
            level,
            format: choice("log.format", &raw.log.format, [("text", LogFormat::Text), ("json", LogFormat::Json)])?,
            refusal_interval: duration("log.refusal_interval", &raw.log.refusal_interval)?,
        };
        let admin = admin(raw.admin)?;
        Ok(Config { server, backend, fence, store, log, paths, limits, admin })
    }
}

fn choice<T: Copy, const N: usize>(key: &str, text: &str, options: [(&str, T); N]) -> Result<T, ConfigError> {
    options.iter().find(|(name, _)| name.eq_ignore_ascii_case(text)).map(|(_, v)| *v).ok_or_else(|| {
        let names: Vec<String> = options.iter().map(|(name, _)| format!("{name:?}")).collect();
        invalid(key, format!("{text:?}: expected {}", names.join(" or ")))
    })
}

const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

fn duration(key: &str, text: &str) -> Result<Duration, ConfigError> {
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

fn backend_url(text: &str) -> Result<Uri, ConfigError> {
    let key = "backend.url";
    let uri: Uri = text.parse().map_err(|e| invalid(key, format!("{text:?}: {e}")))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        Some(other) => {
            return Err(invalid(key, format!("scheme {other:?} is not supported; use http:// or https://")));
        }
        None => {
            return Err(invalid(key, format!("{text:?} needs a scheme, e.g. http://127.0.0.1:9000")));
        }
    }
    if uri.authority().is_none() {
        return Err(invalid(key, format!("{text:?} has no host")));
    }
    // The forwarded path must be exactly the fenced path, so no base path can be prepended.
    if uri.path_and_query().is_some_and(|pq| pq.as_str() != "/" && !pq.as_str().is_empty()) {
        return Err(invalid(key, format!("{text:?} must not have a path or query")));
    }
    Ok(uri)
}

fn admin(raw: RawAdmin) -> Result<AdminConfig, ConfigError> {
    let listen = match raw.listen.as_deref() {
        None | Some("") => None,
        Some(text) => {
            Some(text.parse().map_err(|e| invalid("admin.listen", format!("{text:?}: {e}: expected IP:PORT")))?)
        }
    };
    // FENCEGATE_ADMIN__TOKEN lands in `token` and wins over the file.
    let token = match (raw.token, &raw.token_file) {
        (Some(t), _) => Some(t),
        (None, Some(file)) => Some(
            std::fs::read_to_string(file)
                .map_err(|e| invalid("admin.token_file", format!("{}: {e}", file.display())))?
                .trim()
                .to_owned(),
        ),
        (None, None) => None,
    };
    if token.as_deref().is_some_and(|t| t.len() < 16) {
        return Err(invalid("admin.token_file", "the admin token must be at least 16 characters"));
    }
    Ok(AdminConfig { listen, token_file: raw.token_file, token })
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

fn scope(index: usize, raw: &RawScope, policy: &PathPolicy) -> Result<Scope, ConfigError> {
    let key = format!("fence.scopes[{index}].prefix");
    let canonical =
        path::canonicalize(&raw.prefix, policy).map_err(|e| invalid(&key, format!("{:?}: {e}", raw.prefix)))?;
    if canonical != raw.prefix {
        return Err(invalid(&key, format!("{:?} is not canonical; write {canonical:?}", raw.prefix)));
    }
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

fn ser_duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

fn ser_display<S: Serializer, T: std::fmt::Display>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

fn ser_display_header<S: Serializer>(v: &HeaderName, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v.as_str())
}

fn ser_methods<S: Serializer>(v: &[Method], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(Method::as_str))
}

#[cfg(test)]
mod tests;
