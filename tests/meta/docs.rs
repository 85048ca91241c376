//! The documentation, checked like code: every relative link in README.md and docs/*.md
//! reaches a file (and, with `#anchor`, a heading in it); every section and key of the sample
//! config, config/fencegate.toml, is described in docs/configuration.md under its section's
//! heading; and the README stays a front door that fits on a screen.
//!
//! Plain text processing, std only: Markdown is read line by line, outside fenced code
//! blocks, and the TOML file likewise, including the example tables it keeps commented out.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Most lines the README may have.
const README_MAX_LINES: usize = 220;
/// The commands a newcomer needs, within the README's first lines.
const README_FIRST_LINES: usize = 40;
const README_COMMANDS: [&str; 2] = ["cargo run --release -- demo", "cargo test"];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// README.md and every docs/*.md, as paths relative to the repository root.
fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![PathBuf::from("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .map(|entry| entry.expect("a readable docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .map(|p| PathBuf::from("docs").join(p.file_name().expect("a file name")))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The lines of a Markdown text outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = ["```", "~~~"].into_iter().find(|m| trimmed.starts_with(m));
        match (fence, marker) {
            (None, Some(m)) => fence = Some(m),
            (Some(open), Some(m)) if open == m => fence = None,
            (None, None) => out.push((i + 1, line)),
            _ => {}
        }
    }
    out
}

/// `line` without its inline code spans, so that a `[a](b)` written as code is not a link.
fn without_code_spans(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        out.push_str(&rest[..start]);
        let ticks = rest[start..].len() - rest[start..].trim_start_matches('`').len();
        let fence = &rest[start..start + ticks];
        let after = &rest[start + ticks..];
        match after.find(fence) {
            Some(end) => rest = &after[end + ticks..],
            // An unclosed span is literal text.
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// The targets of the inline links `[text](target)` on one line.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut targets = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        // Up to the parenthesis that closes this one (targets may hold balanced parentheses).
        let mut depth = 0usize;
        let end = after.char_indices().find_map(|(i, c)| match c {
            '(' => {
                depth += 1;
                None
            }
            ')' if depth == 0 => Some(i),
            ')' => {
                depth -= 1;
                None
            }
            _ => None,
        });
        let Some(end) = end else { break };
        // `(<path with spaces>)`, or a path and perhaps a title (`(path "title")`).
        let raw = after[..end].trim();
        let target = match raw.strip_prefix('<') {
            Some(bracketed) => bracketed.split('>').next().unwrap_or(""),
            None => raw.split_whitespace().next().unwrap_or(""),
        };
        targets.push(target.to_owned());
        rest = &after[end..];
    }
    targets
}

/// GitHub's anchor for a heading's text: lower case, every character but letters, digits,
/// spaces, `-` and `_` dropped, spaces made `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The text of an ATX heading line (`## Text`), if the line is one, with its level.
fn heading(line: &str) -> Option<(usize, &str)> {
    let level = line.len() - line.trim_start_matches('#').len();
    let text = &line[level..];
    ((1..=6).contains(&level) && (text.is_empty() || text.starts_with(' ')))
        .then(|| (level, text.trim().trim_end_matches('#').trim()))
}

/// The anchors GitHub gives the headings of a Markdown text; a repeated one gets `-1`, `-2`.
fn anchors(text: &str) -> Vec<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::new();
    for (_, line) in prose_lines(text) {
        let Some((_, text)) = heading(line) else { continue };
        let base = slug(text);
        let n = seen.entry(base.clone()).or_insert(0);
        out.push(if *n == 0 { base.clone() } else { format!("{base}-{n}") });
        *n += 1;
    }
    out
}

