//! The sockets a listener accepts on: one or more TCP sockets (a host name may resolve to
//! several addresses), or a Unix socket whose file it made and removes when it stops.
//!
//! A Unix socket's file outlives a process that did not remove it (`kill -9`), and `bind`
//! fails on it. At bind, a file that is a socket nobody accepts on (connecting is refused) is
//! such a leftover and is removed; a socket that accepts is another server's, and anything
//! that is not a socket is not fencegate's to delete: both are refused.

use std::io;
use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::task::{Context, Poll};

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

/// Why a Unix socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// Another server accepts connections on the socket.
    #[error("{} is a socket another server is accepting on; stop it or choose another path", .0.display())]
    InUse(PathBuf),
    /// The path exists and is not a socket.
    #[error("{} exists and is not a socket; fencegate will not delete it", .0.display())]
    NotSocket(PathBuf),
    /// The OS refused.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The socket's path.
        path: PathBuf,
        /// The OS error.
        source: io::Error,
    },
}

/// Where a connection comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Remote {
    /// A TCP peer.
    Tcp(SocketAddr),
    /// A peer on a Unix socket, which has no address.
    Unix,
}

impl std::fmt::Display for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Remote::Tcp(addr) => addr.fmt(f),
            Remote::Unix => f.write_str("unix"),
        }
    }
}

/// An accepted connection.
pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

/// What a proxy or admin API serves on: bound TCP sockets or a Unix socket. Made from a tokio
/// `TcpListener` or `UnixListener` (`.into()`), or by `fencegate::app::bind`.
#[derive(Debug)]
pub struct Listener {
    sockets: Sockets,
    /// The socket file this listener made, removed when it is dropped.
    file: Option<SocketFile>,
    /// Which TCP socket is asked first on the next accept, so that none starves the others.
    next: usize,
}

#[derive(Debug)]
enum Sockets {
    Tcp(Vec<TcpListener>),
    Unix(UnixListener),
}

/// A [`Listener`] between runtimes: the admin API's is bound on the caller's and served on a
/// runtime of its own.
#[derive(Debug)]
pub(crate) struct Detached {
    sockets: DetachedSockets,
    file: Option<SocketFile>,
}

#[derive(Debug)]
enum DetachedSockets {
    Tcp(Vec<std::net::TcpListener>),
    Unix(std::os::unix::net::UnixListener),
}

/// The file of a bound Unix socket, removed on drop if it is still the one bound: a file
/// another process has put there since is left alone.
#[derive(Debug)]
struct SocketFile {
    path: PathBuf,
    dev: u64,
    ino: u64,
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.dev() == self.dev && m.ino() == self.ino) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl From<TcpListener> for Listener {
    fn from(listener: TcpListener) -> Self {
        Listener::tcp(vec![listener])
    }
}

impl From<UnixListener> for Listener {
    fn from(listener: UnixListener) -> Self {
        Listener { sockets: Sockets::Unix(listener), file: None, next: 0 }
    }
}

impl Listener {
    /// Accepts on every one of `listeners`.
    pub(crate) fn tcp(listeners: Vec<TcpListener>) -> Self {
        Listener { sockets: Sockets::Tcp(listeners), file: None, next: 0 }
    }

