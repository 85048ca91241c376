//! Where the etcd store keeps what, under its prefix `P`, and how values are written.
//!
//! - `P/leader`: the leader's key, on its lease; its value is the leader's advertised URL and
//!   its create revision the leader's epoch.
//! - `P/batch`: the id of the last committed batch (`<epoch>.<sequence>`), which every batch
//!   compares and replaces: the chain that lets an unknown outcome be settled by a barrier.
//! - `P/keying`: the key rules the fence keys were made under.
//! - `P/instances/<advertise>`: each running instance's advertised URL, on its lease, so that
//!   two instances advertising one URL are told apart.
//! - `P/secret`: the key instances sign the writes they send on to the leader with, so that
//!   the leader tells them from a client's claim to be one.
//! - `P/rules`: the settings that decide a write's fate, which every instance must share
//!   ([`Config::fence_record`](crate::Config::fence_record)).
//! - `P/census`: how many levels (`P/k/…` and `P/f/…` together) the prefix must hold: written
//!   with every transaction that creates one, so that a takeover finding fewer knows some were
//!   deleted. Absent from prefixes an earlier build initialised, until a takeover writes it.
//! - `P/k/<key>`, `P/f/<floor>`: a key's `max_seen`, a floor.
//! - `P/w/<batch id>`: a batch's flight record, the marks it advanced with their tokens: writes
//!   forwarded whose answers may not have come (`flights`).
//! - `P/i/<key>`, `P/if/<floor>`: markers of writes in flight, as builds before flight records
//!   wrote them: read, and deleted once spent, never written.
//!
//! Tokens are 20-digit zero-padded decimals, so etcd's byte-wise compare orders them as
//! numbers (`fencegate migrate` compares with `LESS`).

use super::flights::Flight;
use crate::store::{Mark, MarkKind, MarkRef};

/// The key names of one store's prefix.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    prefix: String,
}

/// What a key under the prefix holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Named {
    /// A mark's level.
    Level(Mark),
    /// A mark's write in flight, as a marker of its own.
    InFlight(Mark),
    /// A batch's flight record, by the batch's id.
    Flight(Vec<u8>),
    /// The census of the levels.
    Census,
    /// Anything else (the leader, the batch id, the keying).
    Other,
}

impl Names {
    /// Names under `prefix`, which is used as given (`/fencegate/`, say).
    pub(crate) fn new(prefix: &str) -> Names {
        Names { prefix: prefix.to_owned() }
    }

    /// The prefix itself: every key of the store starts with it.
    pub(crate) fn prefix(&self) -> &[u8] {
        self.prefix.as_bytes()
    }

    fn under(&self, tail: &str, name: &str) -> Vec<u8> {
        let mut key = Vec::with_capacity(self.prefix.len() + tail.len() + name.len());
        key.extend_from_slice(self.prefix.as_bytes());
        key.extend_from_slice(tail.as_bytes());
        key.extend_from_slice(name.as_bytes());
        key
    }

    pub(crate) fn leader(&self) -> Vec<u8> {
        self.under("leader", "")
    }

    pub(crate) fn batch(&self) -> Vec<u8> {
        self.under("batch", "")
    }

    pub(crate) fn keying(&self) -> Vec<u8> {
        self.under("keying", "")
    }

    pub(crate) fn instance(&self, advertise: &str) -> Vec<u8> {
        self.under("instances/", advertise)
    }

    pub(crate) fn secret(&self) -> Vec<u8> {
        self.under("secret", "")
    }

    pub(crate) fn rules(&self) -> Vec<u8> {
        self.under("rules", "")
    }

    pub(crate) fn census(&self) -> Vec<u8> {
        self.under("census", "")
    }

    /// Where a mark's level is kept.
    pub(crate) fn level(&self, mark: MarkRef<'_>) -> Vec<u8> {
        self.under(tails(mark.kind).level, mark.name)
    }

    /// Where a mark's write in flight was kept by builds before flight records.
    pub(crate) fn in_flight(&self, mark: MarkRef<'_>) -> Vec<u8> {
        self.under(tails(mark.kind).in_flight, mark.name)
    }

    /// Where the flight record of the batch `id` is kept.
    pub(crate) fn flight_record(&self, id: &[u8]) -> Vec<u8> {
        let mut key = self.under(FLIGHTS, "");
        key.extend_from_slice(id);
        key
    }

    /// Where `flight` is kept.
    pub(crate) fn flight(&self, flight: &Flight) -> Vec<u8> {
        match flight {
            Flight::Marker(mark) => self.in_flight(mark.borrowed()),
            Flight::Batch(id) => self.flight_record(id),
        }
    }

