//! One deployment of the real binary: a backend (the in-memory one, or any a test starts
//! itself), a data dir, a config file, and the `fencegate run` process serving them, which
//! tests kill and start again at will.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use fencegate::demo::MemBackend;

use super::process::{BIN, Running};

/// Writes `dir/fencegate.toml` for a proxy on port 0 in front of `backend`, with its data in
/// `dir/data` and `extra` appended after the `[store]` section (more store keys, or further
/// sections). It does not make the data dir: `fencegate init` does.
pub fn write_config(dir: &Path, backend: &str, extra: &str) -> PathBuf {
    let path = dir.join("fencegate.toml");
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n[backend]\nurl = \"{backend}\"\n[store]\ndir = {:?}\n{extra}\n",
        dir.join("data").display().to_string()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// What [`Deployment::builder`] sets up.
#[derive(Debug, Default)]
pub struct Builder {
    config_extra: String,
}

impl Builder {
    /// TOML appended to the config after the `[store]` section.
    pub fn config_extra(mut self, toml: &str) -> Builder {
        self.config_extra.push_str(toml);
        self.config_extra.push('\n');
        self
    }

    /// Backend, data dir and config, with no proxy running yet.
    pub async fn build(self) -> Deployment {
        let backend = MemBackend::start().await.unwrap();
        let url = backend.url();
        self.build_in_front_of(backend, &url)
    }

    /// Data dir (initialised, as `fencegate init` does, with floor 0) and config for a proxy
    /// in front of `backend`, a server the test started itself (the recording WebDAV stub,
    /// say) that listens at `url`; no proxy running yet. The deployment keeps `backend`, so it
    /// lives as long as the deployment.
    pub fn build_in_front_of<B>(self, backend: B, url: &str) -> Deployment<B> {
        let dir = tempfile::tempdir().unwrap();
        let config_path = write_config(dir.path(), url, &self.config_extra);
        fencegate::app::init_data_dir(&dir.path().join("data"), 0).unwrap();
        Deployment { running: None, backend, dir, config_path }
    }

    /// Backend, data dir and config, and the proxy started on them.
    pub async fn start(self) -> Deployment {
        let mut d = self.build().await;
        d.start();
        d
    }
}

/// Fields drop in order: the proxy goes before its backend and its data dir.
pub struct Deployment<B = MemBackend> {
    /// The proxy, while one runs.
    pub running: Option<Running>,
    /// Records what the proxy forwarded, across restarts.
    pub backend: B,
    pub dir: tempfile::TempDir,
    pub config_path: PathBuf,
}

impl Deployment {
    pub fn builder() -> Builder {
        Builder::default()
    }
}

impl<B> Deployment<B> {
    /// Where the proxy keeps its store.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// `fencegate run` with this deployment's config.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.args(["run", "--config"]).arg(&self.config_path);
        cmd
    }

    /// Starts the proxy and waits until it listens.
    pub fn start(&mut self) -> &Running {
        self.start_with(|_, _| {})
    }

    /// Like [`Deployment::start`]; `on_line(line, pid)` sees each log line from start-up on.
    pub fn start_with(&mut self, on_line: impl FnMut(&str, u32) + Send + 'static) -> &Running {
        self.keep(Running::spawn_with(self.command(), on_line))
    }

    /// Starts the proxy from `bash -c "{setup}; exec fencegate run ..."`, for limits that
    /// `setup` puts on the process (ulimit, trap) before it becomes the proxy.
    pub fn start_in_shell(&mut self, setup: &str) -> &Running {
        let mut cmd = Command::new("bash");
        cmd.arg("-c").arg(format!("{setup}; exec {BIN} run --config {}", self.config_path.display()));
        self.keep(Running::spawn(cmd))
    }

    fn keep(&mut self, running: Running) -> &Running {
        assert!(self.running.is_none(), "a proxy already runs on this data dir");
        self.running.insert(running)
    }

    /// The running proxy.
    pub fn proxy(&self) -> &Running {
        self.running.as_ref().expect("a running proxy")
    }

    /// Stops the running proxy with SIGTERM and waits for its exit and last log lines; it stays
    /// here for its log.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        self.running.as_mut().expect("a running proxy").terminate()
    }

    /// The running proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.proxy().addr
    }

    /// Kills the running proxy with SIGKILL (no chance to clean up), and reaps it.
    pub fn kill9(&mut self) {
        self.running.take().expect("a running proxy").kill9();
    }

    /// Kills the running proxy with SIGKILL, if one runs, and starts a new one on the same
    /// config and data.
    pub fn restart(&mut self) -> &Running {
        if let Some(running) = self.running.take() {
            running.kill9();
        }
        self.start()
    }
}
