//! The systemd recipe (docs/deployment.md, and its copy in deploy/fencegate.service), run line
//! by line in a temporary root `R` that stands for `/`:
//!
//! - `groupadd --system G` gives `G` a test gid;
//! - `install ...` runs as written, as root, with absolute paths under `R`, `G` as its gid and
//!   `target/release/fencegate` as the binary under test: the owners and modes are the recipe's;
//! - `systemctl daemon-reload` runs `systemd-analyze verify --root=R` on the installed units;
//! - `systemctl start U` and `systemctl enable --now U` run `U`'s commands as systemd would
//!   start them: `StateDirectory=` made with its mode for the unit's user, the `Environment=`,
//!   and `setpriv` with the unit's identity (`DynamicUser=` a uid of its own,
//!   `SupplementaryGroups=`, no other groups, no new privileges).
//!
//! A line the test does not know fails it, so the recipe cannot grow an unchecked step. What is
//! not mirrored: the mount namespace (`ProtectSystem=` and friends) and the system call filter.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use super::{BIN, block_after, need_root, open_tempdir, read, repo, said};

const MARKER: &str = "<!-- systemd recipe: tests/meta/deploy.rs runs these lines -->";
/// A uid in systemd's range for dynamic users (61184–65519); its gid is the same number.
const DYNAMIC_UID: u32 = 61999;
/// Gids for the groups the recipe creates.
const FIRST_GID: u32 = 61900;
/// The admin write token the test gives the service (`FENCEGATE_ADMIN__TOKEN`).
const ADMIN_TOKEN: &str = "a-test-admin-token-0123456789";

/// The recipe's commands: the block after [`MARKER`] in docs/deployment.md, comments and blank
/// lines left out.
fn recipe() -> Vec<String> {
    let block = block_after(&read("docs/deployment.md"), MARKER, "docs/deployment.md");
    block.into_iter().map(|l| l.trim().to_owned()).filter(|l| !l.is_empty() && !l.starts_with('#')).collect()
}

#[test]
fn the_unit_carries_the_same_recipe_as_the_docs() {
    let unit = read("deploy/fencegate.service");
    let copy: Vec<String> = unit.lines().filter_map(|l| l.strip_prefix("#   ")).map(|l| l.trim().to_owned()).collect();
    assert_eq!(copy, recipe(), "deploy/fencegate.service's recipe differs from docs/deployment.md's");
}

#[test]
fn every_documentation_link_is_a_file_the_recipe_installs_or_a_web_page() {
    let installed: Vec<String> = recipe()
        .iter()
        .filter_map(|l| l.strip_prefix("install "))
        .flat_map(|args| {
            let args: Vec<&str> = args.split_whitespace().collect();
            match args.iter().position(|a| *a == "-t") {
                // install -t DIR SOURCES...: each source lands in DIR under its own name.
                Some(t) => {
                    let dir = args[t + 1];
                    let sources = args[t + 2..].iter().filter(|a| !a.starts_with('-'));
                    sources.map(|s| format!("{dir}/{}", Path::new(s).file_name().unwrap().to_str().unwrap())).collect()
                }
                None => vec![args.last().unwrap().to_string()],
            }
        })
        .collect();
    for file in ["deploy/fencegate.service", "deploy/fencegate-init@.service"] {
        let unit = Unit::parse(&read(file));
        let documentation = unit.all("Unit", "Documentation");
        let links: Vec<&str> = documentation.iter().flat_map(|v| v.split_whitespace()).collect();
        assert!(!links.is_empty(), "{file}: no Documentation=");
        for link in links {
            if let Some(path) = link.strip_prefix("file://") {
                assert!(
                    installed.iter().any(|i| i == path),
                    "{file}: {link} is not installed by the recipe: {installed:?}"
                );
            } else {
                assert!(link.starts_with("https://") || link.starts_with("man:"), "{file}: {link}");
            }
        }
    }
}