    /// What `key` (read from etcd) holds; `Other` for a key outside the prefix too.
    pub(crate) fn parse(&self, key: &[u8]) -> Named {
        let Some(tail) = key.strip_prefix(self.prefix.as_bytes()) else { return Named::Other };
        let Ok(tail) = std::str::from_utf8(tail) else { return Named::Other };
        if tail == "census" {
            return Named::Census;
        }
        if let Some(id) = tail.strip_prefix(FLIGHTS) {
            return Named::Flight(id.as_bytes().to_vec());
        }
        for kind in MarkKind::ALL {
            let Tails { level, in_flight } = tails(kind);
            if let Some(name) = tail.strip_prefix(level) {
                return Named::Level(Mark::new(kind, name));
            }
            if let Some(name) = tail.strip_prefix(in_flight) {
                return Named::InFlight(Mark::new(kind, name));
            }
        }
        Named::Other
    }
}

/// What follows the prefix in the names of flight records.
const FLIGHTS: &str = "w/";

/// What follows the prefix in the names of one kind of mark.
struct Tails {
    level: &'static str,
    in_flight: &'static str,
}

/// The tails of each kind of mark: the one place the key layout names a kind (no tail is the
/// start of another, nor of [`FLIGHTS`]).
fn tails(kind: MarkKind) -> Tails {
    match kind {
        MarkKind::Key => Tails { level: "k/", in_flight: "i/" },
        MarkKind::Floor => Tails { level: "f/", in_flight: "if/" },
        // A binding is never in flight: its marker is never written.
        MarkKind::Upload => Tails { level: "u/", in_flight: "iu/" },
    }
}

/// A token as etcd keeps it: 20 digits, so byte order is numeric order.
pub(crate) fn token_value(token: u64) -> Vec<u8> {
    format!("{token:020}").into_bytes()
}

/// A token read back; `None` if the value is not one.
pub(crate) fn parse_token(value: &[u8]) -> Option<u64> {
    std::str::from_utf8(value).ok().filter(|s| s.len() == 20).and_then(|s| s.parse().ok())
}

/// A batch id: the epoch of the leader that wrote it and its sequence number.
pub(crate) fn batch_id(epoch: i64, sequence: u64) -> Vec<u8> {
    format!("{epoch:020}.{sequence:020}").into_bytes()
}

/// A batch id read back: its epoch and sequence; `None` if it is not one.
pub(crate) fn parse_batch_id(id: &[u8]) -> Option<(i64, u64)> {
    let text = std::str::from_utf8(id).ok()?;
    let (epoch, seq) = text.split_once('.')?;
    (epoch.len() == 20 && seq.len() == 20).then_some(())?;
    Some((epoch.parse().ok()?, seq.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_values_order_as_numbers() {
        let n = Names::new("/fg/");
        assert_eq!(n.level(MarkRef::key("/a/b")), b"/fg/k//a/b");
        assert_eq!(n.in_flight(MarkRef::floor("/d/")), b"/fg/if//d/");
        assert_eq!(n.parse(b"/fg/k//a/b"), Named::Level(Mark::key("/a/b")));
        assert_eq!(n.parse(b"/fg/f//d/"), Named::Level(Mark::floor("/d/")));
        assert_eq!(n.parse(b"/fg/i//a"), Named::InFlight(Mark::key("/a")));
        assert_eq!(n.parse(b"/fg/if//d/"), Named::InFlight(Mark::floor("/d/")));
        assert_eq!(n.parse(&n.flight_record(&batch_id(3, 4))), Named::Flight(batch_id(3, 4)));
        assert_eq!(n.flight(&Flight::Marker(Mark::key("/a"))), b"/fg/i//a");
        assert_eq!(n.parse(b"/fg/leader"), Named::Other);
        assert_eq!(n.parse(&n.census()), Named::Census);
        assert_eq!(n.parse(b"/other/k//a"), Named::Other);
        assert!(token_value(9) < token_value(10), "byte order is numeric order");
        assert!(token_value(u64::MAX - 1) < token_value(u64::MAX));
        assert_eq!(parse_token(&token_value(u64::MAX)), Some(u64::MAX));
        assert_eq!(parse_token(b"34"), None, "only the padded form is a token");
        assert!(batch_id(7, 2) < batch_id(7, 10));
        assert_eq!(parse_batch_id(&batch_id(7, 10)), Some((7, 10)));
        assert_eq!(parse_batch_id(b"7.10"), None);
        assert_eq!(parse_batch_id(b"x"), None);
    }
}
