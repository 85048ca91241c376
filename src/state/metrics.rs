//! Prometheus metrics, served by the admin API at `GET /metrics`.
//!
//! Every refusal is evidence of a split brain somewhere upstream, so requests are counted by
//! outcome, which is either `forwarded` or the refusal's `fencegate-error` code. Labels are
//! bounded: unusual methods count as `other`.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use http::Method;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

/// Labels of `fencegate_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The request method, or `other`.
    pub method: &'static str,
    /// `forwarded`, or the code of fencegate's own answer.
    pub outcome: &'static str,
}

/// Labels of `fencegate_table_bytes`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TableLabels {
    /// `keys`, `floors`, or `fence` (the fence's gates and tree nodes).
    pub part: &'static str,
}

/// Labels of `fencegate_backend_responses_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClassLabels {
    /// `1xx` to `5xx`.
    pub class: &'static str,
}

const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// Labels of `fencegate_open_connections`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabels {
    /// `proxy` or `admin`.
    pub listener: &'static str,
}

/// Labels of `fencegate_build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    /// The crate's version.
    pub version: &'static str,
}

/// Labels of `fencegate_admin_changes_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    /// `advance`, `reset` or `lift`.
    pub action: &'static str,
}

/// Labels of `fencegate_reloads_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabels {
    /// `applied` or `rejected`.
    pub outcome: &'static str,
}

/// Labels of `fencegate_lock_view_age_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PrefixLabels {
    /// The etcd prefix a view of locks watches.
    pub prefix: String,
}

/// Labels of `fencegate_store_role`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoleLabels {
    /// `writer` (fences writes here), `follower` (sends them to the leader) or `unavailable`.
    pub role: &'static str,
}

/// Labels of `fencegate_proofs_limited_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ScopeLabels {
    /// `client` (too many refused from one address) or `key` (for one key).
    pub scope: &'static str,
}

/// What operators did and what the process uses, beside the requests.
#[derive(Debug, Default)]
struct Operations {
    admin_changes: Family<ActionLabels, Counter>,
    admin_auth_failures: Counter,
    proofs_limited: Family<ScopeLabels, Counter>,
    reloads: Family<ReloadLabels, Counter>,
    cpu: Counter<f64, AtomicU64>,
    resident: Gauge,
    open_fds: Gauge,
    max_fds: Gauge,
    open_connections: Family<ListenerLabels, Gauge>,
    quarantined: Gauge,
    lock_view_age: Family<PrefixLabels, Gauge<f64, AtomicU64>>,
    role: Family<RoleLabels, Gauge>,
}

/// All of fencegate's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    /// `requests{outcome="forwarded"}` per method in [`METHODS`], looked up once: the hot path.
    forwarded: [Counter; METHODS.len()],
    /// Time to the backend's response head.
    pub backend_latency: Histogram,
    /// Time from a request's arrival to fencegate's response head (every proxied request).
    pub request_latency: Histogram,
    /// Backend responses by status class, 1xx to 5xx, looked up once.
    backend_classes: [Counter; 5],
    /// Time a fenced write waited for its resource's turn.
    pub queue_wait: Histogram,
    /// Time to write and fdatasync one batch of advances.
    pub sync_latency: Histogram,
    /// Advances made durable by one sync (group commit at work).
    pub batch_size: Histogram,
    /// Fenced writes at the backend: advanced, not yet answered.
    pub in_flight: Gauge,
    /// Fenced writes the backend answered after the permission to send them lapsed.
    pub answered_after_lapse: Counter,
    /// Resources with a `max_seen` (set when scraped).
    pub resources: Gauge,
    /// Approximate bytes of memory of the fence table, by part (set when scraped).
    table_bytes: Family<TableLabels, Gauge>,
    /// Their bound, `store.max_table_bytes` (set when scraped).
    table_limit: Gauge,
    /// `HEAD`s sent to learn a pinned key's state (docs/pins.md), by what they found.
    pub pin_heads: Family<PinHeadLabels, Counter>,
    /// Request body bytes sent to the backend.
    pub bytes_in: Counter,
    /// Response body bytes sent to clients.
    pub bytes_out: Counter,
    /// Log lines dropped: a queue to stderr was full, or stderr refused access lines (brought up
    /// to date when scraped).
    log_dropped: Counter,
    batches_overtaken: Counter,
    ops: Operations,
}

