//! The layout's dependency rules, read from the source: which modules each module may name.
//!
//! A request flows app → listener → request → fence → upstream → store, with admin and config
//! beside. The store knows neither HTTP nor fence policy nor config types; the fence knows no
//! HTTP; upstream and the etcd client know no tokens; admin uses the fence, never the request
//! path; config is data. Each rule below is one of these sentences. Paths are resolved before they are judged
//! (`super::` and `self::` from the file's own module), string literals and comments are
//! ignored, and nothing in `src/` may reach the crate through its own name (`fencegate::`).

use std::path::{Path, PathBuf};

/// A module folder and what its source may name.
struct Rule {
    module: &'static str,
    /// `crate::…` paths it may use: each one and everything below it.
    may_use: &'static [&'static str],
    /// Crates it must not use at all.
    no_crates: &'static [&'static str],
}

const HTTP: &[&str] = &["http", "hyper", "hyper_util", "http_body_util", "h2"];

const RULES: &[Rule] = &[
    // The etcd store speaks etcd's key-value API through the etcd client, which keeps HTTP
    // to itself.
    Rule { module: "store", may_use: &["crate::store", "crate::etcd_client"], no_crates: HTTP },
    Rule { module: "fence", may_use: &["crate::fence", "crate::store"], no_crates: HTTP },
    Rule {
        module: "upstream",
        // The store's permit to send a write: whether the write may still go, not its token.
        may_use: &[
            "crate::upstream",
            "crate::config::BackendConfig",
            "crate::config::BackendUrl",
            // `[headers]`: data, made into the upstream's header policy.
            "crate::config::Forwarding",
            "crate::config::HeaderRules",
            "crate::config::HeadersConfig",
            "crate::store::Permit",
            // The fail points of the `failpoints` feature, one helper for every module.
            "crate::store::failpoint",
            "crate::tls",
        ],
        no_crates: &[],
    },
    Rule {
        module: "admin",
        may_use: &[
            "crate::admin",
            // Which protocol names the keys an operator's path names: data.
            "crate::config::BackendProtocol",
            "crate::etcd_client",
            "crate::state",
            "crate::fence",
            "crate::listener",
            "crate::logging::dropped_lines",
            "crate::refusal",
            "crate::store::Condition",
            "crate::store::Role",
            "crate::store::StoreError",
            "crate::upstream::reachable",
            // A follower's readiness: whether the leader takes a connection.
            "crate::upstream::leader_reachable",
        ],
        no_crates: &[],
    },
    Rule {
        module: "config",
        may_use: &[
            "crate::config",
            // The etcd client's options, which `EtcdConfig::client_options` fills in: data.
            "crate::etcd_client::ClientOptions",
            "crate::etcd_client::Credentials",
            "crate::etcd_client::Password",
            "crate::etcd_client::TlsOptions",
            "crate::fence::path",
            "crate::fence::keys",
            "crate::fence::lock_names",
            "crate::fence::EqualToken",
            "crate::fence::Scope",
            "crate::fence::DEFAULT_DOMAIN",
            "crate::fence::signature",
            "crate::store::SyncMode",
            "crate::store::WriterScheduling",
            "crate::store::etcd::DEFAULT_MAX_TXN_OPS",
            "crate::store::etcd::DEFAULT_BATCHES_IN_FLIGHT",
            "crate::tls",
        ],
        no_crates: &["hyper", "tokio"],
    },
    // The etcd client knows etcd, HTTP and TLS, nothing of fences, tokens or config.
    Rule { module: "etcd_client", may_use: &["crate::etcd_client", "crate::tls"], no_crates: &[] },
    Rule { module: "tls", may_use: &["crate::tls"], no_crates: &[] },
    Rule {
        module: "logging",
        may_use: &["crate::logging", "crate::config::AccessFormat", "crate::config::LogFormat"],
        no_crates: &[],
    },
    // Every answer fencegate makes itself, from the errors of the modules below it.
    Rule {
        module: "refusal",
        may_use: &[
            "crate::refusal",
            "crate::fence",
            "crate::store::StoreError",
            "crate::upstream::Peer",
            "crate::upstream::UpstreamError",
        ],
        no_crates: &[],
    },
    // What listeners, requests and the admin API share, below all three.
    Rule {
        module: "state",
        may_use: &[
            "crate::state",
            "crate::config",
            "crate::etcd_client::Mirrors",
            "crate::fence",
            "crate::refusal::throttle",
            "crate::store::Store",
            "crate::tls",
            "crate::upstream",
        ],
        no_crates: &[],
    },
    // Connections, whatever they serve: no request path, no fence.
    Rule { module: "listener", may_use: &["crate::listener", "crate::state"], no_crates: &[] },
    Rule {
        module: "request",
        may_use: &[
            "crate::request",
            "crate::config",
            "crate::etcd_client",
            "crate::fence",
            "crate::logging::access",
            "crate::logging::access_enabled",
            "crate::refusal",
            "crate::state",
            "crate::store",
            "crate::upstream",
        ],
        no_crates: &[],
    },
    // The application wires everything but the demo, which runs it.
    Rule {
        module: "app",
        may_use: &[
            "crate::app",
            "crate::admin",
            "crate::config",
            "crate::etcd_client",
            "crate::fence",
            "crate::listener",
            "crate::logging",
            "crate::refusal",
            "crate::request",
            "crate::state",
            "crate::store",
            "crate::tls",
            "crate::upstream",
        ],
        no_crates: &[],
    },
    Rule { module: "demo", may_use: &["crate::demo", "crate::app", "crate::config"], no_crates: &[] },
    Rule {
        module: "fuzzing",
        may_use: &["crate::fuzzing", "crate::config", "crate::fence", "crate::store"],
        no_crates: &[],
    },
];

