//! Which `FENCEGATE_*` environment variables are settings.
//!
//! A setting is `FENCEGATE_<SECTION>__<KEY>` (two underscores between the parts): an unknown
//! one is an error that names the variable. Kubernetes puts service links into every pod of a
//! namespace, `<SERVICE>_SERVICE_HOST`, `<SERVICE>_PORT_8080_TCP` and the like, so a Service
//! named `fencegate` (or `fencegate-admin`) gives every pod `FENCEGATE_…` variables that are
//! nobody's settings: those are ignored quietly. Any other `FENCEGATE_*` is ignored too, with
//! a warning that names it, so a typo like `FENCEGATE_BACKEND_URL` stays visible.

use std::collections::HashMap;

/// The prefix of every variable fencegate reads.
pub(super) const PREFIX: &str = "FENCEGATE_";

/// The `FENCEGATE_*` variables of an environment, sorted by what becomes of them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Environment {
    /// `FENCEGATE_<SECTION>__<KEY>`: settings, applied over the file.
    pub settings: HashMap<String, String>,
    /// Kubernetes service links: ignored.
    pub service_links: Vec<String>,
    /// Anything else with the prefix: ignored, but worth a warning (a typo, most likely).
    pub ignored: Vec<String>,
}

impl Environment {
    /// Sorts `vars` (the process environment when `None`).
    pub fn read(vars: Option<HashMap<String, String>>) -> Environment {
        let vars: Vec<(String, String)> = match vars {
            Some(vars) => vars.into_iter().collect(),
            // Names or values that are not UTF-8 cannot be settings; `vars_os` skips no one.
            None => std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().unwrap_or_default())))
                .collect(),
        };
        let mut env = Environment::default();
        for (name, value) in vars {
            let Some(rest) = name.strip_prefix(PREFIX) else { continue };
            if rest.contains("__") {
                env.settings.insert(name, value);
            } else if is_service_link(rest, &value) {
                env.service_links.push(name);
            } else {
                env.ignored.push(name);
            }
        }
        env.service_links.sort();
        env.ignored.sort();
        env
    }
}

/// Whether `rest` (a name after `FENCEGATE_`) and `value` have the shape of a Kubernetes
/// service link of a Service whose name starts with `fencegate`: `…SERVICE_HOST` (an address),
/// `…SERVICE_PORT` and `…SERVICE_PORT_<NAME>` (a number), `…PORT` and `…PORT_<N>_<PROTO>` (a
/// URL such as `tcp://10.0.0.1:8080`), and the latter's `_PROTO`, `_PORT` and `_ADDR`. The value
/// counts too, so that a typo such as `FENCEGATE_ADMIN_PORT=9090` is still reported.
fn is_service_link(rest: &str, value: &str) -> bool {
    let words: Vec<&str> = rest.split('_').collect();
    let protocol = |w: &str| matches!(w, "TCP" | "UDP" | "SCTP");
    let number = |w: &str| !w.is_empty() && w.bytes().all(|b| b.is_ascii_digit());
    let address = value.parse::<std::net::IpAddr>().is_ok();
    let url = ["tcp://", "udp://", "sctp://"].iter().any(|p| value.starts_with(p));
    // Every way the name can end after the service's own name.
    (0..words.len()).any(|start| match &words[start..] {
        ["SERVICE", "HOST"] => address,
        ["SERVICE", "PORT", ..] => number(value),
        ["PORT"] => url,
        ["PORT", n, p] => number(n) && protocol(p) && url,
        ["PORT", n, p, "PROTO"] => number(n) && protocol(p) && protocol(&value.to_ascii_uppercase()),
        ["PORT", n, p, "PORT"] => number(n) && protocol(p) && number(value),
        ["PORT", n, p, "ADDR"] => number(n) && protocol(p) && address,
        _ => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_service_links_and_strays_are_told_apart() {
        let vars = [
            ("FENCEGATE_BACKEND__URL", "http://127.0.0.1:9000"),
            ("FENCEGATE_SERVICE_HOST", "10.96.0.12"),
            ("FENCEGATE_SERVICE_PORT", "8080"),
            ("FENCEGATE_SERVICE_PORT_HTTP", "8080"),
            ("FENCEGATE_PORT", "tcp://10.96.0.12:8080"),
            ("FENCEGATE_PORT_8080_TCP", "tcp://10.96.0.12:8080"),
            ("FENCEGATE_PORT_8080_TCP_PROTO", "tcp"),
            ("FENCEGATE_PORT_8080_TCP_PORT", "8080"),
            ("FENCEGATE_PORT_8080_TCP_ADDR", "10.96.0.12"),
            ("FENCEGATE_ADMIN_SERVICE_HOST", "fd00::1"),
            ("FENCEGATE_ADMIN_PORT_9090_TCP_ADDR", "10.96.0.13"),
            ("FENCEGATE_BACKEND_URL", "http://127.0.0.1:9000"),
            ("FENCEGATE_ADMIN_PORT", "9090"),
            ("FENCEGATE_PORTS", "1"),
            ("FENCEGATE_PORT_X_TCP", "tcp://10.96.0.12:8080"),
            ("OTHER_VARIABLE", "1"),
        ];
        let env = Environment::read(Some(vars.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect()));
        assert_eq!(env.settings.keys().collect::<Vec<_>>(), ["FENCEGATE_BACKEND__URL"]);
        let ignored = ["FENCEGATE_ADMIN_PORT", "FENCEGATE_BACKEND_URL", "FENCEGATE_PORTS", "FENCEGATE_PORT_X_TCP"];
        assert_eq!(env.ignored, ignored, "typos stay visible, even ones shaped like a link");
        assert_eq!(env.service_links.len(), 10);
    }
}
