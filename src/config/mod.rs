//! Configuration: a raw serde view of the TOML file (unknown keys are errors), validated into
//! [`Config`], whose every field is already the type the proxy uses.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::Method;
use http::header::HeaderName;
use serde::{Serialize, Serializer};

pub use crate::fence::lock_names::LockTemplate;
pub use crate::fence::path::PathPolicy;
pub use crate::fence::{DEFAULT_DOMAIN, EqualToken, Scope};
pub use crate::store::{SyncMode, WriterScheduling};

mod address;
mod environment;
mod etcd;
mod headers;
mod raw;
mod record;
pub mod reload;
mod s3;
mod store;
mod validate;
mod verify;

pub use address::{BackendUrl, DEFAULT_LISTEN_MODE, ListenAddr};
pub use environment::Environment;
pub use etcd::{EtcdConfig, EtcdTls};
pub use headers::{Forwarding, HeaderRules, HeadersConfig};
pub use s3::{DEFAULT_MAX_UPLOADS, DEFAULT_REGION, S3Config, S3Credentials, SecretKey};
pub use verify::{HmacKey, Verify, VerifyConfig};

use raw::RawConfig;

/// A configuration that could not be loaded; the message names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read or parsed, or a key is unknown or of the wrong type.
    #[error(transparent)]
    Load(#[from] config::ConfigError),
    /// The file could not be read (missing, a directory, no permission).
    #[error("cannot read {}: {message}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        message: String,
    },
    /// An environment variable named as a setting (`FENCEGATE_<SECTION>__<KEY>`) is not one, or
    /// its value is not acceptable.
    #[error("environment variable {name}: {message}")]
    Environment {
        /// The variable.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A key parsed but its value is not acceptable.
    #[error("{key}: {message}")]
    Invalid {
        /// Dotted key, as written in the file (`fence.equal_token`).
        key: String,
        /// What is wrong and what would be accepted.
        message: String,
    },
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

/// The validated configuration.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Config {
    /// The client-facing listener.
    pub server: ServerConfig,
    /// The protected backend.
    pub backend: BackendConfig,
    /// The fencing policy.
    pub fence: FenceConfig,
    /// How tokens are proven, where a rule asks for it.
    pub verify: VerifyConfig,
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
    /// The etcd cluster that token verification reads locks from.
    pub etcd: EtcdConfig,
    /// How S3 requests name buckets (`backend.protocol = "s3"`).
    pub s3: S3Config,
    /// What is added to and taken from forwarded headers.
    pub headers: HeadersConfig,
}

/// `[admin]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdminConfig {
    /// Where the admin API listens; off when unset.
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "ser_some_display")]
    pub listen: Option<ListenAddr>,
    /// Permissions of its Unix socket file; restart-only.
    #[serde(serialize_with = "ser_mode")]
    pub listen_mode: u32,
    /// File the write token was read from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_file: Option<PathBuf>,
    /// Bearer token for admin writes (never printed); without one, writes are disabled. It
    /// grants every read too.
    #[serde(skip)]
    pub token: Option<String>,
    /// File the read token was read from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_token_file: Option<PathBuf>,
    /// Bearer token for reads that disclose what a verified write could use (never printed):
    /// the levels of keys under a `verify` rule, and etcd lock holders.
    #[serde(skip)]
    pub read_token: Option<String>,
}

/// `[limits]`
#[derive(Debug, Clone, PartialEq, Serialize)]
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
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServerConfig {
    /// Address the binary binds (tests bind their own listener and ignore it).
    #[serde(serialize_with = "ser_display")]
    pub listen: ListenAddr,
    /// Permissions of its Unix socket file; restart-only.
    #[serde(serialize_with = "ser_mode")]
    pub listen_mode: u32,
    /// On SIGTERM, in-flight requests get this long to finish.
    #[serde(serialize_with = "ser_duration")]
    pub shutdown_grace: Duration,
    /// Threads serving requests: 1 is a single-threaded event loop (like one nginx worker),
    /// 0 one thread per CPU.
    pub workers: usize,
    /// What `listen` serves: the proxy, or Envoy's external processor; restart-only.
    pub mode: ServerMode,
    /// Serve HTTPS with these files (PEM); plain HTTP when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<ServerTls>,
}