/// The source files of a top-level module: its folder, or its one file.
fn module_files(src: &Path, module: &str) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let dir = src.join(module);
    if dir.is_dir() {
        sources(&dir, &mut files);
    } else if src.join(format!("{module}.rs")).is_file() {
        files.push(src.join(format!("{module}.rs")));
    }
    files
}

/// The top-level modules of `src`: its folders and files, but the crate roots.
fn top_level_modules(src: &Path) -> Vec<String> {
    let mut modules: Vec<String> = std::fs::read_dir(src)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|p| match p.is_dir() {
            true => Some(p.file_name()?.to_string_lossy().into_owned()),
            false => Some(p.file_stem()?.to_string_lossy().into_owned()).filter(|s| s != "lib" && s != "main"),
        })
        .collect();
    modules.sort();
    modules.dedup();
    modules
}

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

/// The module a source file holds, as a path: `src/fence/turn.rs` is `crate::fence::turn`,
/// `src/fence/mod.rs` is `crate::fence`.
fn module_of(file: &Path, src: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut path = vec!["crate".to_owned()];
    path.extend(rel.iter().map(|p| p.to_string_lossy().into_owned()));
    if path.last().is_some_and(|l| l == "mod" || l == "lib") {
        path.pop();
    }
    path
}

/// The text of `source` without comments and with every string literal emptied, as one line
/// per source line.
fn code_only(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut chars = source.chars().peekable();
    let (mut in_string, mut in_block) = (false, 0);
    while let Some(c) = chars.next() {
        match c {
            '\n' => {
                out.push('\n');
                continue;
            }
            _ if in_block > 0 => {
                if c == '*' && chars.peek() == Some(&'/') {
                    chars.next();
                    in_block -= 1;
                }
            }
            '\\' if in_string => {
                chars.next();
            }
            '"' => {
                in_string = !in_string;
                out.push('"');
            }
            _ if in_string => {}
            '/' if chars.peek() == Some(&'/') => {
                while chars.peek().is_some_and(|&c| c != '\n') {
                    chars.next();
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                in_block += 1;
            }
            // A char literal that is a quote would otherwise open a string.
            '\'' if chars.peek() == Some(&'"') => {
                chars.next();
                out.push_str("'x");
            }
            _ => out.push(c),
        }
    }
    out
}

/// The module each line of `code` (the file at module `here`) is in: inline `mod name { … }`
/// blocks nest below the file's own, so that their `super::` resolves as the compiler does.
fn line_modules(code: &str, here: &[String]) -> Vec<Vec<String>> {
    let (mut depth, mut open): (usize, Vec<(String, usize)>) = (0, Vec::new());
    let mut modules = Vec::new();
    for line in code.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        let at_mod = words.iter().position(|w| *w == "mod");
        let mut module: Vec<String> = here.to_vec();
        module.extend(open.iter().map(|(name, _)| name.clone()));
        if let Some(name) = at_mod.and_then(|i| words.get(i + 1)).filter(|_| line.trim_end().ends_with('{')) {
            open.push((name.trim_end_matches('{').to_owned(), depth + 1));
            module.push(name.trim_end_matches('{').to_owned());
        }
        modules.push(module);
        for c in line.chars() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth = depth.saturating_sub(1);
                    if open.last().is_some_and(|(_, at)| depth < *at) {
                        open.pop();
                    }
                }
                _ => {}
            }
        }
    }
    modules
}

