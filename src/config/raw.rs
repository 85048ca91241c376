//! The configuration file as written: serde structs that reject unknown keys and fill in
//! defaults. `super` validates them into [`super::Config`].

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The file as written, with defaults filled in. Durations are strings such as `"2s"`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) server: RawServer,
    pub(super) backend: RawBackend,
    #[serde(default)]
    pub(super) fence: RawFence,
    #[serde(default)]
    pub(super) verify: RawVerify,
    #[serde(default)]
    pub(super) store: RawStore,
    #[serde(default)]
    pub(super) log: RawLog,
    #[serde(default)]
    pub(super) paths: RawPaths,
    #[serde(default)]
    pub(super) limits: RawLimits,
    #[serde(default)]
    pub(super) admin: RawAdmin,
    #[serde(default)]
    pub(super) etcd: RawEtcd,
    #[serde(default)]
    pub(super) s3: RawS3,
    #[serde(default)]
    pub(super) headers: super::headers::RawHeaders,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawS3 {
    pub(super) virtual_host_suffixes: Vec<String>,
    pub(super) flat_keys: bool,
    pub(super) max_uploads: usize,
    pub(super) conditional_deletes: bool,
    pub(super) credentials: Option<RawS3Credentials>,
}

impl Default for RawS3 {
    fn default() -> Self {
        RawS3 {
            virtual_host_suffixes: Vec::new(),
            flat_keys: true,
            max_uploads: super::DEFAULT_MAX_UPLOADS,
            conditional_deletes: false,
            credentials: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawS3Credentials {
    pub(super) access_key_id: String,
    pub(super) secret_access_key_file: PathBuf,
    #[serde(default = "default_region")]
    pub(super) region: String,
}

fn default_region() -> String {
    super::s3::DEFAULT_REGION.to_owned()
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawEtcd {
    pub(super) endpoints: Vec<String>,
    pub(super) request_timeout: String,
    pub(super) username: Option<String>,
    pub(super) password_file: Option<PathBuf>,
    /// Refused: the password is read from `password_file`.
    #[serde(skip_serializing)]
    pub(super) password: Option<String>,
    pub(super) tls: Option<RawEtcdTls>,
}

impl Default for RawEtcd {
    fn default() -> Self {
        RawEtcd {
            endpoints: Vec::new(),
            request_timeout: "2s".into(),
            username: None,
            password_file: None,
            password: None,
            tls: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawEtcdTls {
    pub(super) ca_file: Option<PathBuf>,
    pub(super) cert_file: Option<PathBuf>,
    pub(super) key_file: Option<PathBuf>,
    pub(super) server_name: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawAdmin {
    pub(super) listen: Option<String>,
    pub(super) listen_mode: Option<String>,
    pub(super) token_file: Option<PathBuf>,
    pub(super) token: Option<String>,
    pub(super) read_token_file: Option<PathBuf>,
    pub(super) read_token: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawServer {
    pub(super) listen: String,
    pub(super) listen_mode: Option<String>,
    pub(super) shutdown_grace: String,
    pub(super) workers: usize,
    pub(super) mode: String,
    pub(super) tls: Option<RawServerTls>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServerTls {
    pub(super) cert: PathBuf,
    pub(super) key: PathBuf,
    pub(super) client_ca: Option<PathBuf>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBackendTls {
    pub(super) ca: Option<PathBuf>,
    pub(super) cert: Option<PathBuf>,
    pub(super) key: Option<PathBuf>,
}

impl Default for RawServer {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            listen_mode: None,
            shutdown_grace: "30s".into(),
            workers: 1,
            mode: "proxy".into(),
            tls: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawBackend {
    pub(super) url: String,
    #[serde(default = "default_connect_timeout")]
    pub(super) connect_timeout: String,
    #[serde(default = "default_request_timeout")]
    pub(super) request_timeout: String,
    #[serde(default = "default_backend_max_connections")]
    pub(super) max_connections: usize,
    #[serde(default = "default_pool_timeout")]
    pub(super) pool_timeout: String,
    pub(super) tls: Option<RawBackendTls>,
    #[serde(default = "default_protocol")]
    pub(super) protocol: String,
}

pub(super) fn default_connect_timeout() -> String {
    "2s".into()
}
pub(super) fn default_request_timeout() -> String {
    "30s".into()
}
pub(super) fn default_backend_max_connections() -> usize {
    1024
}
pub(super) fn default_protocol() -> String {
    "http".into()
}
pub(super) fn default_pool_timeout() -> String {
    "5s".into()
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawFence {
    pub(super) header: String,
    /// Refused: the fenced methods are every method not in `unfenced_methods`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) methods: Option<Vec<String>>,
    pub(super) unfenced_methods: Vec<String>,
    pub(super) subtree_methods: Vec<String>,
    pub(super) equal_token: String,
    pub(super) missing_token: String,
    pub(super) queue_timeout: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) quarantine: Option<String>,
    pub(super) scopes: Vec<RawScope>,
    pub(super) rules: Vec<RawRule>,
}

impl Default for RawFence {
    fn default() -> Self {
        Self {
            header: "Fencing-Token".into(),
            methods: None,
            unfenced_methods: ["GET", "HEAD", "OPTIONS", "TRACE", "PROPFIND"].map(String::from).to_vec(),
            subtree_methods: ["DELETE", "MOVE", "COPY"].map(String::from).to_vec(),
            equal_token: "reject".into(),
            missing_token: "reject".into(),
            queue_timeout: "10s".into(),
            quarantine: None,
            scopes: Vec::new(),
            rules: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRule {
    pub(super) prefix: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) token_domain: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) equal_token: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) verify: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) lock: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) max_jump: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) pin: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawVerify {
    pub(super) signature_header: String,
    pub(super) clock_skew: String,
    pub(super) max_lag: String,
    pub(super) client_refusal_burst: u32,
    pub(super) client_refusal_refill: String,
    pub(super) key_refusal_burst: u32,
    pub(super) key_refusal_refill: String,
    pub(super) hmac_keys: Vec<RawHmacKey>,
}

impl Default for RawVerify {
    fn default() -> Self {
        Self {
            signature_header: "Fencing-Token-Signature".into(),
            clock_skew: "30s".into(),
            max_lag: "2s".into(),
            client_refusal_burst: 10,
            client_refusal_refill: "1s".into(),
            key_refusal_burst: 100,
            key_refusal_refill: "100ms".into(),
            hmac_keys: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawHmacKey {
    pub(super) id: String,
    pub(super) secret_file: PathBuf,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawScope {
    pub(super) prefix: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) segments: Option<usize>,
}

/// `[store]`. The settings of one kind of store are options, so that setting one beside the
/// other kind is an error rather than silently ignored.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawStore {
    pub(super) kind: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) dir: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) sync: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) segment_bytes: Option<u64>,
    pub(super) max_resources: usize,
    pub(super) max_table_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) stall_after: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) writer_scheduling: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) prefix: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) advertise: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) peer_ca: Option<std::path::PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) lease_ttl: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) lease_margin: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) max_txn_ops: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) batches_in_flight: Option<usize>,
}