#[test]
fn the_recipe_installs_a_service_that_runs_as_its_dynamic_user() {
    if !need_root() {
        return;
    }
    let mut host = Host::new();
    let mut service = None;
    for line in recipe() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["groupadd", "--system", group] => host.groupadd(group),
            ["install", args @ ..] => host.install(args),
            ["systemctl", "daemon-reload"] => host.verify_units(),
            ["systemctl", "start", unit] => host.start_oneshot(unit),
            ["systemctl", "enable", "--now", unit] => {
                assert!(!host.unit(unit).0.all("Install", "WantedBy").is_empty(), "{unit} cannot be enabled");
                service = Some((unit.to_string(), host.start_service(unit)));
            }
            _ => panic!("tests/meta/deploy.rs does not know this recipe step: {line}"),
        }
    }
    let (name, mut running) = service.expect("the recipe starts no service");
    let (unit, _) = host.unit(&name);
    let data = host.state_dir(&unit).expect("the service has no StateDirectory=");

    // The service reads its config through the group, writes its state, and reloads.
    assert_eq!(http(running.admin, "GET", "/healthz", "").0, 200);
    let (status, answer) = http(running.admin, "POST", "/fences/accounts/42:advance", r#"{"to": 7}"#);
    assert_eq!(status, 200, "the service's user cannot advance a fence in {}: {answer}", data.display());
    for reload in unit.all("Service", "ExecReload") {
        let out = host.exec(&unit, &reload, None, Some(running.child.id())).output().unwrap();
        assert!(out.status.success(), "ExecReload={reload}: {}", said(&out));
    }
    running.wait_for("configuration reloaded");
    let status = running.stop();
    assert!(status.success(), "{name} did not stop cleanly on SIGTERM: {status}");
    let exe = unit.all("Service", "ExecStart").remove(0).split_whitespace().next().unwrap().to_owned();
    let state = unit.one("StateDirectory").unwrap();
    let inspect = format!("{exe} inspect --dir /var/lib/{state} /accounts/42");
    let out = host.exec(&unit, &inspect, None, None).output().unwrap();
    assert!(said(&out).contains("/accounts/42 max_seen=7"), "{inspect}: {}", said(&out));

    // Without the group the config is unreadable, and `check` says so.
    let check = unit.all("Service", "ExecStartPre").into_iter().find(|c| c.contains(" check ")).expect("no check");
    let out = host.exec_as(&unit, &check, None, None, &[]).output().unwrap();
    assert!(!out.status.success() && said(&out).contains("Permission denied"), "{check}: {}", said(&out));

    // Starting the init unit again changes nothing: the directory holds state.
    let init = host.exec_start_of("fencegate-init@0.service");
    let out = host.exec(&init.0, &init.1, init.2.as_deref(), None).output().unwrap();
    assert!(!out.status.success() && said(&out).contains("already"), "init ran again: {}", said(&out));

    // A lost data directory: systemd makes an empty one on the next start. The service refuses
    // it, says what to run, and leaves it empty.
    for entry in std::fs::read_dir(&data).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) }.unwrap();
    }
    for pre in unit.all("Service", "ExecStartPre") {
        let out = host.exec(&unit, &pre, None, None).output().unwrap();
        assert!(!out.status.success() && said(&out).contains("fencegate init"), "{pre}: {}", said(&out));
    }
    let start = unit.all("Service", "ExecStart").remove(0);
    let out = host.exec(&unit, &start, None, None).output().unwrap();
    assert!(!out.status.success() && said(&out).contains("fencegate init"), "{start}: {}", said(&out));
    assert_eq!(std::fs::read_dir(&data).unwrap().count(), 0, "something initialised the lost directory");
}

/// A unit file: `(section, key, value)` in order.
struct Unit(Vec<(String, String, String)>);

impl Unit {
    fn parse(text: &str) -> Unit {
        let mut section = String::new();
        let mut entries = Vec::new();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
                continue;
            }
            assert!(!line.ends_with('\\'), "continuation lines are not parsed here: {line}");
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name.to_owned();
            } else {
                let (key, value) = line.split_once('=').unwrap_or_else(|| panic!("not KEY=VALUE: {line}"));
                entries.push((section.clone(), key.trim().to_owned(), value.trim().to_owned()));
            }
        }
        Unit(entries)
    }

    fn all(&self, section: &str, key: &str) -> Vec<String> {
        self.0.iter().filter(|(s, k, _)| s == section && k == key).map(|(_, _, v)| v.clone()).collect()
    }

    fn one(&self, key: &str) -> Option<String> {
        self.all("Service", key).pop()
    }
}

