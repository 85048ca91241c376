//! The table read in order, for people: the keys with the highest tokens (`fencegate
//! inspect`), and the keys under a prefix one page at a time (the admin API's `GET /fences`).
//! The table is a hash map, so each is one pass over it, keeping only the entries it returns.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{MarkKind, Table};

/// One key of a page: its name, `max_seen`, and whether a write to it is in flight.
pub type Listed = (String, u64, bool);

impl Table {
    /// The `n` keys with the highest tokens, highest first.
    pub fn top(&self, n: usize) -> Vec<(String, u64)> {
        let mut heap = BinaryHeap::new();
        self.for_each(MarkKind::Key, |k, t, _| {
            if heap.len() < n || heap.peek().is_some_and(|Reverse((min, _))| t > *min) {
                heap.push(Reverse((t, k.to_owned())));
                if heap.len() > n {
                    heap.pop();
                }
            }
        });
        let mut top: Vec<_> = heap.into_iter().map(|Reverse((t, k))| (k, t)).collect();
        top.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        top
    }

    /// At most `limit` keys that start with `prefix` and sort after `after`, in byte order:
    /// the page that follows `after`. Memory follows `limit`, not the table.
    pub fn page(&self, prefix: &str, after: Option<&str>, limit: usize) -> Vec<Listed> {
        // A max-heap by name holds the `limit` smallest names seen so far.
        let mut heap: BinaryHeap<(String, u64, bool)> = BinaryHeap::new();
        self.for_each(MarkKind::Key, |k, t, flying| {
            if !k.starts_with(prefix) || after.is_some_and(|a| k <= a) || limit == 0 {
                return;
            }
            if heap.len() < limit || heap.peek().is_some_and(|(max, _, _)| k < max.as_str()) {
                heap.push((k.to_owned(), t, flying));
                if heap.len() > limit {
                    heap.pop();
                }
            }
        });
        heap.into_sorted_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MarkRef;

    #[test]
    fn pages_follow_each_other_in_byte_order_under_a_prefix() {
        let t = Table::new();
        for (i, k) in ["/a/3", "/a/1", "/b/1", "/a/2", "/a", "/a/10"].into_iter().enumerate() {
            t.raise(MarkRef::key(k), i as u64);
        }
        t.advance(MarkRef::key("/a/2"), 9);
        let names = |page: Vec<Listed>| page.into_iter().map(|(k, _, _)| k).collect::<Vec<_>>();
        assert_eq!(names(t.page("/a/", None, 2)), ["/a/1", "/a/10"]);
        assert_eq!(t.page("/a/", Some("/a/10"), 2), [("/a/2".into(), 9, true), ("/a/3".into(), 0, false)]);
        assert!(t.page("/a/", Some("/a/3"), 2).is_empty());
        assert_eq!(names(t.page("", None, 10)).len(), 6);
        assert!(t.page("/", None, 0).is_empty());
    }
}