/// Every path `code` names that starts at `crate`, `super`, `self` or one of `crates`, resolved
/// against the module each line is in (the file's module `here`, or an inline one within it):
/// `(resolved path, the line it is on)`.
fn paths(code: &str, file_module: &[String], crates: &[&str]) -> Vec<(String, usize)> {
    let mut found = Vec::new();
    let is_ident = |c: char| c.is_alphanumeric() || c == '_';
    let modules = line_modules(code, file_module);
    for (number, line) in code.lines().enumerate() {
        let here = modules[number].as_slice();
        let mut at = 0;
        while at < line.len() {
            let rest = &line[at..];
            // A path's first segment: not the tail of another path (`x::http`), though a
            // leading `::` (`::http::X`) still starts one.
            let before = &line[..at];
            let start_ok = match before.strip_suffix("::") {
                Some(head) => !head.ends_with(|c: char| is_ident(c) || c == '>' || c == ':'),
                None => !before.ends_with(|c: char| is_ident(c) || c == ':'),
            };
            let word: String = rest.chars().take_while(|&c| is_ident(c)).collect();
            if word.is_empty() {
                at += rest.chars().next().map_or(1, char::len_utf8);
                continue;
            }
            let after = &rest[word.len()..];
            let names_path = after.starts_with("::")
                || (crates.contains(&word.as_str()) && (after.starts_with(" as ") || after.starts_with(';')));
            let root =
                matches!(word.as_str(), "crate" | "super" | "self" | "fencegate") || crates.contains(&word.as_str());
            if start_ok && names_path && root {
                // Read the whole path, through `::` and one level of `{…}` lists.
                let mut segments: Vec<String> = Vec::new();
                let mut tail = rest;
                loop {
                    let seg: String = tail.chars().take_while(|&c| is_ident(c)).collect();
                    if seg.is_empty() {
                        if let Some(list) = tail.strip_prefix('{') {
                            let inner: String = list.chars().take_while(|&c| c != '}').collect();
                            for item in inner.split(',') {
                                let item = item.trim().split("::").next().unwrap_or_default().trim();
                                if !item.is_empty() && item != "self" {
                                    segments.push(item.to_owned());
                                    found.push((resolve(&segments, here), number + 1));
                                    segments.pop();
                                }
                            }
                        }
                        break;
                    }
                    tail = &tail[seg.len()..];
                    segments.push(seg);
                    match tail.strip_prefix("::") {
                        Some(t) => tail = t,
                        None => break,
                    }
                }
                if !segments.is_empty() {
                    found.push((resolve(&segments, here), number + 1));
                }
                at += rest.len() - tail.len().min(rest.len()) + word.len().min(1);
                continue;
            }
            at += word.len();
        }
    }
    found
}