/// The temporary root and what the recipe made in it.
struct Host {
    root: tempfile::TempDir,
    groups: HashMap<String, u32>,
}

impl Host {
    /// A root with the directories every Debian system has, and that the recipe expects.
    fn new() -> Host {
        let host = Host { root: open_tempdir(), groups: HashMap::new() };
        for dir in ["/etc/systemd/system", "/usr/local/bin", "/usr/local/share", "/var/lib"] {
            std::fs::create_dir_all(host.at(dir)).unwrap();
        }
        host
    }

    /// `path` (absolute) under the root.
    fn at(&self, path: &str) -> PathBuf {
        self.root.path().join(path.trim_start_matches('/'))
    }

    fn groupadd(&mut self, group: &str) {
        let gid = FIRST_GID + self.groups.len() as u32;
        self.groups.insert(group.to_owned(), gid);
    }

    fn install(&self, args: &[&str]) {
        let mut cmd = Command::new("install");
        let mut words = args.iter();
        while let Some(&arg) = words.next() {
            match arg {
                "-g" => {
                    let group = words.next().unwrap();
                    let gid = self.groups.get(*group).map(u32::to_string);
                    cmd.args(["-g", gid.as_deref().unwrap_or(group)]);
                }
                "-o" | "-m" => {
                    cmd.args([arg, words.next().unwrap()]);
                }
                "-t" => {
                    cmd.arg("-t").arg(self.at(words.next().unwrap()));
                }
                flag if flag.starts_with('-') => {
                    cmd.arg(flag);
                }
                path if path.starts_with('/') => {
                    cmd.arg(self.at(path));
                }
                "target/release/fencegate" => {
                    cmd.arg(BIN);
                }
                source => {
                    assert!(repo().join(source).exists(), "the recipe installs {source}, which does not exist");
                    cmd.arg(source);
                }
            }
        }
        let out = cmd.current_dir(repo()).output().unwrap();
        assert!(out.status.success(), "install {}: {}", args.join(" "), said(&out));
    }

