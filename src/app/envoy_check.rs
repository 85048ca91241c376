//! What `fencegate check --envoy FILE` reads of Envoy's bootstrap (docs/envoy.md): whether the
//! Envoy that asks fencegate as its external processor could let a write past the fence, or
//! send one again or twice without asking (envoyproxy/envoy#23301: the router retries and
//! mirrors without running the filter chain again). Only what the file holds is checked:
//! listeners from LDS and routes from RDS are named as unchecked.

use std::time::Duration;

use http::Method;
use yaml_rust2::{Yaml, YamlLoader};

use super::Error;
use crate::config::{BackendProtocol, Config};

/// The filter's name, which per-route settings are keyed by.
const FILTER: &str = "envoy.filters.http.ext_proc";
/// The attribute that tells the backend's answers from Envoy's own.
const CODE_DETAILS: &str = "response.code_details";

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
        for chain in list(&listener["filter_chains"]) {
            for filter in list(&chain["filters"]) {
                let typed = &filter["typed_config"];
                if type_is(typed, "HttpConnectionManager") {
                    managers += 1;
                    check.manager(config, &format!("listener {name}"), typed);
                }
            }
        }
    }
    if managers == 0 {
        check.refusals.push("no HTTP connection manager in static_resources.listeners".into());
    }
    Ok(check)
}

impl EnvoyCheck {
    /// One HTTP connection manager: its ext_proc filter, then its routes.
    fn manager(&mut self, config: &Config, at: &str, hcm: &Yaml) {
        let processors: Vec<&Yaml> = list(&hcm["http_filters"])
            .into_iter()
            .filter(|f| type_is(&f["typed_config"], "ext_proc.v3.ExternalProcessor"))
            .collect();
        match processors.as_slice() {
            [] => self.refusals.push(format!("{at}: no {FILTER} filter: every write would pass unfenced")),
            [filter] => {
                if filter["disabled"].as_bool() == Some(true) {
                    self.refusals.push(format!("{at}: the {FILTER} filter is disabled"));
                }
                self.processor(config, at, &filter["typed_config"]);
            }
            _ => self.refusals.push(format!("{at}: more than one {FILTER} filter")),
        }
        if !hcm["rds"].is_badvalue() {
            self.warnings.push(format!("{at}: routes from RDS are not checked"));
        }
        for host in list(&hcm["route_config"]["virtual_hosts"]) {
            let at = format!("{at}, virtual host {}", host["name"].as_str().unwrap_or("(unnamed)"));
            for (i, route) in list(&host["routes"]).into_iter().enumerate() {
                self.route(config, &format!("{at}, route {i}"), host, route);
            }
        }
    }

    /// The ext_proc filter's settings.
    fn processor(&mut self, config: &Config, at: &str, p: &Yaml) {
        let at = format!("{at}, {FILTER}");
        if p["failure_mode_allow"].as_bool() == Some(true) {
            self.refusals.push(format!(
                "{at}: failure_mode_allow is true: a write fencegate cannot be asked about would pass unfenced"
            ));
        }
        if p["observability_mode"].as_bool() == Some(true) {
            self.refusals.push(format!("{at}: observability_mode is true: Envoy would not wait for fencegate's word"));
        }
        if p["send_body_without_waiting_for_header_response"].as_bool() == Some(true) {
            self.refusals.push(format!("{at}: send_body_without_waiting_for_header_response must be false"));
        }
        let mode = &p["processing_mode"];
        for (field, why) in [
            ("request_header_mode", "a write is decided on its head"),
            ("response_header_mode", "the backend's answer ends a write's turn"),
        ] {
            if mode[field].as_str().is_some_and(|m| m != "SEND" && m != "DEFAULT") {
                self.refusals.push(format!("{at}: processing_mode.{field} must be SEND: {why}"));
            }
        }
        match mode["request_body_mode"].as_str() {
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
        if p["allow_mode_override"].as_bool() != Some(true) {
            let why = "fencegate cannot ask for a DeleteObjects body or a multipart upload's answer whole";
            match config.backend.protocol {
                BackendProtocol::S3 => self.refusals.push(format!("{at}: allow_mode_override is not true: {why}")),
                BackendProtocol::Http => self.warnings.push(format!(
                    "{at}: allow_mode_override is not true: Envoy sends every message of an unfenced request"
                )),
            }
        }
        if p["allow_content_length_header"].as_bool() != Some(true) {
            self.warnings.push(format!(
                "{at}: allow_content_length_header is not true: Envoy sends streamed bodies chunked, without the \
                 client's Content-Length"
            ));
        }
    }

    /// One route: whether the processor sees what it may carry, and whether Envoy may send a
    /// write again or twice.
    fn route(&mut self, config: &Config, at: &str, host: &Yaml, route: &Yaml) {
        if route["route"].is_badvalue() {
            return; // a redirect or a direct response: nothing reaches the backend
        }
        let per_route = |y: &Yaml| -> Option<bool> {
            let settings = &y["typed_per_filter_config"][FILTER];
            (!settings.is_badvalue()).then(|| settings["disabled"].as_bool() == Some(true))
        };
        let skipped = per_route(route).or_else(|| per_route(host)).unwrap_or(false);
        let methods = methods_matched(&route["match"]);
        let fenced = match &methods {
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
        for (owner, y) in [("the route", &route["route"]), ("its virtual host", host)] {
            for policy in ["retry_policy", "hedge_policy", "request_mirror_policies"] {
                if !y[policy].is_badvalue() {
                    self.refusals.push(format!(
                        "{at}: {owner} has a {policy}: Envoy would send a write again or twice without asking fencegate"
                    ));
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
}

/// The methods a route's `match` admits, when a `:method` header matcher names them (an exact
/// value, or a regex that is a plain alternation of method names); `None` when it may be any.
fn methods_matched(m: &Yaml) -> Option<Vec<Method>> {
    let matcher = list(&m["headers"]).into_iter().find(|h| h["name"].as_str() == Some(":method"))?;
    if matcher["invert_match"].as_bool() == Some(true) {
        return None;
    }
    let string = &matcher["string_match"];
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

/// The headers by which a read claims another method, which fencegate fences as that method
/// (`request::protocol::http`'s overrides).
const METHOD_OVERRIDES: [&str; 3] = ["x-http-method-override", "x-http-method", "x-method-override"];

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