/// `server.mode`: what fencegate is to its clients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerMode {
    /// A reverse proxy in front of the backend (the default).
    Proxy,
    /// Envoy's external processor (`envoy.filters.http.ext_proc`), a gRPC service: Envoy
    /// forwards, fencegate decides and holds each write's turn (docs/envoy.md).
    ExtProc,
}

/// `[server.tls]`
#[derive(Debug, Clone, PartialEq, Serialize)]
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
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
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
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BackendConfig {
    /// Scheme and authority of the backend; the path of each request is appended.
    #[serde(serialize_with = "ser_display")]
    pub url: BackendUrl,
    /// Bound on establishing a TCP connection to the backend.
    #[serde(serialize_with = "ser_duration")]
    pub connect_timeout: Duration,
    /// Bound on the backend's response head, measured from sending the request.
    #[serde(serialize_with = "ser_duration")]
    pub request_timeout: Duration,
    /// Connections to the backend open at once; restart-only, so that the bound never changes
    /// under requests that count on it.
    pub max_connections: usize,
    /// How long a request waits for a free backend connection before a 503.
    #[serde(serialize_with = "ser_duration")]
    pub pool_timeout: Duration,
    /// TLS to the backend (only with `https://`).
    pub tls: BackendTls,
    /// How requests name the backend's resources and how refusals are written for its clients;
    /// restart-only, since the fence keys follow it.
    pub protocol: BackendProtocol,
}

/// `backend.protocol`: the kind of backend, which decides how a request names its resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendProtocol {
    /// HTTP and WebDAV resources named by path (the default).
    Http,
    /// S3-compatible object storage: objects named by bucket and key.
    S3,
}

/// `[fence]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FenceConfig {
    /// The request header that carries the token.
    #[serde(serialize_with = "ser_display_header")]
    pub header: HeaderName,
    /// Methods forwarded unchecked, matched exactly (method names are case-sensitive); every
    /// other method is fenced.
    #[serde(serialize_with = "ser_methods")]
    pub unfenced_methods: Vec<Method>,
    /// Methods whose write covers the whole subtree at its path (and at its Destination), such
    /// as a collection's DELETE, MOVE or COPY; matched exactly.
    #[serde(serialize_with = "ser_methods")]
    pub subtree_methods: Vec<Method>,
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
    /// Settings per path prefix (the longest matching prefix wins); reloadable.
    pub rules: Vec<Rule>,
}

impl FenceConfig {
    /// Whether `key`'s level is kept from whoever has no admin token: a level in a token domain
    /// that holds keys verified against etcd may be a lock holder's create revision, which is
    /// the token that passes (a token domain is one counter, so a holder's revision can be any
    /// key's level in it). Under `verify = "hmac"` a level is only a number: a signature, not
    /// the number, proves a token.
    pub fn withholds(&self, key: &str) -> bool {
        let by_etcd = |r: &Rule| r.verify == Some(Verify::Etcd);
        if !self.rules.iter().any(by_etcd) {
            return false;
        }
        let domain = Rule::domain_of(&self.rules, key);
        self.rules.iter().any(|r| by_etcd(r) && r.token_domain == domain)
    }
}

impl Rule {
    /// The longest of `rules` over `key` for which `sets` holds: where a per-prefix setting of
    /// `key` comes from.
    pub fn longest<'a>(rules: &'a [Rule], key: &str, sets: impl Fn(&Rule) -> bool) -> Option<&'a Rule> {
        let over = rules.iter().filter(|r| sets(r) && crate::fence::keys::in_scope(key, &r.prefix));
        over.max_by_key(|r| r.prefix.len())
    }

    /// The longest of `rules` over `key` that sets `verify`: what proves the key's tokens.
    pub fn verifying<'a>(rules: &'a [Rule], key: &str) -> Option<&'a Rule> {
        Rule::longest(rules, key, |r| r.verify.is_some())
    }

    /// The token domain of `key` (every rule has one, set or inherited).
    pub fn domain_of<'a>(rules: &'a [Rule], key: &str) -> &'a str {
        Rule::longest(rules, key, |_| true).map_or(DEFAULT_DOMAIN, |r| r.token_domain.as_str())
    }
}

