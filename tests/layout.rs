//! The layout's dependency rules, read from the source: which modules each module may name.
//!
//! A request flows app → listener → request → fence → upstream → store, with admin and config
//! beside. The store knows neither HTTP nor fence policy nor config types; the fence knows no
//! HTTP; upstream knows no tokens; admin uses the fence, never the request path; config is
//! data. Each rule below is one of these sentences.

use std::path::{Path, PathBuf};

/// A module folder (or file) and what its source may name.
struct Rule {
    module: &'static str,
    /// `crate::…` paths it may use, as prefixes.
    may_use: &'static [&'static str],
    /// Crates it must not use at all.
    no_crates: &'static [&'static str],
}

const RULES: &[Rule] = &[
    Rule { module: "store", may_use: &["crate::store"], no_crates: &["http", "hyper"] },
    Rule { module: "fence", may_use: &["crate::fence", "crate::store"], no_crates: &["http", "hyper"] },
    Rule {
        module: "upstream",
        may_use: &["crate::upstream", "crate::config::BackendConfig", "crate::tls"],
        no_crates: &[],
    },
    Rule {
        module: "admin",
        may_use: &[
            "crate::admin",
            "crate::app::State",
            "crate::fence",
            "crate::request::refusal",
            "crate::upstream::backend_addr",
        ],
        no_crates: &[],
    },
    Rule {
        module: "config",
        may_use: &[
            "crate::config",
            "crate::fence::path",
            "crate::fence::keys",
            "crate::fence::{EqualToken, Scope}",
            "crate::store::SyncMode",
            "crate::tls",
        ],
        no_crates: &["hyper", "tokio"],
    },
];

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every `crate::…` path and forbidden crate `text` names, outside comments, that `rule` does not allow.
fn violations(rule: &Rule, text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or_default();
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            let named: String = rest[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || matches!(c, '_' | ':' | '{' | '}' | ',' | ' '))
                .collect();
            let named = named.trim_end_matches([' ', ',']);
            if !rule.may_use.iter().any(|allowed| named.starts_with(allowed)) {
                found.push(format!("{named}  (in: {})", line.trim()));
            }
            rest = &rest[at + "crate::".len()..];
        }
        for krate in rule.no_crates {
            // `krate::` as a path of its own, not the tail of another (`my_http::`, `x::http::`).
            let path = format!("{krate}::");
            let used = code
                .match_indices(&path)
                .any(|(at, _)| !code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == ':'));
            if used {
                found.push(format!("{krate}  (in: {})", line.trim()));
            }
        }
    }
    found
}

#[test]
fn each_module_names_only_what_the_layout_allows() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut broken = Vec::new();
    for rule in RULES {
        let root = src.join(rule.module);
        let mut files = Vec::new();
        if root.is_dir() {
            sources(&root, &mut files);
        } else {
            files.push(root.with_extension("rs"));
        }
        assert!(!files.is_empty(), "no source for module {}", rule.module);
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for v in violations(rule, &text) {
                broken.push(format!("{}: {v}", file.strip_prefix(&src).unwrap().display()));
            }
        }
    }
    assert!(broken.is_empty(), "layout rules broken:\n{}", broken.join("\n"));
}

#[test]
fn the_rules_catch_what_they_forbid() {
    let fence = &RULES[1];
    assert!(violations(fence, "use crate::fence::path;\nuse crate::store::Table;").is_empty());
    assert_eq!(violations(fence, "use crate::config::EqualToken;").len(), 1);
    assert_eq!(violations(fence, "use http::HeaderMap;").len(), 1);
    assert_eq!(violations(fence, "fn f(h: &http::HeaderMap) {}").len(), 1);
    assert!(violations(fence, "// use crate::request; is forbidden here").is_empty(), "comments are not code");
    let admin = &RULES[3];
    assert!(violations(admin, "use crate::request::refusal::{Refusal, json_response};").is_empty());
    assert_eq!(violations(admin, "use crate::request::classify;").len(), 1, "admin never uses the request path");
}