/// Every relative link's problem in `file` (relative to the repository root), if any.
fn broken_links(file: &Path) -> Vec<String> {
    let text = read(&root().join(file));
    let dir = file.parent().unwrap_or(Path::new(""));
    let mut problems = Vec::new();
    for (number, line) in prose_lines(&text) {
        for target in link_targets(line) {
            if ["http://", "https://", "mailto:"].iter().any(|scheme| target.starts_with(scheme)) {
                continue;
            }
            let here = format!("{}:{number}: ({target})", file.display());
            let (path, anchor) = match target.split_once('#') {
                Some((path, anchor)) => (path, Some(anchor)),
                None => (target.as_str(), None),
            };
            if path.is_empty() && anchor.is_none() {
                problems.push(format!("{here}: empty link"));
                continue;
            }
            let linked = if path.is_empty() { file.to_owned() } else { dir.join(path) };
            let on_disk = root().join(&linked);
            if !on_disk.exists() {
                problems.push(format!("{here}: {} does not exist", linked.display()));
                continue;
            }
            let Some(anchor) = anchor else { continue };
            if on_disk.extension().is_none_or(|e| e != "md") {
                problems.push(format!("{here}: an anchor into a file that is not Markdown"));
            } else if !anchors(&read(&on_disk)).iter().any(|a| a == anchor) {
                problems.push(format!("{here}: no heading in {} has the anchor #{anchor}", linked.display()));
            }
        }
    }
    problems
}

#[test]
fn every_relative_link_reaches_a_file_and_a_heading() {
    let files = markdown_files();
    assert!(files.len() > 1, "no docs/*.md found");
    let problems: Vec<String> = files.iter().flat_map(|f| broken_links(f)).collect();
    assert!(problems.is_empty(), "broken links:\n{}", problems.join("\n"));
}

/// One section of a TOML file, as its header is written (`[server.tls]`, `[[fence.scopes]]`),
/// and the keys set in it, in order.
type Sections = BTreeMap<String, Vec<String>>;