impl Default for RawStore {
    fn default() -> Self {
        Self {
            kind: "file".into(),
            dir: None,
            sync: None,
            segment_bytes: None,
            max_resources: 10_000_000,
            max_table_bytes: 1 << 30,
            stall_after: None,
            writer_scheduling: None,
            prefix: None,
            advertise: None,
            peer_ca: None,
            lease_ttl: None,
            lease_margin: None,
            max_txn_ops: None,
            batches_in_flight: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawLog {
    pub(super) level: String,
    pub(super) format: String,
    pub(super) refusal_interval: String,
    pub(super) buffer_lines: usize,
    pub(super) access: bool,
    pub(super) access_format: String,
}

impl Default for RawLog {
    fn default() -> Self {
        Self {
            level: "info".into(),
            format: "text".into(),
            refusal_interval: "1s".into(),
            buffer_lines: 16_384,
            access: false,
            access_format: "log".into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawPaths {
    pub(super) escaped_slashes: String,
    pub(super) merge_slashes: bool,
    pub(super) case_sensitive: bool,
    pub(super) trailing_slash: String,
    pub(super) matrix_params: String,
}

impl Default for RawPaths {
    fn default() -> Self {
        Self {
            escaped_slashes: "reject".into(),
            merge_slashes: true,
            case_sensitive: true,
            trailing_slash: "distinct".into(),
            matrix_params: "reject".into(),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawLimits {
    pub(super) header_read_timeout: String,
    pub(super) keepalive_timeout: String,
    pub(super) max_connections: usize,
    pub(super) max_header_bytes: usize,
    pub(super) max_uri_bytes: usize,
    pub(super) max_body_bytes: u64,
    pub(super) h2_max_concurrent_streams: u32,
}

impl Default for RawLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: "10s".into(),
            keepalive_timeout: "60s".into(),
            max_connections: 4096,
            max_header_bytes: 16 * 1024,
            max_uri_bytes: 8 * 1024,
            max_body_bytes: 0,
            h2_max_concurrent_streams: 100,
        }
    }
}
