//! Apache httpd with mod_dav from Debian (`apache2`), serving WebDAV from a temporary root on
//! loopback: a real backend that honours HTTP preconditions on writes, for the pin tests
//! (docs/pins.md). `.ci/run` installs it; where it is missing outside CI, [`start_apache`] says
//! so and returns `None`, and the test skips (under `FG_REQUIRE_SERVICES=1` it fails instead).
//!
//! It runs in the foreground as one process (`apache2 -X`) with a config file of its own:
//! ServerRoot, pid file, mutexes and `DavLockDB` in its temporary directory, its error log on
//! its stderr (shown when a test panics), the event MPM (threads: with `-X` the prefork MPM
//! serves one connection at a time, and a connection fencegate keeps alive would block every
//! other for the keep-alive timeout), mod_authn_core and mod_authz_core
//! (without them every request is a 500, "couldn't check user"), mod_dav and mod_dav_fs. Run as
//! root, it serves as uid and gid 65534 (`nobody`), so its directories are open to all. It is
//! killed and reaped by pid when its guard drops.
//!
//! What this Apache (2.4 from Debian 12) does, checked by hand and by
//! `tests/proxy/pins.rs`:
//! - A `PUT`'s answer carries no `ETag`: `201 Created` for a new file, `204 No Content` for a
//!   replaced one. Only a `HEAD` or `GET` says what the file's tag is.
//! - With `FileETag Digest` ([`ETags::Digest`], the default here) the tag is strong, the
//!   base64 SHA-1 of the content (`"/gW83NxJKAEngaXxoqd8u1OY4QY="`), from the first moment:
//!   the same bytes give the same tag again (A, B, A).
//! - With Apache's default `FileETag` (`MTime Size`, [`ETags::MTimeSize`]) the tag is weak
//!   (`W/"3-661d246b5c12d"`) for the second after each write, and strong (`"3-661d246b5c12d"`)
//!   after it. A weak tag in `If-Match` never matches (`412`).
//! - Preconditions on `PUT` and `DELETE` are honoured: `If-Match` with a tag that is not the
//!   file's, or on a file that does not exist, gets `412`; `If-None-Match: *` on a file that
//!   exists gets `412`, and on one that does not, the `PUT` creates it (`201`). A `DELETE` that
//!   fails a precondition logs "Could not DELETE ... due to a failed precondition".
//! - A `HEAD` of a missing file is `404`.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::raw::try_raw_request;
use super::services::{ATTEMPTS, Process, free_ports, installed};

const APACHE2: &str = "/usr/sbin/apache2";
const MODULES: &str = "/usr/lib/apache2/modules";
const LOADED: [(&str, &str); 5] = [
    ("mpm_event_module", "mod_mpm_event.so"),
    ("authn_core_module", "mod_authn_core.so"),
    ("authz_core_module", "mod_authz_core.so"),
    ("dav_module", "mod_dav.so"),
    ("dav_fs_module", "mod_dav_fs.so"),
];

/// How Apache makes the `ETag` of a file (its `FileETag` directive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ETags {
    /// `FileETag Digest`: strong, a hash of the content.
    Digest,
    /// Apache's default, `MTime Size`: weak for the second after each write.
    MTimeSize,
}

/// A running Apache; killed and reaped on drop.
pub struct Apache {
    process: Process,
    /// `127.0.0.1:PORT`.
    pub addr: SocketAddr,
    /// The directory it serves (and accepts WebDAV writes to) at `/`.
    pub root: PathBuf,
    _dir: tempfile::TempDir,
}

impl Apache {
    /// `http://ADDR`, for a fencegate config.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn pid(&self) -> u32 {
        self.process.child.id()
    }

    /// The file at `path` (`/a/b`) as it is on disk, or `None` if there is none.
    pub fn file(&self, path: &str) -> Option<Vec<u8>> {
        std::fs::read(self.root.join(path.trim_start_matches('/'))).ok()
    }
}

/// Apache with `FileETag Digest`, or `None` (the test skips) where it is not installed.
pub async fn start_apache() -> Option<Apache> {
    start_apache_with(ETags::Digest).await
}

/// Apache making its tags as `etags` says, or `None` where it is not installed.
pub async fn start_apache_with(etags: ETags) -> Option<Apache> {
    let modules: Vec<String> = LOADED.iter().map(|(_, file)| format!("{MODULES}/{file}")).collect();
    let mut paths = vec![APACHE2];
    paths.extend(modules.iter().map(String::as_str));
    if !installed("Apache httpd", "apache2", &paths) {
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let locks = dir.path().join("locks");
    // Run as root, Apache serves as `nobody`, which must reach and write these.
    open_to_all(dir.path(), 0o755);
    for d in [&root, &locks] {
        std::fs::create_dir(d).unwrap();
        open_to_all(d, 0o777);
    }
    for attempt in 0..ATTEMPTS {
        let [port] = free_ports();
        let conf = dir.path().join(format!("httpd-{attempt}.conf"));
        std::fs::write(&conf, config(dir.path(), &root, &locks, port, etags, attempt)).unwrap();
        let mut cmd = Command::new(APACHE2);
        cmd.arg("-X").arg("-d").arg(dir.path()).arg("-f").arg(&conf);
        let mut process = Process::spawn("Apache", cmd, dir.path().join(format!("apache-{attempt}.log")));
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        // Its socket listens before its worker threads serve: ready once it answers.
        let answers = async || try_raw_request(addr, "HEAD / HTTP/1.1\r\nHost: x", "").await.is_some();
        if process.wait_ready(answers).await {
            return Some(Apache { process, addr, root, _dir: dir });
        }
        eprintln!("Apache ended before it answered (attempt {attempt}), trying another port:\n{}", process.log_text());
    }
    panic!("Apache did not start in {ATTEMPTS} attempts");
}

fn open_to_all(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn config(dir: &Path, root: &Path, locks: &Path, port: u16, etags: ETags, attempt: usize) -> String {
    let d = dir.display();
    let mut text = format!(
        "ServerRoot \"{d}\"\nServerName 127.0.0.1\nListen 127.0.0.1:{port}\n\
         PidFile \"{d}/httpd-{attempt}.pid\"\nDefaultRuntimeDir \"{d}\"\nMutex file:{d} default\n\
         ErrorLog /dev/stderr\nLogLevel warn\n"
    );
    for (name, file) in LOADED {
        text.push_str(&format!("LoadModule {name} {MODULES}/{file}\n"));
    }
    if rustix::process::geteuid().is_root() {
        // Apache refuses to serve as root; 65534 is `nobody` and `nogroup` on Debian.
        text.push_str("User #65534\nGroup #65534\n");
    }
    if etags == ETags::Digest {
        text.push_str("FileETag Digest\n");
    }
    text.push_str(&format!(
        "DavLockDB \"{}/DavLock\"\nDocumentRoot \"{root}\"\n<Directory \"{root}\">\n  Dav On\n  Require all granted\n</Directory>\n",
        locks.display(),
        root = root.display(),
    ));
    text
}
