//! What `fencegate check --envoy FILE` reads of Envoy's bootstrap (docs/envoy.md): whether the
//! Envoy that asks fencegate as its external processor could let a write past the fence,
//! change it after fencegate decided it, or send it again or twice without asking
//! (envoyproxy/envoy#23301: the router retries and mirrors without running the filter chain
//! again). It denies by default: a field it does not know on the processor's filter or on a
//! route that carries writes, a filter after the processor, or a value it cannot read for
//! certain (`yes` for `true`, a number for a mode) is refused, not trusted. Only what the file
//! holds is checked: listeners from LDS, routes from RDS and scoped routes are named as
//! unchecked.

use std::time::Duration;

use http::Method;
use yaml_rust2::{Yaml, YamlLoader};

use super::Error;
use crate::config::{BackendProtocol, Config};

/// The filter's canonical name, under which per-route settings are keyed (as well as under
/// the name a configuration gives it).
const FILTER: &str = "envoy.filters.http.ext_proc";
/// The attribute that tells the backend's answers from Envoy's own.
const CODE_DETAILS: &str = "response.code_details";
/// The headers by which a read claims another method, which fencegate fences as that method
/// (`request::protocol::http`'s overrides).
const METHOD_OVERRIDES: [&str; 3] = ["x-http-method-override", "x-http-method", "x-method-override"];

/// The processor filter's fields whose effect the check knows; any other is refused.
const KNOWN_FIELDS: [&str; 20] = [
    "@type",
    "grpc_service",
    "failure_mode_allow",
    "processing_mode",
    "request_attributes",
    "response_attributes",
    "message_timeout",
    "max_message_timeout",
    "stat_prefix",
    "allow_mode_override",
    "allow_content_length_header",
    "observability_mode",
    "send_body_without_waiting_for_header_response",
    "disable_immediate_response",
    "route_cache_action",
    "disable_clear_route_cache",
    "deferred_close_timeout",
    "metadata_options",
    "status_on_error",
    "emit_client_span",
];

/// What a route that carries writes must not have: Envoy would send a write again, twice, or
/// somewhere other than what fencegate decided.
const WRITE_ROUTE_REFUSED: [(&str, &str); 11] = [
    ("retry_policy", "send a write again without asking fencegate"),
    ("retry_policy_typed_config", "send a write again without asking fencegate"),
    ("hedge_policy", "send a write twice without asking fencegate"),
    ("request_mirror_policies", "send a write twice without asking fencegate"),
    ("prefix_rewrite", "send a write to another path than the one fenced"),
    ("regex_rewrite", "send a write to another path than the one fenced"),
    ("path_rewrite_policy", "send a write to another path than the one fenced"),
    ("host_rewrite_literal", "send a write to another host than the one fenced"),
    ("host_rewrite_header", "send a write to another host than the one fenced"),
    ("host_rewrite_path_regex", "send a write to another host than the one fenced"),
    ("auto_host_rewrite", "send a write to another host than the one fenced"),
];

/// What the check found: refusals (the configuration must not be used) and warnings.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct EnvoyCheck {
    /// What would let a write past the fence or out of order, each naming where.
    pub refusals: Vec<String>,
    /// What works, but worse than it could (or what the file does not hold).
    pub warnings: Vec<String>,
}

/// Checks Envoy's bootstrap `text` (YAML or JSON) against `config`.
pub fn check_envoy(config: &Config, text: &str) -> Result<EnvoyCheck, Error> {
    let docs = YamlLoader::load_from_str(text).map_err(|e| Error::Envoy(format!("does not parse: {e}")))?;
    let root = docs.first().ok_or_else(|| Error::Envoy("is empty".into()))?;
    let mut check = EnvoyCheck::default();
    if !root["dynamic_resources"].is_badvalue() {
        check.warnings.push("dynamic_resources: listeners and routes from LDS or RDS are not checked".into());
    }
    let mut managers = 0;
    for listener in list(&root["static_resources"]["listeners"]) {
        let name = listener["name"].as_str().unwrap_or("(unnamed)");
        let chains = list(&listener["filter_chains"]).into_iter().chain(Some(&listener["default_filter_chain"]));
        for chain in chains {
            for filter in list(&chain["filters"]) {
                let typed = &filter["typed_config"];
                if type_is(typed, "HttpConnectionManager") {
                    managers += 1;
                    check.manager(config, &format!("listener {name}"), typed);
                } else {
                    let what = filter["name"].as_str().unwrap_or("a network filter");
                    check
                        .warnings
                        .push(format!("listener {name}: {what} is not an HTTP connection manager: not checked"));
                }
            }
        }
    }
    if managers == 0 {
        check.refusals.push("no HTTP connection manager in static_resources.listeners".into());
    }
    Ok(check)
}