/// One `[[fence.rules]]` entry: settings for the keys under a prefix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Rule {
    /// Canonical path prefix, matched on segment boundaries.
    pub prefix: String,
    /// The counter the tokens under this prefix come from. Tokens are compared across keys
    /// (a subtree against what is below it, a MOVE's two keys) only within one domain.
    pub token_domain: String,
    /// What a token equal to `max_seen` gets under this prefix; unset, a shorter rule's
    /// setting or `fence.equal_token` decides.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub equal_token: Option<EqualToken>,
    /// What a token under this prefix must prove; unset, a shorter rule's setting, else
    /// [`Verify::None`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verify: Option<Verify>,
    /// The etcd lock that guards each key, for `verify = "etcd"`.
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "ser_template")]
    pub lock: Option<LockTemplate>,
    /// How far above a key's `max_seen` (or its domain's highest token) a token may be; unset,
    /// a shorter rule's setting, else unbounded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_jump: Option<u64>,
    /// Whether writes under this prefix are sent with a precondition naming the backend's
    /// state (docs/pins.md); unset, a shorter rule's setting, else [`PinMode::Off`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pin: Option<PinMode>,
}

/// Whether a key's fenced writes are pinned to the backend's state (docs/pins.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PinMode {
    /// Sent as the client sent them.
    Off,
    /// A pinnable write is sent with `If-Match` or `If-None-Match` naming what was last learnt
    /// of the key, by a write's answer or a `HEAD`.
    Etag,
}

fn ser_template<S: serde::Serializer>(t: &Option<LockTemplate>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.serialize_str(t.as_str()),
        None => s.serialize_none(),
    }
}

/// Where `max_seen` is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// A data directory of this instance's own (the default).
    File,
    /// An etcd cluster shared by several instances, one of which leads (docs/cluster.md).
    Etcd,
}

/// `[store]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StoreConfig {
    /// Where the fence is kept.
    pub kind: StoreKind,
    /// Data directory holding the log and its lock file (file store).
    pub dir: PathBuf,
    /// fsync policy.
    pub sync: SyncMode,
    /// Segment size that triggers rotation and a snapshot.
    pub segment_bytes: u64,
    /// Most resources the table holds; writes to new ones are refused beyond it.
    pub max_resources: usize,
    /// Most bytes of memory the table's keys, floors and gates take; writes to new resources
    /// are refused beyond it.
    pub max_table_bytes: u64,
    /// `/readyz` reports the store stalled once a write or sync of its log has taken this long.
    #[serde(serialize_with = "ser_duration")]
    pub stall_after: Duration,
    /// How the file store's writer thread is scheduled (`batch`: a batch thread, which never
    /// preempts on wake-up, while batches hold several writes).
    pub writer_scheduling: WriterScheduling,
    /// The etcd store's settings, with `kind = "etcd"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub etcd: Option<EtcdStoreConfig>,
}

/// The etcd store's settings in `[store]`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EtcdStoreConfig {
    /// The key prefix of the fence in etcd.
    pub prefix: String,
    /// The URL the other instances forward fenced writes to while this one leads.
    pub advertise: String,
    /// The CA the other instances' certificates are checked against when their URLs are
    /// `https://`; the system's roots when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peer_ca: Option<std::path::PathBuf>,
    /// The leader's lease (whole seconds).
    #[serde(serialize_with = "ser_duration")]
    pub lease_ttl: Duration,
    /// How much sooner than etcd the leader stops trusting its lease.
    #[serde(serialize_with = "ser_duration")]
    pub lease_margin: Duration,
    /// The most operations etcd takes in one transaction (its `--max-txn-ops`).
    pub max_txn_ops: usize,
    /// Batches the leader has in flight to etcd at once.
    pub batches_in_flight: usize,
}

