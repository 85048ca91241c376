use super::*;
use crate::config::BackendProtocol;

/// The Envoy bootstrap docs/envoy.md shows, which the tests run Envoy on.
const SHIPPED: &str = include_str!("../../deploy/envoy/envoy.yaml");

fn config() -> Config {
    let text = "[server]\nmode = \"ext_proc\"\n[backend]\nurl = \"http://127.0.0.1:9000\"\n[store]\ndir = \"/tmp/x\"\n";
    Config::from_toml_str(text).unwrap()
}

fn checked(text: &str) -> EnvoyCheck {
    check_envoy(&config(), text).unwrap()
}

/// The shipped bootstrap with `from` replaced by `to`.
fn changed(from: &str, to: &str) -> String {
    assert!(SHIPPED.contains(from), "deploy/envoy/envoy.yaml has no {from:?}");
    SHIPPED.replacen(from, to, 1)
}

fn refused(text: &str, needle: &str) {
    let check = checked(text);
    assert!(check.refusals.iter().any(|r| r.contains(needle)), "no refusal says {needle:?}: {check:?}");
}

/// The route that carries writes, as the shipped file writes it.
const WRITE_ROUTE: &str = "route: { cluster: backend, timeout: 15s }\n          http_filters:";

#[test]
fn the_shipped_configuration_passes_without_warnings() {
    assert_eq!(checked(SHIPPED), EnvoyCheck::default());
}

#[test]
fn failing_open_or_only_watching_is_refused() {
    refused(&changed("failure_mode_allow: false", "failure_mode_allow: true"), "failure_mode_allow");
    refused(&changed("failure_mode_allow: false", "observability_mode: true"), "observability_mode");
    refused(
        &changed("allow_mode_override: true", "send_body_without_waiting_for_header_response: true"),
        "send_body_without_waiting_for_header_response",
    );
}

#[test]
fn a_processing_mode_that_hides_the_body_or_the_answer_is_refused() {
    refused(&changed("request_body_mode: STREAMED", "request_body_mode: NONE"), "request_body_mode");
    refused(&changed("request_body_mode: STREAMED", ""), "NONE (the default)");
    refused(&changed("response_header_mode: SEND", "response_header_mode: SKIP"), "response_header_mode");
    refused(&changed("request_header_mode: SEND", "request_header_mode: SKIP"), "request_header_mode");
    let buffered = checked(&changed("request_body_mode: STREAMED", "request_body_mode: BUFFERED"));
    assert!(buffered.refusals.is_empty() && buffered.warnings.iter().any(|w| w.contains("BUFFERED")), "{buffered:?}");
}

#[test]
fn a_message_timeout_shorter_than_the_queue_timeout_is_refused() {
    refused(&changed("message_timeout: 15s", "message_timeout: 2s"), "message_timeout");
    refused(&changed("message_timeout: 15s", ""), "message_timeout (200ms)");
}

#[test]
fn retries_hedges_and_mirrors_on_a_write_route_are_refused() {
    let retried = "route: { cluster: backend, timeout: 15s, retry_policy: { retry_on: 5xx, num_retries: 2 } }\n          http_filters:";
    refused(&changed(WRITE_ROUTE, retried), "retry_policy");
    let mirrored = "route: { cluster: backend, timeout: 15s, request_mirror_policies: [{ cluster: backend }] }\n          http_filters:";
    refused(&changed(WRITE_ROUTE, mirrored), "request_mirror_policies");
    let on_the_host = "domains: [\"*\"]\n              retry_policy: { retry_on: reset }";
    refused(&changed("domains: [\"*\"]", on_the_host), "its virtual host has retry_policy");
}

