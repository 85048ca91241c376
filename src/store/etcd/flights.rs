//! [`Flights`]: the leader's writes that the backend may not have answered yet, as etcd holds
//! them, so that a new leader quarantines their resources.
//!
//! Each batch that lets writes go puts one **flight record**, `P/w/<batch id>`, naming the
//! marks it advanced (keys and floors) with their tokens, in the same transaction as their
//! levels. A mark's newest record is the one that counts: an entry is spent when the backend
//! answers that write, or when a later committed record names the mark. A record with every
//! entry spent is deleted by a later batch. So a write costs etcd one operation (its level)
//! where a marker per write costs two more (its put, its delete when answered), and an answer
//! costs etcd nothing until its whole record is spent.
//!
//! A record outlives the answers of most of its writes while one is still in flight, so a
//! takeover may quarantine a resource whose write was answered: never the reverse. A record
//! that names writes in flight beside spent entries for [`CARRY_AFTER`] hands them on to the
//! next batch's record ([`Flights::to_carry`]), which bounds that.
//!
//! Prefixes written by builds before flight records hold one **marker** per mark in flight
//! (`P/i/<key>`, `P/if/<floor>`): a takeover reads them as the oldest records, each of one
//! entry, and they are deleted like records once spent.
//!
//! The record's value is JSON, `[["k",34,"/a"],["f",7,"/d/"]]` (kind, token, name), readable
//! with `etcdctl get` and safe for any name.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio::time::Instant;

use crate::store::{Mark, MarkKind};

/// How long a record may name writes in flight beside entries already spent before the next
/// batch's record names those writes instead: a write whose outcome stays unknown keeps its
/// entry until a later write of its mark is answered, and would otherwise keep every mark of its
/// batch quarantined at a takeover.
pub(crate) const CARRY_AFTER: Duration = Duration::from_secs(1);

/// An entry of a batch's flight record: a mark, its token, and whether the batch carries it
/// from an older record rather than advancing it.
pub(crate) type Entry = (Mark, u64, bool);

/// Where a write in flight is recorded in etcd.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Flight {
    /// A marker of one mark, as builds before flight records wrote them: older than any record.
    Marker(Mark),
    /// The flight record of the batch with this id.
    Batch(Vec<u8>),
}

/// What the writer knows of one flight in etcd.
#[derive(Debug, Clone)]
struct Held {
    /// How many marks it is still the newest flight of.
    live: usize,
    /// How many marks it names.
    named: usize,
    /// When it committed (or was read by the takeover).
    since: Instant,
}

/// The writes in flight of one leadership, by flight, and which flights are spent.
#[derive(Debug, Clone, Default)]
pub(crate) struct Flights {
    /// Each mark in flight: the flight naming its newest write, and that write's token.
    flying: HashMap<Mark, (Flight, u64)>,
    /// Each flight in etcd.
    held: HashMap<Flight, Held>,
    /// Spent flights that a batch in flight deletes.
    deleting: HashSet<Flight>,
}

impl Flights {
    /// What a takeover read: every flight with its `(mark, token)` entries, in any order.
    /// Markers are older than records, and records are as old as their batch ids (zero-padded,
    /// so byte order is numeric order). A record that names nothing is spent.
    pub(crate) fn adopt(mut read: Vec<(Flight, Vec<(Mark, u64)>)>) -> Flights {
        read.sort_by(|a, b| a.0.cmp(&b.0));
        let mut flights = Flights::default();
        let since = Instant::now();
        for (flight, entries) in read {
            flights.held.entry(flight.clone()).or_insert(Held { live: 0, named: 0, since });
            for (mark, token) in entries {
                flights.name(mark, flight.clone(), token, since);
            }
        }
        flights
    }

    /// Makes `flight` the newest flight of `mark`, spending the entry of the one before.
    fn name(&mut self, mark: Mark, flight: Flight, token: u64, since: Instant) {
        let held = self.held.entry(flight.clone()).or_insert(Held { live: 0, named: 0, since });
        held.live += 1;
        held.named += 1;
        if let Some((older, _)) = self.flying.insert(mark, (flight, token)) {
            self.spend(&older);
        }
    }

    fn spend(&mut self, flight: &Flight) {
        if let Some(held) = self.held.get_mut(flight) {
            held.live = held.live.saturating_sub(1);
        }
    }

    /// Each mark in flight, with the token of its newest write.
    pub(crate) fn in_flight(&self) -> impl Iterator<Item = (&Mark, u64)> {
        self.flying.iter().map(|(mark, (_, token))| (mark, *token))
    }