/// Methods counted under their own name; others count as `other`, the last entry.
const METHODS: [&str; 8] = ["GET", "HEAD", "PUT", "POST", "PATCH", "DELETE", "OPTIONS", "other"];

fn method_index(method: &Method) -> usize {
    match *method {
        Method::GET => 0,
        Method::HEAD => 1,
        Method::PUT => 2,
        Method::POST => 3,
        Method::PATCH => 4,
        Method::DELETE => 5,
        Method::OPTIONS => 6,
        _ => 7,
    }
}

fn seconds() -> Histogram {
    Histogram::new(exponential_buckets(0.000_1, 2.0, 18)) // 100 µs .. 13 s
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("fencegate");
        let backend_responses = Family::<ClassLabels, Counter>::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let forwarded =
            METHODS.map(|method| requests.get_or_create(&RequestLabels { method, outcome: "forwarded" }).clone());
        let m = Metrics {
            requests,
            forwarded,
            backend_latency: seconds(),
            request_latency: seconds(),
            backend_classes: CLASSES.map(|class| backend_responses.get_or_create(&ClassLabels { class }).clone()),
            queue_wait: seconds(),
            sync_latency: seconds(),
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 13)), // 1 .. 4096
            in_flight: Gauge::default(),
            answered_after_lapse: Counter::default(),
            resources: Gauge::default(),
            table_bytes: Family::default(),
            table_limit: Gauge::default(),
            pin_heads: Family::default(),
            bytes_in: Counter::default(),
            bytes_out: Counter::default(),
            log_dropped: Counter::default(),
            batches_overtaken: Counter::default(),
            ops: Operations::default(),
            registry: Registry::default(),
        };
        // Every label value shows from the start, at 0, so that alerts on increases work.
        for action in ["advance", "reset", "lift"] {
            drop(m.ops.admin_changes.get_or_create(&ActionLabels { action }));
        }
        for listener in ["proxy", "admin"] {
            drop(m.ops.open_connections.get_or_create(&ListenerLabels { listener }));
        }
        for outcome in ["applied", "rejected"] {
            drop(m.ops.reloads.get_or_create(&ReloadLabels { outcome }));
        }
        let build = Family::<BuildLabels, Gauge>::default();
        build.get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION") }).set(1);
        registry.register("build_info", "The running build: its version, as a label", build);
        registry.register(
            "admin_changes",
            "Changes made through the admin API, by action",
            m.ops.admin_changes.clone(),
        );
        registry.register(
            "admin_auth_failures",
            "Admin API requests refused for a missing or wrong token",
            m.ops.admin_auth_failures.clone(),
        );
        registry.register(
            "proofs_limited",
            "Verified writes answered 429 too_many_refusals before their proof was checked, by whose refusals",
            m.ops.proofs_limited.clone(),
        );
        registry.register("reloads", "Configuration reloads, by outcome", m.ops.reloads.clone());
        registry.register_with_unit("process_cpu", "User and system CPU time", Unit::Seconds, m.ops.cpu.clone());
        registry.register_with_unit("process_resident_memory", "Resident memory", Unit::Bytes, m.ops.resident.clone());
        registry.register(
            "open_connections",
            "Client connections open now, by listener",
            m.ops.open_connections.clone(),
        );
        registry.register(
            "quarantined_resources",
            "Resources and subtrees refusing writes because an earlier write's outcome is unknown (set when scraped)",
            m.ops.quarantined.clone(),
        );
        registry.register_with_unit(
            "lock_view_age",
            "How old the proof is that a view of etcd's locks is complete, by prefix (+Inf: not caught up; set when scraped)",
            Unit::Seconds,
            m.ops.lock_view_age.clone(),
        );
        registry.register(
            "store_role",
            "1 for what this instance does with fenced writes now: writer, follower (the etcd store's, sending them to the leader) or unavailable; 0 for the others (set when scraped)",
            m.ops.role.clone(),
        );
        registry.register("process_open_fds", "Open file descriptors", m.ops.open_fds.clone());
        registry.register("process_max_fds", "The limit on open file descriptors", m.ops.max_fds.clone());
        registry.register("requests", "Requests by method and outcome", m.requests.clone());
        let s = Unit::Seconds;
        registry.register_with_unit(
            "backend_request_duration",
            "Time to the backend's response head",
            s.clone(),
            m.backend_latency.clone(),
        );
        registry.register_with_unit(
            "request_duration",
            "Time from a request's arrival to fencegate's response head, for every proxied request",
            s.clone(),
            m.request_latency.clone(),
        );
        registry.register("backend_responses", "Backend responses by status class", backend_responses);
        registry.register_with_unit(
            "queue_wait",
            "Time a fenced write waited for its resource's turn",
            s.clone(),
            m.queue_wait.clone(),
        );
        registry.register_with_unit(
            "store_sync_duration",
            "Time to write and fdatasync one batch",
            s,
            m.sync_latency.clone(),
        );
        registry.register("store_batch_advances", "Advances made durable by one sync", m.batch_size.clone());
        registry.register(
            "writes_in_flight",
            "Fenced writes at the backend: advanced, not yet answered",
            m.in_flight.clone(),
        );
        registry.register(
            "writes_answered_after_lapse",
            "Fenced writes the backend answered after the permission to send them lapsed (a shared fence's leader paused or cut off): one held between its last check and its send may have reached the backend after a newer write",
            m.answered_after_lapse.clone(),
        );
        registry.register("resources", "Resources with a max_seen", m.resources.clone());
        registry.register_with_unit(
            "table",
            "Approximate memory of the fence table, by part: keys, floors, and the fence's gates and tree nodes",
            Unit::Bytes,
            m.table_bytes.clone(),
        );
        registry.register_with_unit(
            "table_limit",
            "Most memory the fence table may take for new resources (store.max_table_bytes)",
            Unit::Bytes,
            m.table_limit.clone(),
        );
        registry.register(
            "pin_heads",
            "HEADs sent to learn a pinned key's state, by what they found: tag, absent, or unavailable",
            m.pin_heads.clone(),
        );
        registry.register_with_unit(
            "request_body",
            "Request body bytes sent to the backend",
            Unit::Bytes,
            m.bytes_in.clone(),
        );
        registry.register_with_unit(
            "response_body",
            "Response body bytes sent to clients",
            Unit::Bytes,
            m.bytes_out.clone(),
        );
        registry.register(
            "log_lines_dropped",
            "Log lines dropped: a queue to stderr was full, or stderr refused access lines",
            m.log_dropped.clone(),
        );
        registry.register(
            "store_batches_overtaken",
            "etcd store: batches etcd took before the batch sent ahead of them, sent again with those behind",
            m.batches_overtaken.clone(),
        );
        Metrics { registry, ..m }
    }
}

