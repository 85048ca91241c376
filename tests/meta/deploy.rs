//! The deployment files in `deploy/`, the `Dockerfile` and docs/deployment.md, checked against
//! the real config loader and the real binary:
//!
//! - `systemd`: the install recipe runs as written in a temporary root (with the owners and
//!   modes it sets), `systemd-analyze verify` accepts the units, and their commands run as an
//!   unprivileged user with the identity the units give it (needs root: see [`need_root`]);
//! - `kubernetes`: the manifest's ports, probes, paths and references agree with the config it
//!   mounts, its Services and NetworkPolicy keep the backend and the admin port private, and
//!   its init step initialises a volume only when it is empty and an operator asked;
//! - `image`: the Dockerfile builds locked, runs unprivileged, and declares the config's ports
//!   and data directory.

mod image;
mod kubernetes;
mod systemd;

use std::path::{Path, PathBuf};
use std::process::Output;

/// The binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_fencegate");

/// The repository root.
pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A file of the repository, as text.
pub fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// A command's stdout and stderr, for assertion messages.
pub fn said(out: &Output) -> String {
    format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// The first fenced code block after the line holding `marker` in `text`, without its fences.
pub fn block_after(text: &str, marker: &str, file: &str) -> Vec<String> {
    let mut lines = text.lines().skip_while(|l| !l.contains(marker));
    assert!(lines.next().is_some(), "{file} has no {marker:?}");
    let mut lines = lines.skip_while(|l| !l.starts_with("```"));
    assert!(lines.next().is_some(), "{file}: no code block after {marker:?}");
    lines.take_while(|l| !l.starts_with("```")).map(str::to_owned).collect()
}

/// Whether the tests that need root should run: as root, yes; otherwise they skip, and the
/// skip is listed when the test binary exits ([`crate::skips`]), so that a run that could not
/// check the recipe says so. CI runs as root, with `FG_REQUIRE_SERVICES=1`, under which a
/// missing root fails the test instead.
pub fn need_root() -> bool {
    if rustix::process::geteuid().is_root() {
        return true;
    }
    let why = "needs root: it installs files with the recipe's owners and runs the units' commands as an \
        unprivileged uid (setpriv)";
    assert!(!crate::skips::required(), "{}=1, and this test {why}", crate::skips::REQUIRE);
    crate::skips::skip(why);
    false
}

/// A temporary directory whose path others may traverse (tempfile makes it 0700).
pub fn open_tempdir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

/// Loads a config file's text with the real loader, with `env` as the whole environment.
pub fn load_config(text: &str, env: &[(&str, &str)]) -> fencegate::Config {
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("fencegate.toml");
    std::fs::write(&path, text).unwrap();
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    fencegate::Config::load(&path, Some(env)).unwrap_or_else(|e| panic!("the config does not load: {e}"))
}

/// A shipped config's listen address, which must be an `IP:PORT`.
fn tcp(addr: &fencegate::config::ListenAddr) -> std::net::SocketAddr {
    match addr {
        fencegate::config::ListenAddr::Ip(addr) => *addr,
        other => panic!("{other}: the shipped configs listen on IP:PORT"),
    }
}