#[test]
fn a_route_that_skips_the_processor_while_it_may_carry_writes_is_refused() {
    refused(&changed(r#"regex: "GET|HEAD""#, r#"regex: "GET|HEAD|PUT""#), "may carry PUT");
    refused(&changed(r#"regex: "GET|HEAD""#, r#"regex: "G.T""#), "may carry any method");
    let line = "                  - { name: x-http-method, present_match: true, invert_match: true }\n";
    let overridable = checked(&changed(line, ""));
    let refusal = overridable.refusals.iter().find(|r| r.contains("claim another method")).expect("refused");
    assert!(refusal.contains("(x-http-method)"), "{refusal}");
    let inverted = r#"name: ":method", invert_match: true,"#;
    refused(&changed(r#"name: ":method","#, inverted), "may carry any method");
    // A retry on the read route is harmless: the processor never sees those requests.
    let read_retry = "route: { cluster: backend, timeout: 15s, retry_policy: { retry_on: 5xx } }\n                typed_per_filter_config:";
    let check = checked(&changed(
        "route: { cluster: backend, timeout: 15s }\n                typed_per_filter_config:",
        read_retry,
    ));
    assert!(check.refusals.is_empty(), "{check:?}");
}

#[test]
fn a_listener_without_the_processor_is_refused() {
    let start = SHIPPED.find("          - name: envoy.filters.http.ext_proc").unwrap();
    let end = SHIPPED.find("          - name: envoy.filters.http.router").unwrap();
    let without = format!("{}{}", &SHIPPED[..start], &SHIPPED[end..]);
    refused(&without, "no envoy.filters.http.ext_proc filter");
}

#[test]
fn what_only_costs_quarantines_or_chunked_bodies_is_a_warning() {
    let check = checked(&changed(r#"response_attributes: ["response.code_details"]"#, ""));
    assert!(check.refusals.is_empty(), "{check:?}");
    assert!(check.warnings.iter().any(|w| w.contains("response.code_details")), "{check:?}");
    let check = checked(&changed("allow_content_length_header: true", ""));
    assert!(check.warnings.iter().any(|w| w.contains("allow_content_length_header")), "{check:?}");
    let check = checked(&changed("allow_mode_override: true", ""));
    assert!(check.refusals.is_empty() && check.warnings.iter().any(|w| w.contains("allow_mode_override")), "{check:?}");
}

#[test]
fn in_s3_mode_the_mode_override_is_required() {
    let mut s3 = config();
    s3.backend.protocol = BackendProtocol::S3;
    let check = check_envoy(&s3, &changed("allow_mode_override: true", "")).unwrap();
    assert!(check.refusals.iter().any(|r| r.contains("allow_mode_override")), "{check:?}");
    assert_eq!(check_envoy(&s3, SHIPPED).unwrap(), EnvoyCheck::default());
}

#[test]
fn json_is_read_and_what_does_not_parse_is_an_error() {
    let json = r#"{"static_resources": {"listeners": [{"name": "l", "filter_chains": [{"filters": [{"typed_config":
        {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
         "http_filters": []}}]}]}]}}"#;
    let check = checked(json);
    assert!(check.refusals.iter().any(|r| r.contains("no envoy.filters.http.ext_proc")), "{check:?}");
    assert!(matches!(check_envoy(&config(), "a: [b"), Err(Error::Envoy(_))));
    refused("admin: {}", "no HTTP connection manager");
}

