//! nginx serving WebDAV from a temporary root on loopback: the real backend the path and
//! write-set tests check fencegate against. `.ci/run` installs nginx; where it is missing
//! outside CI, `start_nginx` says so and returns `None`.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct Nginx {
    child: Child,
    /// Its TCP address; for one on a Unix socket, a port nothing listens on.
    pub addr: std::net::SocketAddr,
    /// Its Unix socket, for one started by [`start_nginx_unix`].
    pub socket: Option<PathBuf>,
    pub root: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nginx_binary() -> Option<PathBuf> {
    ["/usr/sbin/nginx", "/usr/bin/nginx", "/usr/local/sbin/nginx"].iter().map(PathBuf::from).find(|p| p.exists())
}

pub async fn start_nginx() -> Option<Nginx> {
    start(false).await
}

/// nginx listening on a Unix socket (`listen unix:/path`) in its temporary directory.
pub async fn start_nginx_unix() -> Option<Nginx> {
    start(true).await
}

async fn start(unix: bool) -> Option<Nginx> {
    let Some(bin) = nginx_binary() else {
        let required = super::skips::required() || std::env::var_os("CI").is_some();
        assert!(!required, "nginx is required in CI and with FG_REQUIRE_SERVICES=1 (.ci/run installs nginx-light)");
        super::skips::skip("nginx: not installed (apt-get install nginx-light)");
        return None;
    };
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let port = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().port()
    };
    let p = |name: &str| dir.path().join(name).display().to_string();
    let socket = unix.then(|| dir.path().join("nginx.sock"));
    let listen = match &socket {
        Some(path) => format!("unix:{}", path.display()),
        None => format!("127.0.0.1:{port}"),
    };
    let conf = format!(
        "daemon off; master_process off; worker_processes 1; pid {pid}; error_log {err} warn;\n\
         events {{ worker_connections 64; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {body}; proxy_temp_path {proxy};\n  \
         fastcgi_temp_path {fcgi}; uwsgi_temp_path {uwsgi}; scgi_temp_path {scgi};\n  \
         server {{\n    listen {listen};\n    root {root};\n    \
         location / {{ dav_methods PUT DELETE MKCOL COPY MOVE; create_full_put_path on; dav_access user:rw; }}\n  }}\n}}\n",
        pid = p("nginx.pid"),
        err = p("error.log"),
        body = p("body"),
        proxy = p("proxy"),
        fcgi = p("fcgi"),
        uwsgi = p("uwsgi"),
        scgi = p("scgi"),
        root = root.display(),
    );
    std::fs::write(dir.path().join("nginx.conf"), conf).unwrap();
    let child = Command::new(bin)
        .arg("-p")
        .arg(dir.path())
        .arg("-c")
        .arg(dir.path().join("nginx.conf"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let error_log = p("error.log");
    // From here on, dropping the guard (also when panicking) kills and reaps nginx.
    let nginx = Nginx { child, addr, socket: socket.clone(), root, _dir: dir };
    for _ in 0..200 {
        let up = match &socket {
            Some(path) => tokio::net::UnixStream::connect(path).await.is_ok(),
            None => tokio::net::TcpStream::connect(addr).await.is_ok(),
        };
        if up {
            return Some(nginx);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("nginx did not start: {}", std::fs::read_to_string(error_log).unwrap_or_default());
}
