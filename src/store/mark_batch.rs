//! [`MarkBatch`]: the one shape every change of marks travels to a store in, as raft-engine's
//! `LogBatch` does: what it does ([`Change`]), the token, and its marks. The fence builds it;
//! the file store's writer logs it (one record per mark) and the etcd store's writer turns it
//! into a transaction's operations; both raise the [`Table`] with [`Table::apply`] once it is
//! durable. What either store must refuse in a batch is checked here, once: names a record
//! cannot hold ([`MarkBatch::check`]), and new marks beyond the table's bounds ([`Room`]).
//!
//! A batch of one mark holds it inline, so a write of one key allocates nothing for the list.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::format::MAX_KEY_LEN;
use super::table::mark_bytes;
use super::{Mark, MarkKind, StoreError, StoreFuture, Table};

/// What a [`MarkBatch`] does to its marks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Raises each mark to the token and marks the write in flight: a fenced write's advance,
    /// or an operator's raise.
    Advance,
    /// Sets each mark to the token, lowering it if need be: an operator's reset. Unlike an
    /// advance it counts in log order: recovery applies it after every record before it. Whether
    /// a write is in flight is left as it was.
    Reset,
    /// Notes that the write that advanced each mark to the token has been answered by the
    /// backend, so it is no longer in flight. Need not be durable: if lost, a restart
    /// quarantines the resource once more than needed.
    Answered,
    /// Removes each mark: only bindings ([`MarkKind::Upload`]) of uploads that ended or can
    /// never complete. Keys and floors are never dropped.
    Drop,
}

impl Change {
    /// Whether a batch may make this change to a mark of `kind`: every change to keys and
    /// floors but a drop; to a binding, its advance (which binds it) and its drop.
    pub fn applies_to(self, kind: MarkKind) -> bool {
        match self {
            Change::Advance => true,
            Change::Reset | Change::Answered => kind.is_level(),
            Change::Drop => !kind.is_level(),
        }
    }
}

/// The marks of a batch: one inline, or several.
#[derive(Debug, Clone)]
enum Marks {
    One(Mark),
    Many(Vec<Mark>),
}

/// One change of marks, all to one token, committed whole or not at all.
#[derive(Debug, Clone)]
pub struct MarkBatch {
    change: Change,
    token: u64,
    marks: Marks,
}

impl MarkBatch {
    /// A batch that makes `change` to every mark of `marks`, with `token`.
    pub fn new(change: Change, marks: impl IntoIterator<Item = Mark>, token: u64) -> MarkBatch {
        let mut marks = marks.into_iter();
        let marks = match (marks.next(), marks.next()) {
            (None, _) => Marks::Many(Vec::new()),
            (Some(one), None) => return MarkBatch::one(change, one, token),
            (Some(first), Some(second)) => {
                let mut many = Vec::with_capacity(2 + marks.size_hint().0);
                many.extend([first, second]);
                many.extend(marks);
                Marks::Many(many)
            }
        };
        MarkBatch { change, token, marks }
    }

    /// A batch that makes `change` to `mark` alone, with `token`: the common batch, a write of
    /// one key.
    pub fn one(change: Change, mark: Mark, token: u64) -> MarkBatch {
        MarkBatch { change, token, marks: Marks::One(mark) }
    }

    /// [`Change::Advance`] of `marks` to `token`.
    pub fn advance(marks: impl IntoIterator<Item = Mark>, token: u64) -> MarkBatch {
        MarkBatch::new(Change::Advance, marks, token)
    }

    /// [`Change::Reset`] of `marks` to `token`.
    pub fn reset(marks: impl IntoIterator<Item = Mark>, token: u64) -> MarkBatch {
        MarkBatch::new(Change::Reset, marks, token)
    }

    /// [`Change::Answered`] of the write of `token` to `marks`.
    pub fn answered(marks: impl IntoIterator<Item = Mark>, token: u64) -> MarkBatch {
        MarkBatch::new(Change::Answered, marks, token)
    }

    /// [`Change::Drop`] of the bindings `marks`.
    pub fn drop_bindings(marks: impl IntoIterator<Item = Mark>) -> MarkBatch {
        MarkBatch::new(Change::Drop, marks, 0)
    }

    /// What the batch does.
    pub fn change(&self) -> Change {
        self.change
    }

    /// The token it sets, raises to, or answers.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Its marks.
    pub fn marks(&self) -> &[Mark] {
        match &self.marks {
            Marks::One(mark) => std::slice::from_ref(mark),
            Marks::Many(marks) => marks,
        }
    }

    /// How many marks it names.
    pub fn len(&self) -> usize {
        self.marks().len()
    }

    /// Whether it names none.
    pub fn is_empty(&self) -> bool {
        self.marks().is_empty()
    }