/// Configurations Envoy 1.40 loads (`envoy --mode validate`) and runs with the stale write
/// reaching the backend (tests/proxy/envoy.rs, `review`), which the check accepts.
#[test]
fn review_unsafe_configurations_are_refused() {
    const W: &str =
        "              - match: { prefix: \"/\" }\n                route: { cluster: backend, timeout: 15s }\n";
    const PR: &str = "\"@type\": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute";
    let on_writes = |key: &str, body: &str| {
        changed(W, &format!("{W}                typed_per_filter_config:\n                  {key}:\n{body}"))
    };
    let cases: Vec<(&str, String)> = vec![
        (
            "per-route overrides skip heads",
            on_writes(
                FILTER,
                &format!(
                    "                    {PR}\n                    overrides:\n                      processing_mode: {{ \
                     request_header_mode: SKIP, response_header_mode: SKIP, request_body_mode: NONE }}\n"
                ),
            ),
        ),
        (
            "per-route overrides fail open",
            on_writes(
                FILTER,
                &format!("                    {PR}\n                    overrides: {{ failure_mode_allow: true }}\n"),
            ),
        ),
        (
            "per-route disabled: yes",
            on_writes(FILTER, &format!("                    {PR}\n                    disabled: yes\n")),
        ),
        (
            "per-route under the filter's own name",
            on_writes("fencegate", &format!("                    {PR}\n                    disabled: true\n"))
                .replacen("          - name: envoy.filters.http.ext_proc\n", "          - name: fencegate\n", 1),
        ),
        (
            "FilterConfig wrapper",
            on_writes(
                FILTER,
                &format!(
                    "                    \"@type\": type.googleapis.com/envoy.config.route.v3.FilterConfig\n                    \
                     config:\n                      {PR}\n                      disabled: true\n"
                ),
            ),
        ),
        (
            "weighted cluster",
            changed(
                W,
                &format!(
                    "              - match: {{ prefix: \"/\" }}\n                route:\n                  timeout: 15s\n                  \
                     weighted_clusters:\n                    clusters:\n                    - name: backend\n                      \
                     weight: 100\n                      typed_per_filter_config:\n                        {FILTER}:\n                          \
                     {PR}\n                          disabled: true\n"
                ),
            ),
        ),
        (
            "route configuration level",
            changed(
                "          route_config:\n",
                &format!(
                    "          route_config:\n            typed_per_filter_config:\n              {FILTER}:\n                \
                     {PR}\n                disabled: true\n"
                ),
            ),
        ),
        ("failure_mode_allow: yes", changed("failure_mode_allow: false", "failure_mode_allow: yes")),
        ("request_header_mode: 2 (SKIP)", changed("request_header_mode: SEND", "request_header_mode: 2")),
        (
            "forward_rules hide the override header",
            changed(
                "failure_mode_allow: false",
                "failure_mode_allow: false\n              forward_rules: { disallowed_headers: { patterns: [ { exact: \
                 x-http-method-override } ] } }",
            ),
        ),
        (
            "an alias route rewriting the path",
            changed(
                W,
                &format!(
                    "              - match: {{ prefix: \"/alias/\" }}\n                route: {{ cluster: backend, timeout: 15s, \
                     prefix_rewrite: \"/\" }}\n{W}"
                ),
            ),
        ),
        (
            "mutation_rules drop the canonical :path",
            changed(
                "failure_mode_allow: false",
                "failure_mode_allow: false\n              mutation_rules: { disallow_system: true }",
            ),
        ),
        (
            "a filter after the processor rewrites the request",
            changed(
                "          - name: envoy.filters.http.router\n",
                "          - name: envoy.filters.http.header_mutation\n            typed_config:\n              \"@type\": \
                 type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation\n              \
                 mutations:\n                request_mutations:\n                - append: { header: { key: \
                 x-http-method-override, value: DELETE }, append_action: OVERWRITE_IF_EXISTS_OR_ADD }\n          - name: \
                 envoy.filters.http.router\n",
            ),
        ),
        (
            "a read route matching methods in any case",
            changed(r#"{ safe_regex: { regex: "GET|HEAD" } }"#, r#"{ exact: "GET", ignore_case: true }"#),
        ),
        (
            "a default filter chain without the processor",
            changed(
                "    filter_chains:\n",
                "    default_filter_chain:\n      filters:\n      - name: envoy.filters.network.http_connection_manager\n        \
                 typed_config:\n          \"@type\": type.googleapis.com/envoy.extensions.filters.network.\
                 http_connection_manager.v3.HttpConnectionManager\n          stat_prefix: other\n          http_filters: []\n    \
                 filter_chains:\n",
            ),
        ),
        (
            "a virtual host's typed retry policy",
            changed(
                W,
                &format!(
                    "{W}              retry_policy_typed_config: {{ \"@type\": type.googleapis.com/envoy.config.route.v3.RetryPolicy, retry_on: 5xx, num_retries: 3 }}\n"
                ),
            ),
        ),
    ];
    let accepted: Vec<&str> =
        cases.iter().filter(|(_, text)| checked(text).refusals.is_empty()).map(|(name, _)| *name).collect();
    assert!(accepted.is_empty(), "accepted, yet unsafe: {accepted:#?}");
}
