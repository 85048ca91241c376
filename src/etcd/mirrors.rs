//! The mirrors a proxy keeps, one per watched prefix, and the one that holds a lock's keys.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Client, Freshness, Mirror, MirrorOptions};

/// A set of mirrors by prefix. Rebuilt on reload from the one before, so that a prefix still
/// wanted keeps its watch.
#[derive(Debug, Default)]
pub struct Mirrors {
    by_prefix: HashMap<Vec<u8>, Arc<Mirror>>,
}

impl Mirrors {
    /// Mirrors of `prefixes`, those `previous` has reused, the others started on the current
    /// runtime with `client`.
    pub fn build(
        client: &Client,
        prefixes: &[Vec<u8>],
        options: &MirrorOptions,
        previous: Option<&Mirrors>,
    ) -> Mirrors {
        let mut by_prefix = HashMap::new();
        for prefix in prefixes {
            let reused = previous.and_then(|p| p.by_prefix.get(prefix)).cloned();
            let mirror =
                reused.unwrap_or_else(|| Arc::new(Mirror::start(client.clone(), prefix.clone(), options.clone())));
            by_prefix.insert(prefix.clone(), mirror);
        }
        Mirrors { by_prefix }
    }

    /// A set of one given mirror: for benchmarks.
    #[doc(hidden)]
    pub fn of(mirror: Mirror) -> Mirrors {
        Mirrors { by_prefix: HashMap::from([(mirror.prefix().to_vec(), Arc::new(mirror))]) }
    }

    /// Each mirror's prefix and the age of its proof of freshness (`None`: not caught up).
    pub fn ages(&self) -> Vec<(String, Option<std::time::Duration>)> {
        self.by_prefix.iter().map(|(p, m)| (String::from_utf8_lossy(p).into_owned(), m.age())).collect()
    }

    /// Whether it mirrors nothing.
    pub fn is_empty(&self) -> bool {
        self.by_prefix.is_empty()
    }

    /// The holder of the lock `name`, from the mirror whose prefix holds `name/`: its create
    /// revision, `None` if nobody holds it; `Err` if no mirror holds the lock's keys or the one
    /// that does is not proven fresh.
    pub fn holder(&self, name: &[u8]) -> Result<Option<i64>, Freshness> {
        let mirror = self.by_prefix.iter().find(|(prefix, _)| name.starts_with(prefix)).map(|(_, m)| m);
        mirror.ok_or(Freshness::NotMirrored)?.holder(name)
    }
}