    /// The writes in flight that the next batch's record names again ([`CARRY_AFTER`]): those
    /// of flights held longer than that beside entries already spent.
    pub(crate) fn to_carry(&self, now: Instant) -> Vec<(Mark, u64)> {
        // The flights are few beside the writes in flight: most batches find none stale.
        let stale: HashSet<&Flight> = self
            .held
            .iter()
            .filter(|(_, h)| h.live < h.named && now.duration_since(h.since) >= CARRY_AFTER)
            .map(|(flight, _)| flight)
            .collect();
        if stale.is_empty() {
            return Vec::new();
        }
        self.flying
            .iter()
            .filter(|(_, (flight, _))| stale.contains(flight))
            .map(|(mark, (_, token))| (mark.clone(), *token))
            .collect()
    }

    /// The batch `id` committed with a record of `entries`, each `(mark, token, carried)`:
    /// it is now the newest flight of each mark it advanced, and of each it carried
    /// ([`Flights::to_carry`]) whose write is still the one in flight.
    pub(crate) fn committed(&mut self, id: &[u8], entries: &[Entry], now: Instant) {
        if entries.is_empty() {
            // It put no record.
            return;
        }
        let flight = Flight::Batch(id.to_vec());
        // Held even when it names nothing in flight any more, so that a batch deletes it.
        self.held.entry(flight.clone()).or_insert(Held { live: 0, named: 0, since: now });
        for (mark, token, carried) in entries {
            // A carried write answered since is not named again: its entry is spent already.
            if !carried || self.flying.get(mark).is_some_and(|(f, t)| t == token && *f != flight) {
                self.name(mark.clone(), flight.clone(), *token, now);
            }
        }
        if let Some(held) = self.held.get_mut(&flight) {
            held.named = entries.len();
        }
    }

    /// The backend answered the write in flight on `mark`: its entry is spent.
    pub(crate) fn answered(&mut self, mark: &Mark) {
        if let Some((flight, _)) = self.flying.remove(mark) {
            self.spend(&flight);
        }
    }

    /// Whether a spent flight waits for a batch to delete it.
    pub(crate) fn has_spent(&self) -> bool {
        self.held.iter().any(|(flight, held)| held.live == 0 && !self.deleting.contains(flight))
    }

    /// Spent flights for the next batch to delete, while `fits` takes each (the batch's room),
    /// which are deleting from then on: [`Flights::deleted`] once that batch committed,
    /// [`Flights::kept`] if it did not.
    pub(crate) fn spent(&mut self, mut fits: impl FnMut(&Flight) -> bool) -> Vec<Flight> {
        let spent: Vec<Flight> = self
            .held
            .iter()
            .filter(|(flight, held)| held.live == 0 && !self.deleting.contains(*flight))
            .map(|(flight, _)| flight)
            .take_while(|flight| fits(flight))
            .cloned()
            .collect();
        self.deleting.extend(spent.iter().cloned());
        spent
    }

    /// A batch deleting `flights` committed.
    pub(crate) fn deleted(&mut self, flights: &[Flight]) {
        for flight in flights {
            self.deleting.remove(flight);
            self.held.remove(flight);
        }
    }

    /// A batch deleting `flights` did not apply: a later one deletes them.
    pub(crate) fn kept(&mut self, flights: &[Flight]) {
        for flight in flights {
            self.deleting.remove(flight);
        }
    }
}

/// A flight record's value: its entries as JSON.
pub(crate) fn encode<'a>(entries: impl IntoIterator<Item = (&'a Mark, u64)>) -> Vec<u8> {
    let rows: Vec<(&str, u64, &str)> =
        entries.into_iter().filter_map(|(mark, token)| Some((kind_letter(mark.kind)?, token, &*mark.name))).collect();
    // Plain strings and numbers always serialise.
    serde_json::to_vec(&rows).unwrap_or_default()
}

/// A flight record's entries; `None` when `value` is not one.
pub(crate) fn decode(value: &[u8]) -> Option<Vec<(Mark, u64)>> {
    let rows: Vec<(String, u64, String)> = serde_json::from_slice(value).ok()?;
    rows.into_iter()
        .map(|(kind, token, name)| {
            let kind = match kind.as_str() {
                "k" => MarkKind::Key,
                "f" => MarkKind::Floor,
                _ => return None,
            };
            Some((Mark::new(kind, name), token))
        })
        .collect()
}