/// A header line, `[name]` or `[[name]]`, as written.
fn toml_header(line: &str) -> Option<&str> {
    let line = line.trim();
    let name = line
        .strip_prefix("[[")
        .and_then(|l| l.strip_suffix("]]"))
        .or_else(|| line.strip_prefix('[').and_then(|l| l.strip_suffix(']')).filter(|n| !n.starts_with('[')))?;
    (!name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.'))
        .then_some(line)
}

/// The key of a `key = value` line, if it is one: a bare key at the start, lower-case letters,
/// digits and `_` (`h2_max_concurrent_streams`), starting with a letter.
fn toml_key(line: &str) -> Option<&str> {
    let line = line.trim_start();
    let key_len =
        line.len() - line.trim_start_matches(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_').len();
    let (key, rest) = line.split_at(key_len);
    let starts_with_letter = key.starts_with(|c: char| c.is_ascii_lowercase());
    (starts_with_letter && rest.trim_start().starts_with('=')).then_some(key)
}

/// Every section and key of a sample config, the commented-out ones too: a `# [server.tls]`
/// header starts an example table, whose `# key = value` lines are its keys until a blank or
/// uncommented line; other `# key = value` lines (`# listen = …` under `[admin]`) are keys of
/// the section they sit in. Prose comments never look like `key = value` at their start.
fn sample_config_sections(text: &str) -> Sections {
    let mut sections = Sections::new();
    let mut section = String::from("(top)");
    let mut example: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim();
        let (commented, body) = match trimmed.strip_prefix('#') {
            Some(body) => (true, body.trim()),
            None => (false, trimmed),
        };
        if trimmed.is_empty() || !commented {
            example = None;
        }
        if let Some(header) = toml_header(body) {
            sections.entry(header.to_owned()).or_default();
            if commented {
                example = Some(header.to_owned());
            } else {
                section = header.to_owned();
            }
            continue;
        }
        if let Some(key) = toml_key(body) {
            let owner = if commented { example.clone().unwrap_or_else(|| section.clone()) } else { section.clone() };
            sections.entry(owner).or_default().push(key.to_owned());
        }
    }
    sections
}

/// The text under each heading of a Markdown text, up to the next heading of the same or a
/// higher level, keyed by the heading's text.
fn heading_bodies(text: &str) -> Vec<(String, String)> {
    let lines = prose_lines(text);
    let mut out = Vec::new();
    for (i, (_, line)) in lines.iter().enumerate() {
        let Some((level, title)) = heading(line) else { continue };
        let body: Vec<&str> = lines[i + 1..]
            .iter()
            .map(|(_, l)| *l)
            .take_while(|l| heading(l).is_none_or(|(other, _)| other > level))
            .collect();
        out.push((title.to_owned(), body.join("\n")));
    }
    out
}

#[test]
fn the_sample_config_is_read_with_its_commented_examples() {
    let sample = "\
# Prose: a value = 3 is not a key, nor is Default \"x\".
[server]
listen = \"a\"
h2_streams = 1
# [server.tls]
# cert = \"c\"
# key = \"k\"

[fence]
# [[fence.scopes]]
# # Prose inside the example.
# prefix = \"/b/\"

subtree_methods = []
[admin]
# listen = \"127.0.0.1:8081\"
";
    let sections = sample_config_sections(sample);
    let expected: Sections = [
        ("[server]", vec!["listen", "h2_streams"]),
        ("[server.tls]", vec!["cert", "key"]),
        ("[fence]", vec!["subtree_methods"]),
        ("[[fence.scopes]]", vec!["prefix"]),
        ("[admin]", vec!["listen"]),
    ]
    .into_iter()
    .map(|(s, keys)| (s.to_owned(), keys.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(sections, expected);
    assert_eq!(slug("Recovering from a lost volume"), "recovering-from-a-lost-volume");
    assert_eq!(slug("`[server.tls]`: HTTPS for clients"), "servertls-https-for-clients");
    assert_eq!(slug("GET /fences/<path>"), "get-fencespath");
    assert_eq!(link_targets("see [a `b`](x.md#y) and `[c](z)` or [d](<e f.md>)"), ["x.md#y", "e f.md"]);
}

#[test]
fn every_key_of_the_sample_config_is_in_docs_configuration() {
    let sections = sample_config_sections(&read(&root().join("config/fencegate.toml")));
    let keys: usize = sections.values().map(Vec::len).sum();
    assert!(keys >= 40 && sections.len() >= 10, "read too little of the sample config: {sections:?}");
    for example in ["[server.tls]", "[backend.tls]", "[[fence.scopes]]", "[[fence.rules]]"] {
        assert!(sections.get(example).is_some_and(|k| !k.is_empty()), "{example} not read: {sections:?}");
    }
    let doc = read(&root().join("docs/configuration.md"));
    let bodies = heading_bodies(&doc);
    let mut missing = Vec::new();
    for (section, keys) in sections.iter().filter(|(s, _)| s.as_str() != "(top)") {
        let Some((_, body)) = bodies.iter().find(|(title, _)| title.contains(section.as_str())) else {
            missing.push(format!("no heading of docs/configuration.md names {section}"));
            continue;
        };
        for key in keys {
            if !body.contains(&format!("`{key}`")) {
                missing.push(format!("{section} {key}: not written as `{key}` under the heading naming {section}"));
            }
        }
    }
    assert!(missing.is_empty(), "docs/configuration.md lacks:\n{}", missing.join("\n"));
}

#[test]
fn the_readmes_step_asking_for_the_token_on_every_write_says_an_equal_one_is_refused() {
    let readme = read(&root().join("README.md"));
    let step = readme.split("4. **Clients**").nth(1).and_then(|s| s.split("5. **").next()).expect("step 4");
    let words = step.split_whitespace().collect::<Vec<_>>().join(" ");
    for needed in ["refused", "fresh token", "[[fence.rules]]", "equal_token = \"accept\""] {
        assert!(words.contains(needed), "README step 4 lacks {needed:?}: {words}");
    }
}

#[test]
fn the_readme_fits_on_a_screen_and_starts_with_the_two_commands() {
    let readme = read(&root().join("README.md"));
    let lines = readme.lines().count();
    assert!(lines <= README_MAX_LINES, "README.md has {lines} lines; at most {README_MAX_LINES}");
    let first: Vec<&str> = readme.lines().take(README_FIRST_LINES).collect();
    let first = first.join("\n");
    for command in README_COMMANDS {
        assert!(first.contains(command), "`{command}` is not within README.md's first {README_FIRST_LINES} lines");
    }
}