/// The processor's per-route settings at one level of the route table, as they bear on a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PerRoute {
    /// None at this level.
    Absent,
    /// The processor is off.
    Disabled,
    /// On, with overrides of its settings.
    Overridden,
    /// On, as the filter says.
    On,
}

impl EnvoyCheck {
    /// One HTTP connection manager: its ext_proc filter and what follows it, then its routes.
    fn manager(&mut self, config: &Config, at: &str, hcm: &Yaml) {
        let filters = list(&hcm["http_filters"]);
        let is_processor = |f: &&Yaml| type_is(&f["typed_config"], "ext_proc.v3.ExternalProcessor");
        let processors: Vec<&Yaml> = filters.iter().copied().filter(is_processor).collect();
        let names: Vec<&str> = match processors.as_slice() {
            [] => {
                self.refusals.push(format!("{at}: no {FILTER} filter: every write would pass unfenced"));
                return;
            }
            [filter] => {
                if self.flag(at, "the filter's disabled", &filter["disabled"]) != Some(false) {
                    self.refusals.push(format!("{at}: the {FILTER} filter is disabled"));
                }
                self.processor(config, at, &filter["typed_config"]);
                [FILTER].into_iter().chain(filter["name"].as_str()).collect()
            }
            _ => {
                self.refusals.push(format!("{at}: more than one {FILTER} filter"));
                return;
            }
        };
        let after = filters.iter().skip_while(|f| !is_processor(f)).skip(1);
        for filter in after {
            if !type_is(&filter["typed_config"], "router.v3.Router") {
                let name = filter["name"].as_str().unwrap_or("(unnamed)");
                self.refusals.push(format!(
                    "{at}: the filter {name} runs after {FILTER} and may change a write fencegate decided; put it \
                     before"
                ));
            }
        }
        for (field, what) in [("rds", "routes from RDS"), ("scoped_routes", "scoped routes")] {
            if !hcm[field].is_badvalue() {
                self.warnings.push(format!("{at}: {what} are not checked"));
            }
        }
        let table = &hcm["route_config"];
        let for_table = self.per_route(at, table, &names);
        if !table["request_mirror_policies"].is_badvalue() {
            self.refusals
                .push(format!("{at}: route_config has request_mirror_policies: Envoy would send writes twice"));
        }
        for host in list(&table["virtual_hosts"]) {
            let at = format!("{at}, virtual host {}", host["name"].as_str().unwrap_or("(unnamed)"));
            let for_host = match self.per_route(&at, host, &names) {
                PerRoute::Absent => for_table,
                level => level,
            };
            for (i, route) in list(&host["routes"]).into_iter().enumerate() {
                self.route(config, &format!("{at}, route {i}"), host, route, for_host, &names);
            }
        }
    }

    /// The ext_proc filter's settings.
    fn processor(&mut self, config: &Config, at: &str, p: &Yaml) {
        let at = format!("{at}, {FILTER}");
        for (key, _) in p.as_hash().into_iter().flatten() {
            let key = key.as_str().unwrap_or("");
            if !KNOWN_FIELDS.contains(&key) {
                self.refusals.push(format!(
                    "{at}: {key} is set, and fencegate check does not know what it does to a write: leave it out"
                ));
            }
        }
        for (field, why) in [
            ("failure_mode_allow", "a write fencegate cannot be asked about would pass unfenced"),
            ("observability_mode", "Envoy would not wait for fencegate's word"),
            ("send_body_without_waiting_for_header_response", "Envoy would send a body before its head is decided"),
        ] {
            if self.flag(&at, field, &p[field]) != Some(false) {
                self.refusals.push(format!("{at}: {field} is not false: {why}"));
            }
        }
        if self.flag(&at, "disable_immediate_response", &p["disable_immediate_response"]) == Some(true) {
            self.warnings.push(format!(
                "{at}: disable_immediate_response is true: fencegate's refusals reach clients as Envoy's 500"
            ));
        }
        let mode = &p["processing_mode"];
        for (field, why) in [
            ("request_header_mode", "a write is decided on its head"),
            ("response_header_mode", "the backend's answer ends a write's turn"),
        ] {
            if let Some(m) = self.mode(&at, field, &mode[field])
                && m != "SEND"
                && m != "DEFAULT"
            {
                self.refusals.push(format!("{at}: processing_mode.{field} must be SEND: {why}"));
            }
        }
        match self.mode(&at, "request_body_mode", &mode["request_body_mode"]).as_deref() {
            Some("STREAMED") => {}
            Some("BUFFERED") => self.warnings.push(format!(
                "{at}: processing_mode.request_body_mode BUFFERED holds whole bodies in Envoy; STREAMED does not"
            )),
            other => self.refusals.push(format!(
                "{at}: processing_mode.request_body_mode is {}: it must be STREAMED, so that fencegate sees each \
                 chunk and the request's end",
                other.unwrap_or("NONE (the default)")
            )),
        }
        let timeout = match &p["message_timeout"] {
            Yaml::BadValue => Some(Duration::from_millis(200)),
            t => t.as_str().and_then(proto_duration),
        };
        match timeout {
            Some(t) if t < config.fence.queue_timeout => self.refusals.push(format!(
                "{at}: message_timeout ({t:?}) is shorter than fence.queue_timeout ({:?}): a write waiting for its \
                 turn would fail",
                config.fence.queue_timeout
            )),
            Some(_) => {}
            None => self.refusals.push(format!("{at}: message_timeout is not a duration (\"15s\")")),
        }
        if !list(&p["response_attributes"]).iter().any(|a| a.as_str() == Some(CODE_DETAILS)) {
            self.warnings.push(format!(
                "{at}: response_attributes lacks {CODE_DETAILS}: every 502, 503 and 504 is taken for Envoy's own, and \
                 quarantines"
            ));
        }
        if self.flag(&at, "allow_mode_override", &p["allow_mode_override"]) != Some(true) {
            let why = "fencegate cannot ask for a DeleteObjects body or a multipart upload's answer whole";
            match config.backend.protocol {
                BackendProtocol::S3 => self.refusals.push(format!("{at}: allow_mode_override is not true: {why}")),
                BackendProtocol::Http => self.warnings.push(format!(
                    "{at}: allow_mode_override is not true: Envoy sends every message of an unfenced request"
                )),
            }
        }
        if self.flag(&at, "allow_content_length_header", &p["allow_content_length_header"]) != Some(true) {
            self.warnings.push(format!(
                "{at}: allow_content_length_header is not true: Envoy sends streamed bodies chunked, without the \
                 client's Content-Length"
            ));
        }
    }

