//! `[headers]`: what fencegate adds to and takes from the headers it forwards: the backend's
//! redirects rewritten to the client-facing origin, the forwarded headers (`X-Forwarded-*`,
//! RFC 7239 `Forwarded`) and whom to believe in them, and the operator's own rules
//! (`[headers.request]`, `[headers.response]`). All of it is reloadable.

use http::header::{HeaderName, HeaderValue};
use ipnet::IpNet;
use serde::{Deserialize, Serialize, Serializer};
use std::collections::BTreeMap;

use super::ConfigError;
use super::validate::invalid;

/// What is done with one forwarded header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Forwarding {
    /// Adds this hop to what a trusted peer sent; from any other peer, what it sent is
    /// dropped first, so that a client cannot forge the hops before it.
    Append,
    /// Drops what the peer sent and sets this hop alone.
    Replace,
    /// Neither adds nor drops: the header passes as the client sent it.
    Off,
}

/// `[headers]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HeadersConfig {
    /// Rewrites a response's `Location` and `Content-Location` that name the backend's origin
    /// into the origin the client reached, as nginx's `proxy_redirect default` does.
    pub rewrite_location: bool,
    /// `X-Forwarded-For`: the peer's address.
    pub x_forwarded_for: Forwarding,
    /// `X-Forwarded-Proto`: `http` or `https`, as the client reached fencegate.
    pub x_forwarded_proto: Forwarding,
    /// `X-Forwarded-Host`: the `Host` the client sent.
    pub x_forwarded_host: Forwarding,
    /// RFC 7239 `Forwarded`: `for`, `proto` and `host` in one element per hop.
    pub forwarded: Forwarding,
    /// Peers whose forwarded headers are believed and appended to (CIDR blocks); every other
    /// peer's are dropped under `append`.
    #[serde(serialize_with = "ser_nets")]
    pub trusted_proxies: Vec<IpNet>,
    /// Rules for the request sent to the backend.
    pub request: HeaderRules,
    /// Rules for the response sent to the client.
    pub response: HeaderRules,
}

impl Default for HeadersConfig {
    fn default() -> Self {
        HeadersConfig {
            rewrite_location: true,
            x_forwarded_for: Forwarding::Append,
            x_forwarded_proto: Forwarding::Append,
            x_forwarded_host: Forwarding::Off,
            forwarded: Forwarding::Off,
            trusted_proxies: Vec::new(),
            request: HeaderRules::default(),
            response: HeaderRules::default(),
        }
    }
}

/// `[headers.request]` or `[headers.response]`: applied in this order, remove, set, add.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct HeaderRules {
    /// Headers dropped.
    #[serde(serialize_with = "ser_names")]
    pub remove: Vec<HeaderName>,
    /// Headers set, replacing any the message had.
    #[serde(serialize_with = "ser_pairs")]
    pub set: Vec<(HeaderName, HeaderValue)>,
    /// Headers added beside any the message had.
    #[serde(serialize_with = "ser_pairs")]
    pub add: Vec<(HeaderName, HeaderValue)>,
}