/// `[log]`
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LogConfig {
    /// `error`, `warn`, `info`, `debug` or `trace`.
    pub level: String,
    /// Whether lines are human-readable text or one JSON object each.
    pub format: LogFormat,
    /// At most one line per resource per this interval for refused requests.
    #[serde(serialize_with = "ser_duration")]
    pub refusal_interval: Duration,
    /// Log lines queued for stderr at most; more are dropped (and counted) rather than wait.
    pub buffer_lines: usize,
    /// One line per proxied request, at info under the target `fencegate::access`.
    pub access: bool,
    /// The layout of access lines.
    pub access_format: AccessFormat,
}

/// How access lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AccessFormat {
    /// As the log's other lines (`log.format`): `name=value` fields, or one JSON object.
    Log,
    /// nginx's and Apache's `combined` format, which log tools read as it is.
    Combined,
    /// `combined`, then the fence's outcome, the token and the duration as `name=value`.
    CombinedFencegate,
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
    /// (the process environment when `None`), then validates. Other `FENCEGATE_*` variables
    /// are not settings and are left alone ([`Environment`] tells which they are).
    pub fn load(path: &Path, env: Option<HashMap<String, String>>) -> Result<Self, ConfigError> {
        let settings = Environment::read(env).settings;
        match Config::load_with(path, settings.clone()) {
            Ok(config) => Ok(config),
            // Name the variable that spoils a file that loads on its own.
            Err(e) if !settings.is_empty() && Config::load_with(path, HashMap::new()).is_ok() => {
                let mut names: Vec<&String> = settings.keys().collect();
                names.sort();
                let culprit = names.into_iter().find(|name| {
                    let one = settings.get(*name).map(|v| HashMap::from([((*name).clone(), v.clone())]));
                    one.is_some_and(|one| Config::load_with(path, one).is_err())
                });
                match culprit {
                    Some(name) => Err(ConfigError::Environment { name: name.clone(), message: e.to_string() }),
                    None => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    fn load_with(path: &Path, settings: HashMap<String, String>) -> Result<Self, ConfigError> {
        // Read here rather than by the `config` crate, which reports a file it may not read, or
        // one in a directory it may not enter, as "not found".
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Read { path: path.to_owned(), message: e.to_string() })?;
        let environment = config::Environment::with_prefix("FENCEGATE")
            .prefix_separator("_")
            .separator("__")
            .try_parsing(true)
            .list_separator(",")
            .with_list_parse_key("fence.unfenced_methods")
            .with_list_parse_key("fence.subtree_methods")
            .with_list_parse_key("fence.methods")
            .source(Some(settings));
        let raw: RawConfig = config::Config::builder()
            .add_source(config::File::from_str(&text, config::FileFormat::Toml))
            .add_source(environment)
            .build()?
            .try_deserialize()?;
        validate::config(raw)
    }

    /// Parses and validates TOML text, without environment overrides.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let raw: RawConfig = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .build()?
            .try_deserialize()?;
        validate::config(raw)
    }

    /// The effective settings, every default filled in, as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).unwrap_or_else(|e| format!("# cannot render settings: {e}\n"))
    }
}

fn ser_duration<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

fn ser_display<S: Serializer, T: std::fmt::Display>(v: &T, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

fn ser_some_display<S: Serializer, T: std::fmt::Display>(v: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.collect_str(v),
        None => s.serialize_none(),
    }
}

fn ser_mode<S: Serializer>(mode: &u32, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&format_args!("{mode:04o}"))
}

fn ser_display_header<S: Serializer>(v: &HeaderName, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v.as_str())
}

fn ser_methods<S: Serializer>(v: &[Method], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(Method::as_str))
}

#[cfg(test)]
mod tests;
