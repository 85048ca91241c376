//! What the instances of one shared fence must agree on (docs/cluster.md: the fence's rules):
//! every setting that decides whether a write is fenced and what its token must be. Instances
//! that differ in them answer one write differently depending on which one leads, so the etcd
//! store records them with the fence and refuses an instance, or a reload, that differs.
//!
//! The record is one `name = value` line per setting, sorted, the values as JSON: readable in
//! etcd, and two records compare line by line to name what differs (the etcd store's
//! `agreement`).

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;

use super::{BackendProtocol, Config, EqualToken, FenceConfig, MissingToken, Rule};

/// The settings of `[fence]`, `[verify]` and `[s3]` that decide a write's fate.
#[derive(Serialize)]
struct Record<'a> {
    fence: Fenced<'a>,
    verify: Verified<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    s3: Option<S3Fenced<'a>>,
}

/// How a signature is read and how long past its expiry it holds.
#[derive(Serialize)]
struct Verified<'a> {
    signature_header: &'a str,
    clock_skew: String,
}

/// `[fence]` without what only bounds waiting (`queue_timeout`) and without the scopes, which
/// the keying record holds.
#[derive(Serialize)]
struct Fenced<'a> {
    header: &'a str,
    unfenced_methods: Vec<&'a str>,
    subtree_methods: Vec<&'a str>,
    equal_token: EqualToken,
    missing_token: MissingToken,
    quarantine: String,
    /// By prefix: the longest matching prefix wins, so their order in the file means nothing.
    rules: BTreeMap<&'a str, &'a Rule>,
}

/// Whether a delete is pinned, and how a request names its object: which keys are refused
/// and which hosts name buckets.
#[derive(Serialize)]
struct S3Fenced<'a> {
    conditional_deletes: bool,
    flat_keys: bool,
    virtual_host_suffixes: Vec<&'a str>,
}

impl Config {
    /// The record of this config's fence-deciding settings (see the module's docs).
    pub fn fence_record(&self) -> String {
        let fence: &FenceConfig = &self.fence;
        let record = Record {
            fence: Fenced {
                header: fence.header.as_str(),
                unfenced_methods: sorted(fence.unfenced_methods.iter().map(|m| m.as_str())),
                subtree_methods: sorted(fence.subtree_methods.iter().map(|m| m.as_str())),
                equal_token: fence.equal_token,
                missing_token: fence.missing_token,
                quarantine: humantime::format_duration(fence.quarantine).to_string(),
                rules: fence.rules.iter().map(|r| (r.prefix.as_str(), r)).collect(),
            },
            verify: Verified {
                signature_header: self.verify.signature_header.as_str(),
                clock_skew: humantime::format_duration(self.verify.clock_skew).to_string(),
            },
            s3: (self.backend.protocol == BackendProtocol::S3).then(|| S3Fenced {
                conditional_deletes: self.s3.conditional_deletes,
                flat_keys: self.s3.flat_keys,
                virtual_host_suffixes: sorted(self.s3.virtual_host_suffixes.iter().map(String::as_str)),
            }),
        };
        let mut lines = Vec::new();
        match serde_json::to_value(&record) {
            Ok(value) => flatten("", &value, &mut lines),
            // Serialising plain data cannot fail; were it to, the record names why, and no
            // instance's record equals it.
            Err(e) => lines.push(format!("unrecordable = {:?}", e.to_string())),
        }
        lines.sort();
        lines.join("\n")
    }
}

fn sorted<'a>(names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let mut names: Vec<&str> = names.collect();
    names.sort_unstable();
    names
}