    /// The units in `R/etc/systemd/system`, verified as systemd would load them there.
    fn verify_units(&self) {
        let units = self.at("/etc/systemd/system");
        // systemd-analyze resolves the units' dependencies (sysinit.target, ...) under --root.
        let system = self.at("/usr/lib/systemd");
        std::fs::create_dir_all(&system).unwrap();
        let out = Command::new("cp").args(["-a", "/usr/lib/systemd/system"]).arg(&system).output().unwrap();
        assert!(out.status.success(), "copying systemd's own units: {}", said(&out));
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&units).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            names.push(name.replace("@.", "@0."));
        }
        assert!(!names.is_empty(), "the recipe installed no unit");
        let out = Command::new("systemd-analyze")
            .arg("verify")
            .arg(format!("--root={}", self.root.path().display()))
            .args(&names)
            .output()
            .unwrap_or_else(|e| panic!("systemd-analyze (Debian package systemd; .ci/run installs it): {e}"));
        let said = said(&out);
        assert!(out.status.success() && said.trim().is_empty(), "systemd-analyze verify {names:?}:\n{said}");
    }

    /// The unit `name` (an instance of a template, perhaps) and its instance name.
    fn unit(&self, name: &str) -> (Unit, Option<String>) {
        let (file, instance) = match name.split_once('@') {
            Some((prefix, rest)) => {
                let (instance, suffix) = rest.rsplit_once('.').unwrap();
                (format!("{prefix}@.{suffix}"), Some(instance.to_owned()))
            }
            None => (name.to_owned(), None),
        };
        let path = self.at("/etc/systemd/system").join(&file);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {}: {e}", path.display()));
        (Unit::parse(&text), instance)
    }

    /// The state directory the unit's `StateDirectory=` names, made as systemd makes it for
    /// the unit's user (it also hands over one that exists).
    fn state_dir(&self, unit: &Unit) -> Option<PathBuf> {
        let name = unit.one("StateDirectory")?;
        let dir = self.at(&format!("/var/lib/{name}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mode = u32::from_str_radix(&unit.one("StateDirectoryMode").unwrap_or("0755".into()), 8).unwrap();
        std::os::unix::fs::chown(&dir, Some(DYNAMIC_UID), Some(DYNAMIC_UID)).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
        Some(dir)
    }

    /// `line` (an `Exec*=` value) as the unit's user would run it, with the unit's groups.
    fn exec(&self, unit: &Unit, line: &str, instance: Option<&str>, main_pid: Option<u32>) -> Command {
        let groups: Vec<u32> = unit
            .all("Service", "SupplementaryGroups")
            .iter()
            .flat_map(|v| v.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
            .map(|g| *self.groups.get(&g).unwrap_or_else(|| panic!("the recipe makes no group {g}")))
            .collect();
        self.exec_as(unit, line, instance, main_pid, &groups)
    }

    /// `line` (an `Exec*=` value) as the unit's user with the supplementary `groups`: `%i` is
    /// `instance`, `$MAINPID` is `main_pid`, and absolute paths that exist under the root are
    /// taken there.
    fn exec_as(
        &self,
        unit: &Unit,
        line: &str,
        instance: Option<&str>,
        main_pid: Option<u32>,
        groups: &[u32],
    ) -> Command {
        assert_eq!(unit.one("DynamicUser").as_deref(), Some("yes"), "only DynamicUser=yes units are mirrored here");
        let mut cmd = Command::new("setpriv");
        cmd.arg(format!("--reuid={DYNAMIC_UID}")).arg(format!("--regid={DYNAMIC_UID}"));
        if groups.is_empty() {
            cmd.arg("--clear-groups");
        } else {
            let groups: Vec<String> = groups.iter().map(u32::to_string).collect();
            cmd.arg(format!("--groups={}", groups.join(",")));
        }
        cmd.arg("--no-new-privs").arg("--");
        // "-" only tells systemd to go on when the command fails: the command is the same.
        let line = line.strip_prefix('-').unwrap_or(line);
        assert!(!line.contains(['"', '\'']) && !line.starts_with(['-', '@', '+', '!', ':']), "not mirrored: {line}");
        for word in line.split_whitespace() {
            let word =
                word.replace("%i", instance.unwrap_or("%i")).replace("$MAINPID", &format!("{}", main_pid.unwrap_or(0)));
            assert!(!word.contains(['%', '$']), "a specifier or variable not mirrored here: {word}");
            let here = self.at(&word);
            cmd.arg(if word.starts_with('/') && here.exists() { here.into_os_string() } else { word.into() });
        }
        // systemd's clean environment, plus Environment=; the listeners on free ports, and an
        // admin token, so that the test can talk to the service.
        cmd.env_clear().env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
        for assignment in unit.all("Service", "Environment") {
            let (key, value) = assignment.split_once('=').unwrap();
            let here = self.at(value);
            cmd.env(key, if value.starts_with('/') && here.exists() { here.into_os_string() } else { value.into() });
        }
        cmd.env("FENCEGATE_SERVER__LISTEN", "127.0.0.1:0").env("FENCEGATE_ADMIN__LISTEN", "127.0.0.1:0");
        cmd.env("FENCEGATE_ADMIN__TOKEN", ADMIN_TOKEN);
        cmd
    }

    /// The unit `name`, its `ExecStart=` and its instance, with its state directory made.
    fn exec_start_of(&self, name: &str) -> (Unit, String, Option<String>) {
        let (unit, instance) = self.unit(name);
        self.state_dir(&unit);
        let mut starts = unit.all("Service", "ExecStart");
        assert_eq!(starts.len(), 1, "{name}: one ExecStart= expected");
        (unit, starts.remove(0), instance)
    }

    fn start_oneshot(&self, name: &str) {
        let (unit, start, instance) = self.exec_start_of(name);
        assert_eq!(unit.one("Type").as_deref(), Some("oneshot"), "{name}");
        let out = self.exec(&unit, &start, instance.as_deref(), None).output().unwrap();
        assert!(out.status.success(), "{name}: {start}: {}", said(&out));
    }

    fn start_service(&self, name: &str) -> Running {
        let (unit, start, instance) = self.exec_start_of(name);
        for pre in unit.all("Service", "ExecStartPre") {
            let out = self.exec(&unit, &pre, instance.as_deref(), None).output().unwrap();
            assert!(out.status.success(), "{name}: ExecStartPre={pre}: {}", said(&out));
            assert!(
                out.stdout.is_empty() && out.stderr.is_empty(),
                "{name}: ExecStartPre={pre} is not quiet: {}",
                said(&out)
            );
        }
        let mut cmd = self.exec(&unit, &start, instance.as_deref(), None);
        // Type=notify: systemd's notification socket, abstract so that the unit's user can
        // reach it without a file it may write; the service is started once it says READY=1.
        let notify = (unit.one("Type").as_deref() == Some("notify")).then(|| {
            let name = format!("fencegate-deploy-test-{}", std::process::id());
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
            let socket = UnixDatagram::bind_addr(&addr).unwrap();
            socket.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
            cmd.env("NOTIFY_SOCKET", format!("@{name}"));
            socket
        });
        let running = Running::spawn(cmd, notify);
        if let Some(socket) = &running.notify {
            let ready = notification(socket);
            assert!(ready.lines().any(|l| l == "READY=1"), "{name}: the first notification is not READY=1: {ready:?}");
        }
        running
    }
}

/// The next notification on `socket` that is not a watchdog ping.
fn notification(socket: &UnixDatagram) -> String {
    let mut buf = [0u8; 4096];
    loop {
        let n = socket.recv(&mut buf).unwrap_or_else(|e| panic!("no notification from the service: {e}"));
        let message = String::from_utf8_lossy(&buf[..n]).into_owned();
        if message != "WATCHDOG=1" {
            return message;
        }
    }
}

/// The service's main process, its admin address, its notification socket and its log.
struct Running {
    child: Child,
    admin: SocketAddr,
    notify: Option<UnixDatagram>,
    log: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Running {
    fn spawn(mut cmd: Command, notify: Option<UnixDatagram>) -> Running {
        let mut child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let (tx, log) = mpsc::channel();
        let stderr = BufReader::new(child.stderr.take().unwrap());
        std::thread::spawn(move || stderr.lines().map_while(Result::ok).try_for_each(|l| tx.send(l)));
        let mut running = Running { child, admin: "0.0.0.0:0".parse().unwrap(), notify, log, seen: Vec::new() };
        let line = running.wait_for("admin API listening");
        let addr = line.split("addr=").nth(1).and_then(|s| s.split_whitespace().next());
        running.admin = addr.and_then(|a| a.parse().ok()).unwrap_or_else(|| panic!("no address in {line}"));
        running
    }

    /// The first log line (from now on) that holds `needle`; panics after 30 s or at the end.
    fn wait_for(&mut self, needle: &str) -> String {
        loop {
            match self.log.recv_timeout(Duration::from_secs(30)) {
                Ok(line) if line.contains(needle) => return line,
                Ok(line) => self.seen.push(line),
                Err(e) => panic!("no log line with {needle:?} ({e}); the log:\n{}", self.seen.join("\n")),
            }
        }
    }

    fn stop(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        if let Some(socket) = &self.notify {
            // After the reload's RELOADING=1 and READY=1; `notification` panics if none comes.
            while !notification(socket).lines().any(|l| l == "STOPPING=1") {}
        }
        self.child.wait().unwrap()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `method path` with `body` to `addr`, with the admin token; the status and the answer.
fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: fencegate\r\nConnection: close\r\n\
        Authorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let status = answer.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, answer)
}