/// `super::x` and `self::x` made absolute from the module `here`.
fn resolve(segments: &[String], here: &[String]) -> String {
    let mut base: Vec<String> = match segments.first().map(String::as_str) {
        Some("super" | "self") => here.to_vec(),
        _ => return segments.join("::"),
    };
    let mut rest = segments;
    while let Some(first) = rest.first() {
        match first.as_str() {
            "super" => {
                base.pop();
            }
            "self" => {}
            _ => break,
        }
        rest = &rest[1..];
    }
    base.extend(rest.iter().cloned());
    base.join("::")
}

/// Whether `path` is `allowed` or lies below it (whole segments only).
fn within(path: &str, allowed: &str) -> bool {
    path == allowed || path.strip_prefix(allowed).is_some_and(|rest| rest.starts_with("::"))
}

/// What `source`, the file at module `here`, names that `rule` does not allow.
fn violations(rule: &Rule, source: &str, here: &[String]) -> Vec<String> {
    let code = code_only(source);
    let mut found = Vec::new();
    for (path, line) in paths(&code, here, rule.no_crates) {
        let root = path.split("::").next().unwrap_or_default();
        let broken = match root {
            "crate" => {
                // A path that starts inside the module itself (or one of the allowed ones) and
                // names something allowed, or a parent of an allowed path (`crate::fence` for
                // `use crate::fence::{…}`), is fine.
                !rule.may_use.iter().any(|a| within(&path, a) || within(a, &path))
            }
            "fencegate" => true,
            krate => rule.no_crates.contains(&krate),
        };
        if broken {
            found.push(format!("line {line}: {path}"));
        }
    }
    found
}

#[test]
fn each_module_names_only_what_the_layout_allows() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut broken = Vec::new();
    for rule in RULES {
        let files = module_files(&src, rule.module);
        assert!(!files.is_empty(), "no source for module {}", rule.module);
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for v in violations(rule, &text, &module_of(&file, &src)) {
                broken.push(format!("{}: {v}", file.strip_prefix(&src).unwrap().display()));
            }
        }
    }
    assert!(broken.is_empty(), "layout rules broken:\n{}", broken.join("\n"));
}

#[test]
fn the_rules_catch_what_they_forbid() {
    let at = |m: &str| m.split("::").map(str::to_owned).collect::<Vec<_>>();
    let (fence, admin) = (&RULES[1], &RULES[3]);
    let turn = at("crate::fence::turn");
    let count = |rule: &Rule, text: &str| violations(rule, text, &turn).len();
    assert_eq!(count(fence, "use crate::fence::path;\nuse crate::store::Table;\nuse super::Fence;"), 0);
    assert_eq!(count(fence, "use crate::config::EqualToken;"), 1);
    assert_eq!(count(fence, "use super::super::config::EqualToken;"), 1, "relative paths are resolved");
    assert_eq!(count(fence, "use crate::storex::Table;"), 1, "whole segments only");
    let nested = "fn f() {}\n#[cfg(test)]\nmod tests {\n    use super::super::path;\n    use super::super::super::config::X;\n}\nuse super::Fence;";
    assert_eq!(count(fence, nested), 1, "an inline module's super is its file's module");
    for http in ["use http::HeaderMap;", "fn f(h: &http::HeaderMap) {}", "use ::http::HeaderMap;", "use http as h;"] {
        assert_eq!(count(fence, http), 1, "{http}");
    }
    assert_eq!(count(fence, "use hyper_util::rt::TokioIo;"), 1);
    assert_eq!(count(fence, "use fencegate::request::Refusal;"), 1, "not even through the crate's own name");
    assert_eq!(count(fence, "// use crate::request; is forbidden here"), 0, "comments are not code");
    assert_eq!(count(fence, "let url = \"http://x\"; use crate::request::Refusal;"), 1, "a string is not a comment");
    assert_eq!(count(fence, "let s = \"crate::request::Refusal\";"), 0, "nor code");
    assert_eq!(count(fence, "struct Myhttp; fn f() -> my_http::X {}"), 0);
    let fences = at("crate::admin::fences");
    assert!(violations(admin, "use crate::refusal::{Refusal, json_response};", &fences).is_empty());
    assert!(violations(admin, "use crate::fence::{Raised, keys, path};", &fences).is_empty());
    assert_eq!(violations(admin, "use crate::request::classify;", &fences).len(), 1, "never the request path");
    assert_eq!(violations(admin, "use crate::request::{classify, verify};", &fences).len(), 3, "and their parent");
}

