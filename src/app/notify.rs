//! The service manager's notification protocol (systemd's `sd_notify(3)`), written by hand:
//! one datagram of `KEY=VALUE` lines to the Unix socket `$NOTIFY_SOCKET` names, a path or,
//! starting with `@`, a name in Linux's abstract namespace. It is a few lines over the
//! standard library's `UnixDatagram`, so no crate is needed. [`super::supervised`] decides
//! when to send what.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// The variable that names the service manager's socket.
pub const NOTIFY_SOCKET: &str = "NOTIFY_SOCKET";
/// The watchdog's timeout in microseconds, when the service manager wants pings.
pub const WATCHDOG_USEC: &str = "WATCHDOG_USEC";
/// The process the watchdog is for; another process's (a parent's) is not fencegate's.
pub const WATCHDOG_PID: &str = "WATCHDOG_PID";

/// Why the notification settings in the environment cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// `$NOTIFY_SOCKET` is not an address a datagram can go to.
    #[error("{NOTIFY_SOCKET}={socket:?} is not a Unix socket address: {message}")]
    Address {
        /// The variable's value.
        socket: String,
        /// Why.
        message: String,
    },
    /// A variable that must be a number is not one.
    #[error("{name}={value:?} is not a positive number")]
    NotANumber {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
    },
    /// No socket to send from.
    #[error("cannot open a socket to notify the service manager: {0}")]
    Socket(#[source] std::io::Error),
}

/// A socket to the service manager.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    addr: SocketAddr,
    /// `$NOTIFY_SOCKET`, for messages.
    name: String,
}

impl Notifier {
    /// The service manager's socket that `$NOTIFY_SOCKET` names; `None` when it is unset or
    /// empty (not started by a service manager that listens).
    pub fn from_env() -> Result<Option<Notifier>, NotifyError> {
        match std::env::var(NOTIFY_SOCKET) {
            Ok(name) if !name.is_empty() => Notifier::to(&name).map(Some),
            Ok(_) | Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => {
                Err(NotifyError::Address { socket: v.to_string_lossy().into_owned(), message: "not UTF-8".into() })
            }
        }
    }

    /// A notifier that sends to `name`: a path, or `@NAME` for an abstract socket.
    pub fn to(name: &str) -> Result<Notifier, NotifyError> {
        let bad = |e: std::io::Error| NotifyError::Address { socket: name.to_owned(), message: e.to_string() };
        let addr = match name.strip_prefix('@') {
            Some(abstract_name) => SocketAddr::from_abstract_name(abstract_name.as_bytes()).map_err(bad)?,
            None if name.starts_with('/') => SocketAddr::from_pathname(name).map_err(bad)?,
            None => {
                return Err(NotifyError::Address {
                    socket: name.to_owned(),
                    message: "neither an absolute path nor @ and an abstract name".into(),
                });
            }
        };
        let socket = UnixDatagram::unbound().map_err(NotifyError::Socket)?;
        // A full socket buffer must not block the thread that sends: the message is dropped.
        socket.set_nonblocking(true).map_err(NotifyError::Socket)?;
        Ok(Notifier { socket, addr, name: name.to_owned() })
    }

    /// Sends `message`, newline-separated `KEY=VALUE` lines, in one datagram.
    pub fn send(&self, message: &str) -> std::io::Result<()> {
        self.socket.send_to_addr(message.as_bytes(), &self.addr).map(drop)
    }

    /// The socket's name, as `$NOTIFY_SOCKET` gave it.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// How often to ping the watchdog: half of `$WATCHDOG_USEC`, as `sd_watchdog_enabled(3)`
/// advises; `None` when it is unset or meant for another process (`$WATCHDOG_PID`).
pub fn watchdog_interval() -> Result<Option<Duration>, NotifyError> {
    let number = |name: &'static str| -> Result<Option<u64>, NotifyError> {
        match std::env::var(name) {
            Err(std::env::VarError::NotPresent) => Ok(None),
            Ok(v) if v.is_empty() => Ok(None),
            Ok(v) => {
                v.parse::<u64>().ok().filter(|n| *n > 0).map(Some).ok_or(NotifyError::NotANumber { name, value: v })
            }
            Err(std::env::VarError::NotUnicode(v)) => {
                Err(NotifyError::NotANumber { name, value: v.to_string_lossy().into_owned() })
            }
        }
    };
    let Some(usec) = number(WATCHDOG_USEC)? else { return Ok(None) };
    if number(WATCHDOG_PID)?.is_some_and(|pid| pid != u64::from(std::process::id())) {
        return Ok(None);
    }
    Ok(Some(Duration::from_micros(usec) / 2))
}

/// `CLOCK_MONOTONIC` in microseconds, the clock `MONOTONIC_USEC=` is read on.
pub fn monotonic_usec() -> u64 {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let secs = u64::try_from(now.tv_sec).unwrap_or(0);
    let micros = u64::try_from(now.tv_nsec).unwrap_or(0) / 1_000;
    secs.saturating_mul(1_000_000).saturating_add(micros)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_datagram_reaches_a_path_and_an_abstract_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        Notifier::to(path.to_str().unwrap()).unwrap().send("READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");

        let name = format!("fencegate-notify-test-{}", std::process::id());
        let listener = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes()).unwrap()).unwrap();
        Notifier::to(&format!("@{name}")).unwrap().send("STOPPING=1").unwrap();
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }

    #[test]
    fn a_relative_path_is_refused_with_its_name() {
        let e = Notifier::to("notify.sock").unwrap_err().to_string();
        assert!(e.contains("NOTIFY_SOCKET=\"notify.sock\""), "{e}");
    }
}