    /// The processor's per-route settings in `y` (a route table, virtual host, route or
    /// weighted cluster), under any of its `names`.
    fn per_route(&mut self, at: &str, y: &Yaml, names: &[&str]) -> PerRoute {
        let per_filter = &y["typed_per_filter_config"];
        let Some(settings) = names.iter().map(|n| &per_filter[*n]).find(|s| !s.is_badvalue()) else {
            return PerRoute::Absent;
        };
        // `FilterConfig` wraps the filter's own settings, and may turn it off by itself.
        let (settings, wrapper_off) = match type_is(settings, "route.v3.FilterConfig") {
            true => (&settings["config"], self.flag(at, "FilterConfig's disabled", &settings["disabled"])),
            false => (settings, Some(false)),
        };
        match (wrapper_off, self.flag(at, "ExtProcPerRoute's disabled", &settings["disabled"])) {
            (Some(false), Some(false)) if settings["overrides"].is_badvalue() => PerRoute::On,
            (Some(false), Some(false)) => PerRoute::Overridden,
            // Off, or not certainly on.
            _ => PerRoute::Disabled,
        }
    }

    /// One route: whether the processor sees what it may carry, and whether Envoy may send a
    /// write again, twice, or changed.
    fn route(&mut self, config: &Config, at: &str, host: &Yaml, route: &Yaml, inherited: PerRoute, names: &[&str]) {
        if route["route"].is_badvalue() {
            return; // a redirect or a direct response: nothing reaches the backend
        }
        let mut levels = vec![match self.per_route(at, route, names) {
            PerRoute::Absent => inherited,
            level => level,
        }];
        for cluster in list(&route["route"]["weighted_clusters"]["clusters"]) {
            levels.push(self.per_route(at, cluster, names));
        }
        let skipped = levels.contains(&PerRoute::Disabled);
        let overridden = levels.contains(&PerRoute::Overridden);
        let methods = methods_matched(&route["match"]);
        let fenced: Vec<&Method> = match &methods {
            Some(methods) => methods.iter().filter(|m| !config.fence.unfenced_methods.contains(m)).collect(),
            None => vec![],
        };
        let carries_writes = methods.is_none() || !fenced.is_empty();
        if skipped && carries_writes {
            let what = match &methods {
                None => "any method".to_owned(),
                Some(_) => fenced.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(", "),
            };
            self.refusals.push(format!("{at}: skips {FILTER} but may carry {what}: those writes would pass unfenced"));
        }
        if skipped && !carries_writes {
            let open: Vec<&str> =
                METHOD_OVERRIDES.into_iter().filter(|name| !excludes_header(&route["match"], name)).collect();
            if !open.is_empty() {
                self.refusals.push(format!(
                    "{at}: skips {FILTER} but matches reads that claim another method ({}): fencegate fences those \
                     as the method they claim; add {{ name: <header>, present_match: true, invert_match: true }} \
                     for each",
                    open.join(", ")
                ));
            }
        }
        if skipped || !carries_writes {
            return;
        }
        if overridden {
            self.refusals.push(format!(
                "{at}: overrides {FILTER}'s settings for requests that may be writes; leave the overrides out"
            ));
        }
        for (owner, y) in [("the route", &route["route"]), ("its virtual host", host)] {
            for (field, why) in WRITE_ROUTE_REFUSED {
                if !y[field].is_badvalue() {
                    self.refusals.push(format!("{at}: {owner} has {field}: Envoy would {why}"));
                }
            }
        }
        if let Some(timeout) = route["route"]["timeout"].as_str().and_then(proto_duration) {
            let limit = config.backend.request_timeout;
            if timeout.is_zero() || timeout > limit {
                self.warnings.push(format!(
                    "{at}: the route's timeout ({timeout:?}) is not within backend.request_timeout ({limit:?}), which \
                     bounds how long a write's turn waits for the answer"
                ));
            }
        }
    }

