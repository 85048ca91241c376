//! [`Flights`]: the leader's writes that the backend may not have answered yet, as etcd holds
//! them, so that a new leader quarantines their resources.
//!
//! Each batch that lets writes go puts one **flight record**, `P/w/<batch id>`, naming the
//! marks it advanced (keys and floors) with their tokens, in the same transaction as their
//! levels. A mark's newest record is the one that counts: an entry is spent when the backend
//! answers that write, or when a later committed record names the mark. A record with every
//! entry spent is deleted by a later batch. So a write costs etcd one operation (its level)
//! where a marker of its own cost two more (put, then delete when answered), and an answer
//! costs etcd nothing until its whole record is spent.
//!
//! A record outlives the answers of most of its writes while one is still in flight, so a
//! takeover may quarantine a resource whose write was answered: never the reverse.
//!
//! Prefixes written by builds before flight records hold one **marker** per mark in flight
//! (`P/i/<key>`, `P/if/<floor>`): a takeover reads them as the oldest records, each of one
//! entry, and they are deleted like records once spent.
//!
//! The record's value is JSON, `[["k",34,"/a"],["f",7,"/d/"]]` (kind, token, name), readable
//! with `etcdctl get` and safe for any name.

use std::collections::{HashMap, HashSet};

use crate::store::{Mark, MarkKind};

/// Where a write in flight is recorded in etcd.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Flight {
    /// A marker of one mark, as builds before flight records wrote them: older than any record.
    Marker(Mark),
    /// The flight record of the batch with this id.
    Batch(Vec<u8>),
}

/// The writes in flight of one leadership, by flight, and which flights are spent.
#[derive(Debug, Clone, Default)]
pub(crate) struct Flights {
    /// Each mark in flight: the flight naming its newest write, and that write's token.
    flying: HashMap<Mark, (Flight, u64)>,
    /// Each flight in etcd, with how many marks it is still the newest flight of.
    live: HashMap<Flight, usize>,
    /// Spent flights that a batch in flight deletes.
    deleting: HashSet<Flight>,
}

impl Flights {
    /// What a takeover read: every `(flight, mark, token)` entry, in any order. Markers are
    /// older than records, and records are as old as their batch ids (zero-padded, so byte
    /// order is numeric order).
    pub(crate) fn adopt(mut entries: Vec<(Flight, Mark, u64)>) -> Flights {
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let mut flights = Flights::default();
        for (flight, mark, token) in entries {
            flights.live.entry(flight.clone()).or_insert(0);
            flights.name(mark, flight, token);
        }
        flights
    }

    /// Makes `flight` the newest flight of `mark`, spending the entry of the one before.
    fn name(&mut self, mark: Mark, flight: Flight, token: u64) {
        *self.live.entry(flight.clone()).or_insert(0) += 1;
        if let Some((older, _)) = self.flying.insert(mark, (flight, token)) {
            self.spend(&older);
        }
    }

    fn spend(&mut self, flight: &Flight) {
        if let Some(live) = self.live.get_mut(flight) {
            *live = live.saturating_sub(1);
        }
    }

    /// Each mark in flight, with the token of its newest write.
    pub(crate) fn in_flight(&self) -> impl Iterator<Item = (&Mark, u64)> {
        self.flying.iter().map(|(mark, (_, token))| (mark, *token))
    }

    /// The batch `id` committed with a record of `entries`: it is now the newest flight of
    /// each of their marks.
    pub(crate) fn committed(&mut self, id: &[u8], entries: &[(Mark, u64)]) {
        for (mark, token) in entries {
            self.name(mark.clone(), Flight::Batch(id.to_vec()), *token);
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
        self.live.iter().any(|(flight, live)| *live == 0 && !self.deleting.contains(flight))
    }

    /// Up to `most` spent flights for the next batch to delete, which are deleting from then
    /// on: [`Flights::deleted`] once that batch committed, [`Flights::kept`] if it did not.
    pub(crate) fn spent(&mut self, most: usize) -> Vec<Flight> {
        let spent: Vec<Flight> = self
            .live
            .iter()
            .filter(|(flight, live)| **live == 0 && !self.deleting.contains(*flight))
            .map(|(flight, _)| flight.clone())
            .take(most)
            .collect();
        self.deleting.extend(spent.iter().cloned());
        spent
    }

    /// A batch deleting `flights` committed.
    pub(crate) fn deleted(&mut self, flights: &[Flight]) {
        for flight in flights {
            self.deleting.remove(flight);
            self.live.remove(flight);
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
pub(crate) fn encode(entries: &[(Mark, u64)]) -> Vec<u8> {
    let rows: Vec<(&str, u64, &str)> =
        entries.iter().filter_map(|(mark, token)| Some((kind_letter(mark.kind)?, *token, &*mark.name))).collect();
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
    use super::*;

    fn batch(n: u64) -> Flight {
        Flight::Batch(super::super::names::batch_id(1, n))
    }

    #[test]
    fn a_record_is_spent_once_each_of_its_entries_is_answered_or_named_again() {
        let mut f = Flights::default();
        f.committed(&super::super::names::batch_id(1, 1), &[(Mark::key("/a"), 3), (Mark::key("/b"), 4)]);
        assert!(f.spent(10).is_empty(), "both writes are in flight");
        f.answered(&Mark::key("/a"));
        assert!(f.spent(10).is_empty(), "/b is still in flight");
        // A later batch names /b again: the first record's entry is spent.
        f.committed(&super::super::names::batch_id(1, 2), &[(Mark::key("/b"), 5)]);
        assert_eq!(f.spent(10), [batch(1)]);
        assert!(f.spent(10).is_empty(), "being deleted");
        f.kept(&[batch(1)]);
        assert_eq!(f.spent(10), [batch(1)], "its delete did not apply: deleted again");
        f.deleted(&[batch(1)]);
        assert_eq!(f.in_flight().collect::<Vec<_>>(), [(&Mark::key("/b"), 5)]);
        f.answered(&Mark::key("/b"));
        assert_eq!(f.spent(10), [batch(2)]);
        f.deleted(&[batch(2)]);
        assert!(f.in_flight().next().is_none() && f.spent(10).is_empty());
    }

    #[test]
    fn a_takeover_keeps_each_marks_newest_flight() {
        let marker = Flight::Marker(Mark::key("/a"));
        let f = Flights::adopt(vec![
            (batch(2), Mark::key("/a"), 9),
            (marker.clone(), Mark::key("/a"), 7),
            (batch(1), Mark::floor("/d/"), 4),
            (batch(2), Mark::key("/c"), 5),
            (batch(3), Mark::key("/c"), 6),
        ]);
        let mut flying: Vec<_> = f.in_flight().map(|(m, t)| (m.clone(), t)).collect();
        flying.sort();
        assert_eq!(flying, [(Mark::key("/a"), 9), (Mark::key("/c"), 6), (Mark::floor("/d/"), 4)]);
        let mut f = f;
        let mut spent = f.spent(10);
        spent.sort();
        assert_eq!(spent, [marker], "the marker is older than the record naming /a");
    }

    #[test]
    fn records_round_trip_any_name() {
        let entries = vec![(Mark::key("/a\n\"b\""), 3), (Mark::floor("/d/"), u64::MAX)];
        let value = encode(&entries);
        assert_eq!(decode(&value), Some(entries));
        assert_eq!(decode(br#"[["k",1,"/a"]]"#), Some(vec![(Mark::key("/a"), 1)]));
        assert_eq!(decode(br#"[["u",1,"/a"]]"#), None, "a binding is never in flight");
        assert_eq!(decode(b"00000000000000000001"), None);
    }
}