    /// What every store checks before it takes an advance, a reset or a drop: a name a record
    /// cannot hold (empty, or longer than [`MAX_KEY_LEN`]) or a change its kind of mark does
    /// not take ([`Change::applies_to`]: a key or floor is never dropped) refuses the batch
    /// whole, and a mark named twice is one mark (logged once, counted once against the
    /// table's bounds). Returns whether anything is left to commit.
    pub(crate) fn check(&mut self) -> Result<bool, StoreError> {
        let change = self.change;
        let check = |mark: &Mark| {
            if !change.applies_to(mark.kind) {
                return Err(StoreError::Unsupported(format!("a {change:?} of a {:?} mark", mark.kind)));
            }
            check_name(&mark.name)
        };
        match &mut self.marks {
            Marks::One(mark) => check(mark).map(|()| true),
            Marks::Many(marks) => {
                marks.iter().try_for_each(check)?;
                marks.sort_unstable();
                marks.dedup();
                Ok(!marks.is_empty())
            }
        }
    }
}

/// Refuses a name a record cannot hold: empty, or longer than [`MAX_KEY_LEN`].
fn check_name(name: &str) -> Result<(), StoreError> {
    if name.is_empty() || name.len() > MAX_KEY_LEN {
        return Err(StoreError::KeyTooLong(name.len()));
    }
    Ok(())
}

/// The future of a change that has nothing to wait for (an answer, an empty batch): resolved,
/// and boxed without an allocation.
struct Noted;

impl Future for Noted {
    type Output = Result<(), StoreError>;

    fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(Ok(()))
    }
}

/// A [`StoreFuture`] resolved at once, with `Ok`.
pub(crate) fn noted() -> StoreFuture<'static> {
    Box::pin(Noted)
}

/// A [`StoreFuture`] resolved at once, with `error`.
pub(crate) fn refused(error: StoreError) -> StoreFuture<'static> {
    Box::pin(std::future::ready(Err(error)))
}

/// The room the new marks (keys and floors) of a group of batches take beside the table, for
/// the bounds `max_resources` (keys and floors together) and `max_table_bytes`
/// ([`Table::bytes`]).
#[derive(Debug, Default, Clone)]
pub(crate) struct Room {
    marks: usize,
    bytes: u64,
}

impl Room {
    /// Adds what `other` took: the room of batches in flight together.
    pub(crate) fn add(&mut self, other: &Room) {
        self.marks += other.marks;
        self.bytes = self.bytes.saturating_add(other.bytes);
    }

    /// What this room took beyond `earlier`, a copy of it made before: the room of the one
    /// batch taken since.
    pub(crate) fn since(&self, earlier: &Room) -> Room {
        Room { marks: self.marks.saturating_sub(earlier.marks), bytes: self.bytes.saturating_sub(earlier.bytes) }
    }

    /// Counts the marks of `batch` the table does not hold if they fit beside the table and
    /// the group's other new marks; counting every new mark as distinct can only refuse early,
    /// never late. Returns how many new marks the batch names, and whether they fit.
    pub(crate) fn take(
        &mut self,
        table: &Table,
        max_resources: usize,
        batch: &MarkBatch,
    ) -> (usize, Result<(), StoreError>) {
        // Bindings have a bound of their own, which the fence keeps (`s3.max_uploads`).
        let (new, bytes) = batch
            .marks()
            .iter()
            .filter(|mark| mark.kind.is_level() && table.level(mark.borrowed()).is_none())
            .fold((0, 0), |(n, b), mark| (n + 1, b + mark_bytes(&mark.name)));
        if new == 0 {
            return (0, Ok(()));
        }
        if table.len() + table.count(MarkKind::Floor) + self.marks + new > max_resources {
            return (new, Err(StoreError::Full(max_resources)));
        }
        let bytes = self.bytes.saturating_add(bytes);
        if !table.fits(bytes) {
            return (new, Err(StoreError::FullBytes(table.max_bytes())));
        }
        self.marks += new;
        self.bytes = bytes;
        (new, Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_mark_is_held_inline_and_several_are_checked_once() {
        let one = MarkBatch::advance([Mark::key("/a")], 5);
        assert!(matches!(one.marks, Marks::One(_)));
        let mut single = MarkBatch::one(Change::Answered, Mark::floor("/f/"), 2);
        assert!(single.check().unwrap());
        assert_eq!((single.change(), single.token(), single.marks()), (Change::Answered, 2, &[Mark::floor("/f/")][..]));
        assert!(matches!(MarkBatch::one(Change::Reset, Mark::key(""), 1).check(), Err(StoreError::KeyTooLong(0))));
        assert_eq!((one.change(), one.token(), one.marks()), (Change::Advance, 5, &[Mark::key("/a")][..]));
        let mut many = MarkBatch::reset([Mark::key("/b"), Mark::floor("/b"), Mark::key("/b")], 3);
        assert!(many.check().unwrap());
        assert_eq!(many.marks(), [Mark::key("/b"), Mark::floor("/b")], "a mark named twice is one mark");
        assert!(!MarkBatch::answered([], 1).check().unwrap(), "nothing to commit");
        let long = "x".repeat(MAX_KEY_LEN + 1);
        let mut refused = MarkBatch::advance([Mark::key("/c"), Mark::key(long.as_str())], 1);
        assert!(matches!(refused.check(), Err(StoreError::KeyTooLong(n)) if n == MAX_KEY_LEN + 1));
        assert!(matches!(MarkBatch::advance([Mark::key("")], 1).check(), Err(StoreError::KeyTooLong(0))));
    }
}