impl HeaderRules {
    /// Whether there is no rule.
    pub fn is_empty(&self) -> bool {
        self.remove.is_empty() && self.set.is_empty() && self.add.is_empty()
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawHeaders {
    rewrite_location: bool,
    x_forwarded_for: String,
    x_forwarded_proto: String,
    x_forwarded_host: String,
    forwarded: String,
    trusted_proxies: Vec<String>,
    request: RawRules,
    response: RawRules,
}

impl Default for RawHeaders {
    fn default() -> Self {
        RawHeaders {
            rewrite_location: true,
            x_forwarded_for: "append".into(),
            x_forwarded_proto: "append".into(),
            x_forwarded_host: "off".into(),
            forwarded: "off".into(),
            trusted_proxies: Vec::new(),
            request: RawRules::default(),
            response: RawRules::default(),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawRules {
    remove: Vec<String>,
    set: BTreeMap<String, String>,
    add: BTreeMap<String, String>,
}

/// Headers a rule may not touch, and why: those fencegate reads or sets to fence a write, the
/// message's framing and hop-by-hop headers, and those with settings of their own.
fn protected(name: &HeaderName, fenced: &[&HeaderName]) -> Option<&'static str> {
    let n = name.as_str();
    // The method overrides too: a rule that set one would turn a read fencegate let through
    // unchecked into a write at a backend that honours it.
    if fenced.contains(&name)
        || matches!(n, "destination" | "x-http-method-override" | "x-http-method" | "x-method-override")
    {
        return Some("fencegate reads it to fence a write");
    }
    if n.starts_with("fencegate-") {
        return Some("fencegate's own headers are its to set");
    }
    if matches!(n, "host" | "content-length" | "transfer-encoding") {
        return Some("it frames or addresses the message");
    }
    if matches!(n, "connection" | "keep-alive" | "te" | "trailer" | "upgrade") || n.starts_with("proxy-") {
        return Some("it is hop-by-hop");
    }
    if matches!(n, "x-forwarded-for" | "x-forwarded-proto" | "x-forwarded-host" | "forwarded") {
        return Some("it has a setting of its own in [headers]");
    }
    None
}

/// `[headers]` checked; `fenced` are the headers fencegate reads to fence a write (the token,
/// its signature), which no rule may touch.
pub(super) fn headers(raw: RawHeaders, fenced: &[&HeaderName]) -> Result<HeadersConfig, ConfigError> {
    let mode = |key: &str, value: &str| match value.to_ascii_lowercase().as_str() {
        "append" => Ok(Forwarding::Append),
        "replace" => Ok(Forwarding::Replace),
        "off" => Ok(Forwarding::Off),
        _ => Err(invalid(&format!("headers.{key}"), format!("{value:?}: expected \"append\", \"replace\" or \"off\""))),
    };
    let mut trusted_proxies = Vec::with_capacity(raw.trusted_proxies.len());
    for text in &raw.trusted_proxies {
        // A bare address is a block of one.
        let net = text
            .parse::<IpNet>()
            .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
            .map_err(|_| invalid("headers.trusted_proxies", format!("{text:?}: expected an address or CIDR block")))?;
        trusted_proxies.push(net.trunc());
    }
    Ok(HeadersConfig {
        rewrite_location: raw.rewrite_location,
        x_forwarded_for: mode("x_forwarded_for", &raw.x_forwarded_for)?,
        x_forwarded_proto: mode("x_forwarded_proto", &raw.x_forwarded_proto)?,
        x_forwarded_host: mode("x_forwarded_host", &raw.x_forwarded_host)?,
        forwarded: mode("forwarded", &raw.forwarded)?,
        trusted_proxies,
        request: rules("headers.request", raw.request, fenced)?,
        response: rules("headers.response", raw.response, fenced)?,
    })
}

fn rules(section: &str, raw: RawRules, fenced: &[&HeaderName]) -> Result<HeaderRules, ConfigError> {
    let name = |key: &str, text: &str| {
        let name = HeaderName::from_bytes(text.as_bytes())
            .map_err(|_| invalid(&format!("{section}.{key}"), format!("{text:?} is not a header name")))?;
        match protected(&name, fenced) {
            Some(why) => {
                Err(invalid(&format!("{section}.{key}"), format!("{text:?} cannot be changed by a rule: {why}")))
            }
            None => Ok(name),
        }
    };
    let pairs = |key: &str, map: BTreeMap<String, String>| {
        map.into_iter()
            .map(|(k, v)| {
                let value = HeaderValue::from_str(&v).map_err(|_| {
                    invalid(&format!("{section}.{key}"), format!("the value of {k:?} is not a header value"))
                })?;
                Ok((name(key, &k)?, value))
            })
            .collect::<Result<Vec<_>, ConfigError>>()
    };
    Ok(HeaderRules {
        remove: raw.remove.iter().map(|n| name("remove", n)).collect::<Result<_, _>>()?,
        set: pairs("set", raw.set)?,
        add: pairs("add", raw.add)?,
    })
}

fn ser_nets<S: Serializer>(nets: &[IpNet], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(nets.iter().map(|n| n.to_string()))
}

fn ser_names<S: Serializer>(names: &[HeaderName], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(names.iter().map(|n| n.as_str()))
}

fn ser_pairs<S: Serializer>(pairs: &[(HeaderName, HeaderValue)], s: S) -> Result<S::Ok, S::Error> {
    s.collect_map(pairs.iter().map(|(k, v)| (k.as_str(), String::from_utf8_lossy(v.as_bytes()))))
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn headers_fencegate_reads_or_frames_with_are_refused_to_rules() {
        for (section, name) in [
            ("request", "fencing-token"),
            ("request", "Destination"),
            ("request", "X-HTTP-Method-Override"),
            ("request", "host"),
            ("request", "content-length"),
            ("request", "connection"),
            ("request", "proxy-authorization"),
            ("request", "x-forwarded-for"),
            ("response", "fencegate-error"),
            ("response", "transfer-encoding"),
        ] {
            let text = format!(
                "[backend]\nurl = \"http://127.0.0.1:9000\"\n[store]\ndir = \"/tmp/x\"\n[headers.{section}]\nremove = [\"{name}\"]"
            );
            let err = Config::from_toml_str(&text).unwrap_err().to_string();
            assert!(err.contains(&format!("headers.{section}.remove")) && err.contains(name), "{err}");
        }
        let bad = "[backend]\nurl = \"http://127.0.0.1:9000\"\n[store]\ndir = \"/tmp/x\"\n[headers]\ntrusted_proxies = [\"10.0.0.0/33\"]";
        assert!(Config::from_toml_str(bad).unwrap_err().to_string().contains("trusted_proxies"));
    }
}
