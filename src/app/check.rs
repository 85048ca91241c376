//! What `fencegate check` verifies beyond the file itself: what `run` would refuse with this
//! configuration (a data directory it cannot use, listeners that collide).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::Error;
use crate::config::Config;
use crate::store::{self, Usable};
use crate::upstream::backend_addr;

/// Checks that `run` could start with `config`, without binding or writing anything; returns
/// notes worth showing (a data directory a running fencegate holds, say).
pub fn check(config: &Config) -> Result<Vec<String>, Error> {
    let mut notes = Vec::new();
    let server = ("server.listen", config.server.listen);
    if let Some(admin) = config.admin.listen
        && overlaps(server.1, admin)
    {
        return Err(Error::Conflict(format!(
            "server.listen ({}) and admin.listen ({admin}) are the same address: each listener needs its own",
            server.1
        )));
    }
    let (host, port) = backend_addr(&config.backend.url);
    let backend_ip = match host.as_str() {
        "localhost" => Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        host => host.parse().ok(),
    };
    if let Some(ip) = backend_ip {
        let backend = SocketAddr::new(ip, port);
        for (setting, addr) in std::iter::once(server).chain(config.admin.listen.map(|a| ("admin.listen", a))) {
            if overlaps(addr, backend) {
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
}
