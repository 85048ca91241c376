//! What `fencegate check` verifies beyond the file itself: what `run` would refuse with this
//! configuration (a data directory it cannot use, listeners that collide).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::Error;
use crate::config::{BackendUrl, Config, ListenAddr};
use crate::store::{self, Usable};
use crate::upstream::backend_addr;

/// Checks that `run` could start with `config`, without binding or writing anything; returns
/// notes worth showing (a data directory a running fencegate holds, say).
pub fn check(config: &Config) -> Result<Vec<String>, Error> {
    let mut notes = Vec::new();
    let server = ("server.listen", &config.server.listen);
    if let Some(admin) = &config.admin.listen
        && same_place(server.1, admin)
    {
        return Err(Error::Conflict(format!(
            "server.listen ({}) and admin.listen ({admin}) are the same address: each listener needs its own",
            server.1
        )));
    }
    let backend = match &config.backend.url {
        BackendUrl::Http(url) => {
            let (host, port) = backend_addr(url);
            loopback_named(&host).or_else(|| host.parse().ok()).map(|ip| ListenAddr::Ip(SocketAddr::new(ip, port)))
        }
        BackendUrl::Unix(path) => Some(ListenAddr::Unix(path.clone())),
    };
    if let Some(backend) = backend {
        for (setting, addr) in std::iter::once(server).chain(config.admin.listen.as_ref().map(|a| ("admin.listen", a)))
        {
            if same_place(addr, &backend) {
                return Err(Error::Conflict(format!(
                    "{setting} ({addr}) is backend.url's address ({backend}): fencegate would forward to itself"
                )));
            }
        }
    }
    notes.extend(config.verify.revoked_keys().map(|k| {
        format!(
            "warning: verify.hmac_keys {:?} is revoked: its secret file {} does not exist, so signatures naming it \
            are refused",
            k.id,
            k.secret_file.display()
        )
    }));
    if let Some(etcd) = &config.store.etcd {
        notes.push(format!(
            "etcd store under {:?} on {}: not contacted here; `run` refuses a prefix `fencegate init --config` did not start",
            etcd.prefix,
            config.etcd.endpoints.join(", ")
        ));
        return Ok(notes);
    }
    let dir = &config.store.dir;
    match store::check_usable(dir, &crate::request::protocol::keying(config))? {
        Usable::Free => notes.push(format!("data dir {}: initialised, same key rules, writable", dir.display())),
        Usable::InUse => notes.push(format!(
            "data dir {}: initialised, same key rules, writable, and held by a running fencegate \
            (fine when checking a config before a reload; a second `run` on it would refuse to start)",
            dir.display()
        )),
    }
    Ok(notes)
}

/// `localhost`'s address, the one name checked without resolving it.
fn loopback_named(host: &str) -> Option<IpAddr> {
    (host == "localhost").then_some(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

/// Whether listening on `a` would take `b`'s place: overlapping TCP addresses, or one socket
/// file. Host names other than `localhost` are not resolved here.
fn same_place(a: &ListenAddr, b: &ListenAddr) -> bool {
    let tcp = |addr: &ListenAddr| match addr {
        ListenAddr::Ip(ip) => Some(*ip),
        ListenAddr::Host { host, port } => loopback_named(host).map(|ip| SocketAddr::new(ip, *port)),
        ListenAddr::Unix(_) => None,
    };
    match (a, b) {
        (ListenAddr::Unix(a), ListenAddr::Unix(b)) => a == b,
        _ => tcp(a).zip(tcp(b)).is_some_and(|(a, b)| overlaps(a, b)),
    }
}

/// Whether listening on `a` would take `b`'s port, or is `b`: the same port on the same
/// address, or on an unspecified one that covers every address.
fn overlaps(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() != 0 && a.port() == b.port() && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_overlap_on_one_port_of_one_address_or_of_every_address() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(overlaps(a("127.0.0.1:8080"), a("127.0.0.1:8080")));
        assert!(overlaps(a("0.0.0.0:8080"), a("127.0.0.1:8080")));
        assert!(overlaps(a("127.0.0.1:8080"), a("[::]:8080")));
        assert!(!overlaps(a("127.0.0.1:8080"), a("127.0.0.2:8080")));
        assert!(!overlaps(a("127.0.0.1:8080"), a("127.0.0.1:8081")));
        assert!(!overlaps(a("127.0.0.1:0"), a("127.0.0.1:0")), "port 0 is a new port each time");
    }

    #[test]
    fn a_socket_file_or_localhost_is_one_place() {
        let l = |s: &str| ListenAddr::parse(s).unwrap();
        assert!(same_place(&l("unix:/run/a.sock"), &l("unix:/run/a.sock")));
        assert!(!same_place(&l("unix:/run/a.sock"), &l("unix:/run/b.sock")));
        assert!(same_place(&l("localhost:8080"), &l("127.0.0.1:8080")));
        assert!(!same_place(&l("unix:/run/a.sock"), &l("127.0.0.1:8080")));
    }
}
