//! [`Mark`]: what the store keeps a level for. A mark is a kind ([`MarkKind`]: a key's
//! `max_seen`, a floor, or an upload's binding) and a name, an opaque string to the store; a
//! floor and a key spelled alike are different marks. [`MarkRef`] is the same mark borrowed, which is how the table,
//! the record encoding and the etcd key names read it.

/// The kinds of mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MarkKind {
    /// A key: `max_seen` of one resource.
    Key,
    /// A floor: the highest token of a write that covered everything under the string.
    Floor,
    /// An upload's binding: the token a multipart upload was created with, named by the
    /// object and the upload's id. Unlike the levels of keys and floors, a binding is never in
    /// flight and may be dropped ([`super::Change::Drop`]): losing one only refuses the rest
    /// of its upload.
    Upload,
}

impl MarkKind {
    /// Every kind, in order.
    pub const ALL: [MarkKind; 3] = [MarkKind::Key, MarkKind::Floor, MarkKind::Upload];

    /// Whether marks of this kind are levels that only climb (keys and floors), which a
    /// store must never lose, rather than bindings it may drop.
    pub fn is_level(self) -> bool {
        self != MarkKind::Upload
    }
}

/// One mark, owning its name: what a change sent to the store names.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Mark {
    /// Which kind of mark.
    pub kind: MarkKind,
    /// Its name: a fence key, or the node a floor is at.
    pub name: Box<str>,
}

impl Mark {
    /// The mark of `kind` named `name`.
    pub fn new(kind: MarkKind, name: impl Into<Box<str>>) -> Mark {
        Mark { kind, name: name.into() }
    }

    /// The key `name`.
    pub fn key(name: impl Into<Box<str>>) -> Mark {
        Mark::new(MarkKind::Key, name)
    }

    /// The floor at `name`.
    pub fn floor(name: impl Into<Box<str>>) -> Mark {
        Mark::new(MarkKind::Floor, name)
    }

    /// The binding `name`.
    pub fn upload(name: impl Into<Box<str>>) -> Mark {
        Mark::new(MarkKind::Upload, name)
    }

    /// The same mark, borrowed.
    pub fn borrowed(&self) -> MarkRef<'_> {
        MarkRef { kind: self.kind, name: &self.name }
    }
}

/// One mark, borrowing its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MarkRef<'a> {
    /// Which kind of mark.
    pub kind: MarkKind,
    /// Its name.
    pub name: &'a str,
}

impl<'a> MarkRef<'a> {
    /// The mark of `kind` named `name`.
    pub fn new(kind: MarkKind, name: &'a str) -> MarkRef<'a> {
        MarkRef { kind, name }
    }

    /// The key `name`.
    pub fn key(name: &'a str) -> MarkRef<'a> {
        MarkRef::new(MarkKind::Key, name)
    }

    /// The floor at `name`.
    pub fn floor(name: &'a str) -> MarkRef<'a> {
        MarkRef::new(MarkKind::Floor, name)
    }

    /// The binding `name`.
    pub fn upload(name: &'a str) -> MarkRef<'a> {
        MarkRef::new(MarkKind::Upload, name)
    }

    /// The same mark, owning a copy of its name.
    pub fn to_mark(self) -> Mark {
        Mark::new(self.kind, self.name)
    }
}

impl<'a> From<&'a Mark> for MarkRef<'a> {
    fn from(mark: &'a Mark) -> MarkRef<'a> {
        mark.borrowed()
    }
}