/// One `name = value` line for each scalar of `value`, its name the path to it; a list of
/// scalars is one value.
fn flatten(name: &str, value: &Value, lines: &mut Vec<String>) {
    match value {
        Value::Object(fields) => {
            for (field, inner) in fields {
                let at = if name.is_empty() { field.clone() } else { format!("{name}.{field}") };
                flatten(&at, inner, lines);
            }
        }
        Value::Array(items) if items.iter().any(Value::is_object) => {
            for (i, inner) in items.iter().enumerate() {
                flatten(&format!("{name}[{i}]"), inner, lines);
            }
        }
        scalar => lines.push(format!("{name} = {scalar}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        let text = format!("[backend]\nurl = \"http://127.0.0.1:9\"\n[store]\ndir = \"/tmp/x\"\n{extra}");
        Config::from_toml_str(&text).unwrap()
    }

    #[test]
    fn the_record_names_what_decides_a_write_and_nothing_else() {
        let base = config("[[fence.rules]]\nprefix = \"/a\"\nmax_jump = 10\n[[fence.rules]]\nprefix = \"/b\"\n");
        let record = base.fence_record();
        assert!(record.contains("fence.rules./a.max_jump = 10"), "{record}");
        assert!(record.contains("fence.equal_token = \"reject\""), "{record}");
        // The order of the rules and what only bounds waiting are not the fence's.
        let same = config(
            "[fence]\nqueue_timeout = \"9s\"\n[[fence.rules]]\nprefix = \"/b\"\n[[fence.rules]]\nprefix = \"/a\"\nmax_jump = 10\n",
        );
        assert_eq!(same.fence_record(), record);
        let other =
            config("[[fence.rules]]\nprefix = \"/a\"\nmax_jump = 11\nequal_token = \"accept\"\n").fence_record();
        assert!(other.contains("fence.rules./a.max_jump = 11\n"), "{other}");
        assert!(other.contains("fence.rules./a.equal_token = \"accept\""), "{other}");
        assert!(!other.contains("fence.rules./b"), "{other}");
        let unfenced =
            config("[fence]\nunfenced_methods = [\"GET\", \"HEAD\", \"OPTIONS\", \"DELETE\"]\n").fence_record();
        assert!(unfenced.contains("fence.unfenced_methods = [\"DELETE\",\"GET\",\"HEAD\",\"OPTIONS\"]"), "{unfenced}");
    }

    /// A config whose `/a` writes are signed, with `[verify]` and the keys named by `ids`.
    fn signed(verify: &str, ids: &[&str]) -> String {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("k");
        std::fs::write(&secret, "a-secret-of-32-bytes-for-tests!!").unwrap();
        let mut text = format!("[[fence.rules]]\nprefix = \"/a\"\nverify = \"hmac\"\n[verify]\n{verify}\n");
        for id in ids {
            text.push_str(&format!(
                "[[verify.hmac_keys]]\nid = \"{id}\"\nsecret_file = {:?}\n",
                secret.display().to_string()
            ));
        }
        config(&text).fence_record()
    }

    #[test]
    fn the_record_names_how_a_signature_is_read_and_how_late_it_holds() {
        let base = signed("clock_skew = \"30s\"", &["k"]);
        assert_ne!(base, signed("clock_skew = \"1h\"", &["k"]), "how long past expiry a signature holds");
        assert_ne!(base, signed("clock_skew = \"30s\"\nsignature_header = \"x-sig\"", &["k"]), "where it is read");
    }

    #[test]
    fn the_record_names_how_s3_requests_name_their_objects() {
        let s3 = |s3: &str| {
            let text = format!(
                "[backend]\nurl = \"http://127.0.0.1:9\"\nprotocol = \"s3\"\n[store]\ndir = \"/tmp/x\"\n[s3]\n{s3}\n"
            );
            Config::from_toml_str(&text).unwrap()
        };
        let (flat, resolved) = (s3("flat_keys = true"), s3("flat_keys = false"));
        // One refuses a key with `..` segments that the other fences and sends on; the keying
        // (request::protocol::keying) names neither.
        assert_ne!(flat.fence_record(), resolved.fence_record(), "s3.flat_keys decides a write's fate");
        // One refuses a virtual-host request that the other fences and sends on.
        let hosted = s3("virtual_host_suffixes = [\"s3.example.com\"]");
        assert_ne!(flat.fence_record(), hosted.fence_record(), "s3.virtual_host_suffixes decides it too");
    }
}