/// The letter of a kind of mark that can be in flight; bindings never are.
fn kind_letter(kind: MarkKind) -> Option<&'static str> {
    match kind {
        MarkKind::Key => Some("k"),
        MarkKind::Floor => Some("f"),
        MarkKind::Upload => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::names::batch_id;
    use super::*;

    fn batch(n: u64) -> Flight {
        Flight::Batch(batch_id(1, n))
    }

    #[test]
    fn a_record_is_spent_once_each_of_its_entries_is_answered_or_named_again() {
        let mut f = Flights::default();
        let now = Instant::now();
        f.committed(&batch_id(1, 1), &[(Mark::key("/a"), 3, false), (Mark::key("/b"), 4, false)], now);
        assert!(f.spent(|_| true).is_empty(), "both writes are in flight");
        f.answered(&Mark::key("/a"));
        assert!(f.spent(|_| true).is_empty(), "/b is still in flight");
        // A later batch names /b again: the first record's entry is spent.
        f.committed(&batch_id(1, 2), &[(Mark::key("/b"), 5, false)], now);
        assert_eq!(f.spent(|_| true), [batch(1)]);
        assert!(f.spent(|_| true).is_empty(), "being deleted");
        f.kept(&[batch(1)]);
        assert_eq!(f.spent(|_| true), [batch(1)], "its delete did not apply: deleted again");
        f.deleted(&[batch(1)]);
        assert_eq!(f.in_flight().collect::<Vec<_>>(), [(&Mark::key("/b"), 5)]);
        f.answered(&Mark::key("/b"));
        assert_eq!(f.spent(|_| true), [batch(2)]);
        f.deleted(&[batch(2)]);
        assert!(f.in_flight().next().is_none() && f.spent(|_| true).is_empty());
        // A batch that put no record (a sweep, a reset) leaves nothing to delete.
        f.committed(&batch_id(1, 3), &[], now);
        assert!(!f.has_spent());
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_still_in_flight_moves_to_a_newer_record_after_a_while() {
        let (a, b, c) = (Mark::key("/a"), Mark::key("/b"), Mark::key("/c"));
        let mut f = Flights::default();
        f.committed(&batch_id(1, 1), &[(a.clone(), 3, false), (b.clone(), 4, false)], Instant::now());
        tokio::time::advance(CARRY_AFTER).await;
        assert!(f.to_carry(Instant::now()).is_empty(), "nothing spent: nothing to gain");
        f.answered(&a);
        assert_eq!(f.to_carry(Instant::now()), [(b.clone(), 4)]);
        f.committed(&batch_id(1, 2), &[(c.clone(), 5, false), (b.clone(), 4, true)], Instant::now());
        assert_eq!(f.spent(|_| true), [batch(1)], "the first record names nothing in flight now");
        // A carried write answered before its batch committed is not named again, and the
        // record that names nothing in flight is deleted like any other.
        f.answered(&c);
        tokio::time::advance(CARRY_AFTER).await;
        assert_eq!(f.to_carry(Instant::now()), [(b.clone(), 4)]);
        f.answered(&b);
        f.committed(&batch_id(1, 3), &[(b.clone(), 4, true)], Instant::now());
        assert!(f.in_flight().next().is_none());
        let mut spent = f.spent(|_| true);
        spent.sort();
        assert_eq!(spent, [batch(2), batch(3)]);
    }

    #[test]
    fn a_takeover_keeps_each_marks_newest_flight() {
        let marker = Flight::Marker(Mark::key("/a"));
        let f = Flights::adopt(vec![
            (batch(2), vec![(Mark::key("/a"), 9), (Mark::key("/c"), 5)]),
            (marker.clone(), vec![(Mark::key("/a"), 7)]),
            (batch(1), vec![(Mark::floor("/d/"), 4)]),
            (batch(3), vec![(Mark::key("/c"), 6)]),
            (batch(4), vec![]),
        ]);
        let mut flying: Vec<_> = f.in_flight().map(|(m, t)| (m.clone(), t)).collect();
        flying.sort();
        assert_eq!(flying, [(Mark::key("/a"), 9), (Mark::key("/c"), 6), (Mark::floor("/d/"), 4)]);
        let mut f = f;
        let mut spent = f.spent(|_| true);
        spent.sort();
        assert_eq!(spent, [marker, batch(4)], "the marker is older than the record naming /a");
    }

    #[test]
    fn records_round_trip_any_name() {
        let entries = vec![(Mark::key("/a\n\"b\""), 3), (Mark::floor("/d/"), u64::MAX)];
        let value = encode(entries.iter().map(|(m, t)| (m, *t)));
        assert_eq!(decode(&value), Some(entries));
        assert_eq!(decode(br#"[["k",1,"/a"]]"#), Some(vec![(Mark::key("/a"), 1)]));
        assert_eq!(decode(br#"[["u",1,"/a"]]"#), None, "a binding is never in flight");
        assert_eq!(decode(b"00000000000000000001"), None);
    }
}