    /// A boolean field: `None` when it is not certainly `true` or `false` (refused here: YAML
    /// readers differ on `yes`, `on` and `y`), `Some(false)` when it is absent.
    fn flag(&mut self, at: &str, field: &str, y: &Yaml) -> Option<bool> {
        match y {
            Yaml::BadValue | Yaml::Null => Some(false),
            Yaml::Boolean(b) => Some(*b),
            other => {
                self.refusals.push(format!("{at}: {field} is {other:?}: write true or false"));
                None
            }
        }
    }

    /// A processing mode's name, upper case; `None` when absent or not a name (a number is
    /// refused here: write the mode's name).
    fn mode(&mut self, at: &str, field: &str, y: &Yaml) -> Option<String> {
        match y {
            Yaml::BadValue | Yaml::Null => None,
            Yaml::String(name) => Some(name.to_ascii_uppercase()),
            other => {
                self.refusals.push(format!("{at}: processing_mode.{field} is {other:?}: write the mode's name"));
                Some("?".into())
            }
        }
    }
}

/// The methods a route's `match` admits, when a `:method` header matcher names them (an exact
/// value, or a regex that is a plain alternation of method names, matched case-sensitively);
/// `None` when it may be any.
fn methods_matched(m: &Yaml) -> Option<Vec<Method>> {
    let matcher = list(&m["headers"]).into_iter().find(|h| h["name"].as_str() == Some(":method"))?;
    let string = &matcher["string_match"];
    if matcher["invert_match"].as_bool() != Some(false) && !matcher["invert_match"].is_badvalue() {
        return None;
    }
    if !string["ignore_case"].is_badvalue() && string["ignore_case"].as_bool() != Some(false) {
        return None; // `put` is a method of its own, and fenced
    }
    let names: Vec<&str> = if let Some(exact) = string["exact"].as_str().or(matcher["exact_match"].as_str()) {
        vec![exact]
    } else {
        let regex = string["safe_regex"]["regex"].as_str().or(matcher["safe_regex_match"]["regex"].as_str())?;
        let alternation = regex.strip_prefix('^').unwrap_or(regex);
        let alternation = alternation.strip_suffix('$').unwrap_or(alternation);
        let alternation = alternation.strip_prefix('(').and_then(|a| a.strip_suffix(')')).unwrap_or(alternation);
        alternation.split('|').collect()
    };
    names
        .into_iter()
        .map(|n| n.bytes().all(|b| b.is_ascii_alphabetic()).then(|| Method::from_bytes(n.as_bytes()).ok()).flatten())
        .collect()
}

/// Whether a route's `match` admits only requests without header `name`.
fn excludes_header(m: &Yaml, name: &str) -> bool {
    list(&m["headers"]).into_iter().any(|h| {
        h["name"].as_str().is_some_and(|n| n.eq_ignore_ascii_case(name))
            && h["present_match"].as_bool() == Some(true)
            && h["invert_match"].as_bool() == Some(true)
    })
}

/// Whether a `typed_config` is of the type whose name ends with `suffix`.
fn type_is(typed: &Yaml, suffix: &str) -> bool {
    typed["@type"].as_str().is_some_and(|t| t.ends_with(suffix))
}

fn list(y: &Yaml) -> Vec<&Yaml> {
    y.as_vec().map(|v| v.iter().collect()).unwrap_or_default()
}

/// A protobuf JSON duration: seconds with an `s` (`"15s"`, `"0.2s"`).
fn proto_duration(text: &str) -> Option<Duration> {
    let seconds: f64 = text.strip_suffix('s')?.parse().ok()?;
    (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds))
}

#[cfg(test)]
#[path = "envoy_check_tests.rs"]
mod tests;