#[test]
fn every_top_level_module_has_a_rule() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let ruled: Vec<&str> = RULES.iter().map(|r| r.module).collect();
    let missing: Vec<String> = top_level_modules(&src).into_iter().filter(|m| !ruled.contains(&m.as_str())).collect();
    assert!(missing.is_empty(), "top-level modules without a layout rule: {missing:?}");
}

/// Which top-level modules each one names, read from its source.
fn module_graph(src: &Path) -> Vec<(String, Vec<String>)> {
    top_level_modules(src)
        .into_iter()
        .map(|module| {
            let mut uses: Vec<String> = Vec::new();
            for file in module_files(src, &module) {
                let code = code_only(&std::fs::read_to_string(&file).unwrap());
                for (path, _) in paths(&code, &module_of(&file, src), &[]) {
                    let mut segments = path.split("::");
                    if segments.next() != Some("crate") {
                        continue;
                    }
                    if let Some(top) = segments.next().filter(|t| *t != module) {
                        uses.push(top.to_owned());
                    }
                }
            }
            uses.sort();
            uses.dedup();
            (module, uses)
        })
        .collect()
}

/// A cycle in `graph`, as the modules along it, if there is one.
fn cycle(graph: &[(String, Vec<String>)]) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &[(String, Vec<String>)],
        path: &mut Vec<String>,
        done: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|m| m == node) {
            let mut found = path[at..].to_vec();
            found.push(node.to_owned());
            return Some(found);
        }
        if done.iter().any(|m| m == node) {
            return None;
        }
        path.push(node.to_owned());
        let next = graph.iter().find(|(m, _)| m == node).map(|(_, uses)| uses.as_slice()).unwrap_or_default();
        for used in next {
            if let Some(found) = visit(used, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.push(node.to_owned());
        None
    }
    let (mut path, mut done) = (Vec::new(), Vec::new());
    graph.iter().find_map(|(module, _)| visit(module, graph, &mut path, &mut done))
}

#[test]
fn the_top_level_modules_form_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = module_graph(&src);
    assert!(graph.iter().any(|(m, uses)| m == "app" && uses.contains(&"request".to_owned())), "{graph:?}");
    if let Some(found) = cycle(&graph) {
        panic!("the top-level modules form a cycle: {}", found.join(" -> "));
    }
}

#[test]
fn a_cycle_is_found_and_named() {
    let graph = |edges: &[(&str, &[&str])]| -> Vec<(String, Vec<String>)> {
        edges.iter().map(|(m, uses)| (m.to_string(), uses.iter().map(|u| u.to_string()).collect())).collect()
    };
    assert_eq!(cycle(&graph(&[("app", &["request", "store"]), ("request", &["store"]), ("store", &[])])), None);
    let found = cycle(&graph(&[("app", &["request"]), ("request", &["admin"]), ("admin", &["request"])]));
    assert_eq!(found.unwrap(), ["request", "admin", "request"]);
}

/// Every mention of the `unsafe_code` lint in the source: denied at both crate roots, allowed
/// in one module only (`sys`, the writer thread's scheduling calls). Anything else (another
/// `allow`, an `expect`, a lint list) would have to be written here too.
const UNSAFE_LINT: &[(&str, &str)] = &[
    ("lib.rs", "#![deny(unsafe_code)]"),
    ("main.rs", "#![deny(unsafe_code)]"),
    ("store/scheduling.rs", "#[allow(unsafe_code)]"),
];

