//! Pins: what the fence last learnt of the backend's state of each key whose writes are sent
//! with a precondition (docs/pins.md).
//!
//! A pin is read and set only under its key's turn, so no write through this fence moves the
//! backend's state between learning it and using it. The table is a cache: a key without a
//! pin reads as unknown, which is always safe (the write learns the state first), so it is
//! bounded, kept in memory only, and emptied when a new term begins.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{PoisonError, RwLock, RwLockWriteGuard};

use super::tree::{Coverage, Touch, node};

/// Most pins kept; beyond it, some other key's pin is forgotten (it is learnt again when that
/// key is next written). About 100 bytes a pin with its key, so at most some 10 MB.
pub const MAX_PINS: usize = 100_000;

/// What the backend's state of a key was when last learnt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pin {
    /// The key exists, with this strong entity tag (with its quotes, as the backend wrote it).
    /// Shared: a write reads it, sends it and keeps it for its answer without copying it.
    Tag(Arc<str>),
    /// The key does not exist.
    Absent,
}

/// The pins of keys, bounded by [`MAX_PINS`]. Hashed (with foldhash, as the table of marks
/// is): a pinned write looks its key up twice, to read its pin and to set it from the answer.
/// A subtree write forgets the pins under it by a scan of every pin, at most [`MAX_PINS`].
#[derive(Debug, Default)]
pub(super) struct Pins {
    map: RwLock<Map>,
    /// Pins held, set under the write lock; read before any lock, so that a fence without pins
    /// pays one load.
    held: AtomicUsize,
}

type Map = HashMap<Box<str>, Pin, foldhash::quality::RandomState>;

impl Pins {
    /// The pin of `key`, if one is known.
    pub(super) fn get(&self, key: &str) -> Option<Pin> {
        if self.held.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.map.read().unwrap_or_else(PoisonError::into_inner).get(key).cloned()
    }

    /// Pins `key` to `pin`, forgetting another key's pin when the table is full.
    pub(super) fn set(&self, key: &str, pin: Pin) {
        let mut map = self.write();
        if let Some(kept) = map.get_mut(key) {
            *kept = pin;
            return;
        }
        if map.len() >= MAX_PINS
            && let Some(other) = map.keys().next().cloned()
        {
            map.remove(&other);
        }
        map.insert(key.into(), pin);
        self.held.store(map.len(), Ordering::Release);
    }

    /// Forgets the pin of `key`: its state is unknown.
    pub(super) fn forget(&self, key: &str) {
        if self.held.load(Ordering::Acquire) > 0 {
            let mut map = self.write();
            map.remove(key);
            self.held.store(map.len(), Ordering::Release);
        }
    }

    /// Forgets the pins of `node` and of every key under it (`node` ends with `/`).
    pub(super) fn forget_under(&self, node: &str) {
        if self.held.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut map = self.write();
        map.retain(|key, _| !key.starts_with(node));
        self.held.store(map.len(), Ordering::Release);
    }

    /// Forgets the pins of every key a write of `touches` may change.
    pub(super) fn forget_touched(&self, touches: &[Touch]) {
        if self.held.load(Ordering::Acquire) == 0 {
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
        let mut map = self.write();
        map.clear();
        self.held.store(0, Ordering::Release);
    }

    /// Pins held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.held.load(Ordering::Acquire)
    }

    fn write(&self) -> RwLockWriteGuard<'_, Map> {
        self.map.write().unwrap_or_else(PoisonError::into_inner)
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
        assert_eq!(pins.write().len(), MAX_PINS);
        pins.clear();
        assert_eq!((pins.len(), pins.write().len()), (0, 0));
    }
}