/// What a pinned write's `HEAD` found.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PinHeadLabels {
    /// `tag`, `absent` or `unavailable`.
    pub found: &'static str,
}

impl Metrics {
    /// Counts one request by method and outcome.
    pub fn request(&self, method: &Method, outcome: &'static str) {
        let method = method_index(method);
        if outcome == "forwarded" {
            self.forwarded[method].inc();
        } else {
            self.requests.get_or_create(&RequestLabels { method: METHODS[method], outcome }).inc();
        }
    }

    /// Brings the count of dropped log lines up to `dropped`, the process's count so far.
    pub fn log_dropped(&self, dropped: u64) {
        self.log_dropped.inc_by(dropped.saturating_sub(self.log_dropped.get()));
    }

    /// Sets the batches the store sent again because etcd took them out of order.
    pub fn batches_overtaken(&self, overtaken: u64) {
        self.batches_overtaken.inc_by(overtaken.saturating_sub(self.batches_overtaken.get()));
    }

    /// Sets the fence table's bytes by part, and their limit.
    pub fn table(&self, keys: u64, floors: u64, fence: u64, limit: u64) {
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for (part, bytes) in [("keys", keys), ("floors", floors), ("fence", fence)] {
            self.table_bytes.get_or_create(&TableLabels { part }).set(gauge(bytes));
        }
        self.table_limit.set(gauge(limit));
    }