#[test]
fn unsafe_code_is_denied_but_in_the_one_module_that_makes_system_calls() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut found = Vec::new();
    for file in files {
        let code = code_only(&std::fs::read_to_string(&file).unwrap());
        let name = file.strip_prefix(&src).unwrap().display().to_string();
        for (at, _) in code.match_indices("unsafe_code") {
            // The attribute around the mention: from its `#` to its `]`.
            let start = code[..at].rfind('#').unwrap_or(at);
            let end = code[at..].find(']').map_or(code.len(), |e| at + e + 1);
            found.push((name.clone(), code[start..end].to_owned()));
        }
    }
    found.sort();
    let mut want: Vec<(String, String)> = UNSAFE_LINT.iter().map(|(f, a)| (f.to_string(), a.to_string())).collect();
    want.sort();
    assert_eq!(found, want, "the unsafe_code lint, where it is mentioned");
}

/// What only the protocol seam (`src/request/protocol/`) may do within the request path: name
/// resources (canonical paths, scopes, WebDAV's `Destination`) and write refusals for the
/// client. The rest of the request path is the same for every protocol, and reaches a protocol
/// only through the seam's trait, never through one implementation.
const PROTOCOL_ONLY: &[&str] = &[
    "crate::fence::path",
    "crate::fence::keys",
    "crate::fence::Scope",
    "crate::request::protocol::http",
    "crate::refusal::json_response",
];

/// Method calls that write a refusal in one protocol's form.
const PROTOCOL_ONLY_CALLS: &[&str] = &[".response()", ".response_withholding_levels()"];

/// What `source`, a file of the request path outside the seam, does that only the seam may.
/// Its inline `mod tests` may: a test of the rules classifies with a real protocol.
fn seam_violations(source: &str, here: &[String]) -> Vec<String> {
    let code = code_only(source);
    let modules = line_modules(&code, here);
    let in_tests = |line: usize| modules[line - 1].iter().any(|m| m == "tests");
    let mut found: Vec<String> = paths(&code, here, &[])
        .into_iter()
        .filter(|(path, line)| !in_tests(*line) && PROTOCOL_ONLY.iter().any(|p| within(path, p)))
        .map(|(path, line)| format!("line {line}: {path}"))
        .collect();
    for (number, line) in code.lines().enumerate().filter(|(n, _)| !in_tests(n + 1)) {
        for call in PROTOCOL_ONLY_CALLS.iter().filter(|c| line.contains(*c)) {
            found.push(format!("line {}: {call}", number + 1));
        }
    }
    found
}

#[test]
fn what_is_protocol_specific_sits_behind_the_seam() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let seam = src.join("request").join("protocol");
    let mut broken = Vec::new();
    for file in module_files(&src, "request").into_iter().filter(|f| !f.starts_with(&seam)) {
        let text = std::fs::read_to_string(&file).unwrap();
        for v in seam_violations(&text, &module_of(&file, &src)) {
            broken.push(format!("{}: {v}", file.strip_prefix(&src).unwrap().display()));
        }
    }
    assert!(broken.is_empty(), "protocol-specific code outside src/request/protocol/:\n{}", broken.join("\n"));
    let at = |m: &str| m.split("::").map(str::to_owned).collect::<Vec<_>>();
    let here = at("crate::request::fenced");
    assert_eq!(seam_violations("use crate::fence::path;\nlet r = refusal.response();", &here).len(), 2);
    assert_eq!(seam_violations("use super::protocol::http::DESTINATION;", &here).len(), 1);
    assert_eq!(seam_violations("use crate::fence::Scope;", &here).len(), 1, "a re-export of keys");
    let tests = "fn f() {}\n#[cfg(test)]\nmod tests {\n    use super::super::protocol::http::classify;\n}";
    assert_eq!(seam_violations(tests, &here).len(), 0, "tests may classify with a real protocol");
    assert_eq!(seam_violations("use crate::fence::{Touch, Policy};\nlet p = protocol.refuse(&r, w);", &here).len(), 0);
}
