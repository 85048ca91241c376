//! Pins: what the fence last learnt of the backend's state of each key whose writes are sent
//! with a precondition (docs/pins.md).
//!
//! A pin is read and set only under its key's turn, so no write through this fence moves the
//! backend's state between learning it and using it. The table is a cache: a key without a
//! pin reads as unknown, which is always safe (the write learns the state first), so it is
//! bounded, kept in memory only, and emptied when a new term begins.

use std::sync::atomic::{AtomicUsize, Ordering};

use dashmap::DashMap;

use super::tree::{Coverage, Touch, node};

/// Most pins kept; beyond it, some other key's pin is forgotten (it is learnt again when that
/// key is next written). About 100 bytes a pin with its key, so at most some 10 MB.
pub const MAX_PINS: usize = 100_000;

/// What the backend's state of a key was when last learnt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pin {
    /// The key exists, with this strong entity tag (with its quotes, as the backend wrote it).
    Tag(Box<str>),
    /// The key does not exist.
    Absent,
}

/// The pins of keys, bounded by [`MAX_PINS`].
#[derive(Debug, Default)]
pub(super) struct Pins {
    map: DashMap<Box<str>, Pin, foldhash::quality::RandomState>,
    /// Pins held; read before any map work, so that a fence without pins pays one load.
    held: AtomicUsize,
}

impl Pins {
    /// The pin of `key`, if one is known.
    pub(super) fn get(&self, key: &str) -> Option<Pin> {
        if self.held.load(Ordering::Relaxed) == 0 {
            return None;
        }
        self.map.get(key).map(|p| p.value().clone())
    }

    /// Pins `key` to `pin`, forgetting another key's pin when the table is full.
    pub(super) fn set(&self, key: &str, pin: Pin) {
        if self.held.load(Ordering::Relaxed) >= MAX_PINS && !self.map.contains_key(key) {
            let other = self.map.iter().next().map(|e| e.key().clone());
            if let Some(other) = other {
                self.forget(&other);
            }
        }
        if self.map.insert(key.into(), pin).is_none() {
            self.held.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Forgets the pin of `key`: its state is unknown.
    pub(super) fn forget(&self, key: &str) {
        if self.held.load(Ordering::Relaxed) > 0 && self.map.remove(key).is_some() {
            self.held.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Forgets the pins of `node` and of every key under it (`node` ends with `/`).
    pub(super) fn forget_under(&self, node: &str) {
        if self.held.load(Ordering::Relaxed) == 0 {
            return;
        }
        let under: Vec<Box<str>> =
            self.map.iter().filter(|e| e.key().starts_with(node)).map(|e| e.key().clone()).collect();
        for key in under {
            self.forget(&key);
        }
    }

    /// Forgets the pins of every key a write of `touches` may change.
    pub(super) fn forget_touched(&self, touches: &[Touch]) {
        if self.held.load(Ordering::Relaxed) == 0 {
            return;
        }
        for touch in touches {
            self.forget(&touch.key);
            if touch.coverage == Coverage::Subtree {
                self.forget_under(node(&touch.key));
            }
        }
    }

    /// Forgets every pin.
    pub(super) fn clear(&self) {
        let keys: Vec<Box<str>> = self.map.iter().map(|e| e.key().clone()).collect();
        for key in keys {
            self.forget(&key);
        }
    }

    /// Pins held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pin_is_kept_until_forgotten_and_the_table_is_bounded() {
        let pins = Pins::default();
        assert_eq!(pins.get("/a"), None, "unknown until learnt");
        pins.set("/a", Pin::Tag("\"1\"".into()));
        pins.set("/a", Pin::Absent);
        assert_eq!((pins.get("/a"), pins.len()), (Some(Pin::Absent), 1), "set again, held once");
        pins.set("/d/x", Pin::Absent);
        pins.set("/d/y", Pin::Absent);
        pins.forget_under("/d/");
        assert_eq!((pins.get("/d/x"), pins.get("/a"), pins.len()), (None, Some(Pin::Absent), 1));
        pins.forget("/a");
        assert_eq!((pins.get("/a"), pins.len()), (None, 0));
        for i in 0..MAX_PINS + 10 {
            pins.set(&format!("/k{i}"), Pin::Absent);
        }
        assert_eq!(pins.len(), MAX_PINS, "bounded");
        assert_eq!(pins.map.len(), MAX_PINS);
        pins.clear();
        assert_eq!((pins.len(), pins.map.len()), (0, 0));
    }
}