    /// Binds a Unix socket at `path` with permissions `mode`, removing a stale socket file
    /// first; the file is removed again when the listener is dropped. Call it within a tokio
    /// runtime.
    pub(crate) fn bind_unix(path: &Path, mode: u32) -> Result<Self, BindError> {
        let io = |source| BindError::Io { path: path.to_owned(), source };
        match std::fs::symlink_metadata(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
            Ok(meta) if !meta.file_type().is_socket() => return Err(BindError::NotSocket(path.to_owned())),
            Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => return Err(BindError::InUse(path.to_owned())),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    tracing::info!(path = %path.display(), "removing a stale socket file nobody accepts on");
                    std::fs::remove_file(path).map_err(io)?;
                }
                Err(e) => return Err(io(e)),
            },
        }
        // Bound first in a directory only this user can enter, given its mode there, then
        // moved into place: bound at `path` directly, it would accept connections with the
        // umask's mode until the mode is set, and a connection made then stays open.
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let private = parent.join(format!(
            ".fg{}.{}",
            std::process::id(),
            std::time::UNIX_EPOCH.elapsed().map_or(0, |d| d.subsec_nanos())
        ));
        std::fs::DirBuilder::new().mode(0o700).create(&private).map_err(io)?;
        let staged = private.join("s");
        let bound = UnixListener::bind(&staged).and_then(|listener| {
            std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode))?;
            rustix::fs::renameat_with(
                rustix::fs::CWD,
                &staged,
                rustix::fs::CWD,
                path,
                rustix::fs::RenameFlags::NOREPLACE,
            )?;
            Ok(listener)
        });
        let _ = std::fs::remove_file(&staged);
        let _ = std::fs::remove_dir(&private);
        let listener = bound.map_err(io)?;
        // A file made from here on is ours to remove, whatever fails next.
        let meta = std::fs::symlink_metadata(path).map_err(io)?;
        let file = SocketFile { path: path.to_owned(), dev: meta.dev(), ino: meta.ino() };
        Ok(Listener { sockets: Sockets::Unix(listener), file: Some(file), next: 0 })
    }

    /// What it listens on, for the log: `127.0.0.1:8080`, `unix:/run/fg.sock`.
    pub(crate) fn describe(&self) -> String {
        match &self.sockets {
            Sockets::Tcp(listeners) => {
                let addrs: Vec<String> =
                    listeners.iter().filter_map(|l| l.local_addr().ok()).map(|a| a.to_string()).collect();
                addrs.join(", ")
            }
            Sockets::Unix(listener) => match (&self.file, listener.local_addr()) {
                (Some(file), _) => format!("unix:{}", file.path.display()),
                (None, Ok(addr)) => match addr.as_pathname() {
                    Some(path) => format!("unix:{}", path.display()),
                    None => "unix (unnamed)".into(),
                },
                (None, Err(_)) => "unix".into(),
            },
        }
    }

    /// The addresses of its TCP sockets (none for a Unix socket).
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        match &self.sockets {
            Sockets::Tcp(listeners) => listeners.iter().filter_map(|l| l.local_addr().ok()).collect(),
            Sockets::Unix(_) => Vec::new(),
        }
    }

    /// The next connection on any of its sockets.
    pub(crate) async fn accept(&mut self) -> io::Result<(Stream, Remote)> {
        std::future::poll_fn(|cx| self.poll_accept(cx)).await
    }

    fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<(Stream, Remote)>> {
        match &self.sockets {
            Sockets::Unix(listener) => {
                listener.poll_accept(cx).map_ok(|(stream, _)| (Stream::Unix(stream), Remote::Unix))
            }
            Sockets::Tcp(listeners) => {
                let n = listeners.len();
                for i in 0..n {
                    let at = (self.next + i) % n;
                    if let Poll::Ready(accepted) = listeners[at].poll_accept(cx) {
                        self.next = (at + 1) % n;
                        return Poll::Ready(accepted.map(|(stream, addr)| {
                            let _ = stream.set_nodelay(true);
                            (Stream::Tcp(stream), Remote::Tcp(addr))
                        }));
                    }
                }
                Poll::Pending
            }
        }
    }

    /// Takes its sockets off the current runtime, to be served on another.
    pub(crate) fn detach(self) -> io::Result<Detached> {
        let sockets = match self.sockets {
            Sockets::Tcp(listeners) => {
                DetachedSockets::Tcp(listeners.into_iter().map(TcpListener::into_std).collect::<io::Result<_>>()?)
            }
            Sockets::Unix(listener) => DetachedSockets::Unix(listener.into_std()?),
        };
        Ok(Detached { sockets, file: self.file })
    }
}

impl Detached {
    /// Puts the sockets on the current runtime.
    pub(crate) fn attach(self) -> io::Result<Listener> {
        let sockets = match self.sockets {
            DetachedSockets::Tcp(listeners) => {
                Sockets::Tcp(listeners.into_iter().map(TcpListener::from_std).collect::<io::Result<_>>()?)
            }
            DetachedSockets::Unix(listener) => Sockets::Unix(UnixListener::from_std(listener)?),
        };
        Ok(Listener { sockets, file: self.file, next: 0 })
    }
}
