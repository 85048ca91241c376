//! The Dockerfile, read rather than built (no container engine in CI): a locked build, an
//! unprivileged user (the one the Kubernetes manifest runs as), and the container config's
//! ports, data directory and file.

use std::path::Path;

use super::kubernetes::Manifest;
use super::{load_config, read};

/// The Dockerfile's instructions, continuation lines joined, comments left out.
fn instructions() -> Vec<(String, String)> {
    let text = read("Dockerfile");
    let mut joined = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || (line.is_empty() && current.is_empty()) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => current.push_str(part),
            None => {
                current.push_str(line);
                joined.push(std::mem::take(&mut current));
            }
        }
    }
    joined
        .into_iter()
        .filter(|l| !l.is_empty())
        .map(|l| {
            let (op, rest) = l.split_once(' ').unwrap_or((&l, ""));
            (op.to_uppercase(), rest.trim().to_owned())
        })
        .collect()
}

/// A JSON-array argument (`["a", "b"]`) as its strings.
fn exec_form(arg: &str) -> Vec<String> {
    serde_json::from_str(arg).unwrap_or_else(|e| panic!("not the exec form: {arg}: {e}"))
}

#[test]
fn the_image_builds_locked_and_runs_unprivileged_with_the_container_config() {
    let all = instructions();
    assert!(
        all.iter().any(|(op, rest)| op == "RUN" && rest.contains("cargo build --release --locked")),
        "no `cargo build --release --locked`"
    );
    // The final stage: everything after the last FROM.
    let last = all.iter().rposition(|(op, _)| op == "FROM").expect("no FROM");
    let stage = &all[last..];
    let get = |op: &str| stage.iter().filter(|(o, _)| o == op).map(|(_, r)| r.clone()).collect::<Vec<_>>();

    let config = load_config(&read("deploy/container/fencegate.toml"), &[]);
    // With the host's network (`--network host`), an admin API on every interface would be on
    // every interface of the host: the image binds it to loopback unless asked otherwise.
    let admin = config.admin.listen.clone().expect("admin.listen");
    let loopback = matches!(admin, fencegate::config::ListenAddr::Ip(a) if a.ip().is_loopback());
    assert!(loopback, "the image's admin.listen is {admin}, not loopback");
    let user = get("USER").pop().expect("no USER: the image would run as root");
    let uid: u32 = user.split(':').next().unwrap().parse().expect("USER: a numeric uid, so runAsNonRoot can check it");
    assert_ne!(uid, 0, "USER is root");
    let manifest = Manifest::load();
    assert_eq!(manifest.pod()["securityContext"]["runAsUser"].as_i64(), Some(i64::from(uid)), "runAsUser");

    let volumes: Vec<String> = get("VOLUME").iter().flat_map(|v| exec_form(v)).collect();
    assert!(volumes.iter().any(|v| Path::new(v) == config.store.dir), "VOLUME is not store.dir: {volumes:?}");
    let exposed: Vec<u16> =
        get("EXPOSE").iter().flat_map(|e| e.split_whitespace().map(|p| p.parse().unwrap())).collect();
    for addr in [super::tcp(&config.server.listen), super::tcp(config.admin.listen.as_ref().expect("admin.listen"))] {
        assert!(exposed.contains(&addr.port()), "port {} is not EXPOSEd: {exposed:?}", addr.port());
    }

    let entrypoint = exec_form(&get("ENTRYPOINT").pop().expect("no ENTRYPOINT"));
    let cmd = exec_form(&get("CMD").pop().expect("no CMD"));
    assert_eq!(cmd[..2], ["run", "--config"]);
    let copied = get("COPY");
    let binary = copied.iter().any(|c| c.starts_with("--from=") && c.ends_with(&format!(" {}", entrypoint[0])));
    assert!(binary, "ENTRYPOINT {entrypoint:?} is not the binary copied from the build stage");
    let config_copy = copied.iter().any(|c| c == &format!("deploy/container/fencegate.toml {}", cmd[2]));
    assert!(config_copy, "CMD's config {} is not deploy/container/fencegate.toml", cmd[2]);

    // The build context: what the build needs is sent, the large and the unneeded is not.
    let ignored: Vec<String> = read(".dockerignore")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    for big in ["target", ".git"] {
        assert!(ignored.iter().any(|i| i == big), ".dockerignore does not leave out {big}");
    }
    for needed in ["src", "Cargo.toml", "Cargo.lock", "benches", "deploy"] {
        assert!(!ignored.iter().any(|i| i.trim_matches('/') == needed), ".dockerignore leaves out {needed}");
    }
}

/// The image is built with `RUN --mount=type=cache`, which needs BuildKit: the Dockerfile asks
/// for the frontend that has it, and the docs say so rather than offer the legacy builder.
/// README, docs/deployment.md and the Dockerfile tag it alike, with the crate's version.
#[test]
fn the_image_asks_for_buildkit_and_is_tagged_alike_everywhere() {
    let dockerfile = read("Dockerfile");
    assert_eq!(dockerfile.lines().next(), Some("# syntax=docker/dockerfile:1"), "the Dockerfile's first line");
    let deployment = read("docs/deployment.md");
    if dockerfile.contains("--mount=type=cache") {
        assert!(deployment.contains("BuildKit") && deployment.contains("DOCKER_BUILDKIT=1"), "docs/deployment.md");
    }
    let tag = format!("fencegate:{}", env!("CARGO_PKG_VERSION"));
    for file in ["README.md", "docs/deployment.md", "Dockerfile"] {
        let text = read(file);
        let builds: Vec<&str> = text.lines().filter(|l| l.contains(" build ") && l.contains(" -t ")).collect();
        assert!(!builds.is_empty(), "{file} shows no image build");
        for line in builds {
            let tags: Vec<&str> =
                line.split(" -t ").skip(1).filter_map(|rest| rest.split_whitespace().next()).collect();
            assert!(tags.iter().all(|t| *t == tag), "{file}: {line:?} does not tag the image {tag}");
            for (at, _) in line.match_indices("docker build ") {
                assert!(line[..at].ends_with("DOCKER_BUILDKIT=1 "), "{file}: the legacy builder: {line:?}");
            }
        }
    }
}