    /// Counts one backend response by its status class.
    pub fn backend_response(&self, status: http::StatusCode) {
        if let Some(counter) =
            (status.as_u16() / 100).checked_sub(1).and_then(|i| self.backend_classes.get(usize::from(i)))
        {
            counter.inc();
        }
    }

    /// The gauge of connections open on `listener`.
    pub(crate) fn open_connections(&self, listener: &'static str) -> Gauge {
        self.ops.open_connections.get_or_create(&ListenerLabels { listener }).clone()
    }

    /// Sets the age of each view of etcd's locks (when scraped).
    pub(crate) fn lock_views(&self, ages: Vec<(String, Option<std::time::Duration>)>) {
        for (prefix, age) in ages {
            let seconds = age.map_or(f64::INFINITY, |a| a.as_secs_f64());
            self.ops.lock_view_age.get_or_create(&PrefixLabels { prefix }).set(seconds);
        }
    }

    /// Sets which role this instance has (when scraped): `writer`, `follower` or `unavailable`.
    pub(crate) fn role(&self, now: &'static str) {
        for role in ["writer", "follower", "unavailable"] {
            self.ops.role.get_or_create(&RoleLabels { role }).set(i64::from(role == now));
        }
    }

    /// Sets the number of quarantined resources and subtrees (when scraped).
    pub(crate) fn quarantined(&self, n: usize) {
        self.ops.quarantined.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Counts one change made through the admin API.
    pub fn admin_change(&self, action: &'static str) {
        self.ops.admin_changes.get_or_create(&ActionLabels { action }).inc();
    }

    /// Counts one admin request refused for a missing or wrong token.
    pub fn admin_auth_failure(&self) {
        self.ops.admin_auth_failures.inc();
    }

    /// Counts one verified write refused unchecked: too many proofs from its client
    /// (`client`) or for its key (`key`) were refused lately.
    pub fn proof_limited(&self, scope: &'static str) {
        self.ops.proofs_limited.get_or_create(&ScopeLabels { scope }).inc();
    }

    /// Counts one configuration reload, applied or rejected.
    pub fn reload(&self, applied: bool) {
        let outcome = if applied { "applied" } else { "rejected" };
        self.ops.reloads.get_or_create(&ReloadLabels { outcome }).inc();
    }

    /// Brings the process's figures up to date (when scraped).
    pub(crate) fn process(&self) {
        let p = super::process::Process::read();
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.ops.cpu.inc_by((p.cpu_seconds - self.ops.cpu.get()).max(0.0));
        self.ops.resident.set(gauge(p.resident_bytes));
        self.ops.open_fds.set(gauge(p.open_fds));
        self.ops.max_fds.set(gauge(p.max_fds));
    }

    /// Records one durable batch.
    pub fn commit(&self, took: Duration, advances: usize) {
        self.sync_latency.observe(took.as_secs_f64());
        self.batch_size.observe(advances as f64);
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        if encode(&mut text, &self.registry).is_err() {
            text.clear();
        }
        text
    }
}
