//! Slowing down guessed tokens. Under `verify = "etcd"` a token passes if it is the create
//! revision of the lock's holder, and etcd's revisions are small and sequential: without a
//! bound, a client could try 1, 2, 3, … and be accepted within a second. So every client
//! address and every fence key has a bucket of refused proofs (`not_lock_holder`,
//! `signature_rejected`) that drains at one per `refill`; a verified write's proof is checked
//! only while both of its buckets hold fewer than `burst`, and otherwise the write gets
//! `429 too_many_refusals` with the time until one more proof is checked (the request path
//! writes that answer: `request::verify`). It is the same whatever the token, so a throttled
//! guess learns nothing.
//!
//! The key's bucket also slows down guessers who spread over many addresses, at a price: while
//! it is full the key's own holder is answered 429 too (service degrades, the fence does not).
//! Verification is not authentication: where clients are not trusted, signed tokens or client
//! certificates keep them from writing at all (docs/tokens.md).
//!
//! Memory is bounded. Only refusals make entries; each map holds at most [`MAX_TRACKED`], and
//! past that the drained ones are swept and, if it is still full, every newcomer shares one
//! overflow bucket, so a flood of new addresses or keys throttles itself rather than grow the
//! map. Time is tokio's clock, so the tests run on a paused one.

use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use dashmap::DashMap;
use tokio::time::Instant;

/// Entries a map keeps before it sweeps drained ones and then sends newcomers to the overflow.
pub const MAX_TRACKED: usize = 65_536;

/// How many refused proofs a bucket takes, and how fast it drains; a `burst` of 0 is no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// Refusals in a row before proofs wait.
    pub burst: u32,
    /// The time one refusal takes to drain.
    pub refill: Duration,
}

/// Refusals not yet drained, as of `at`.
#[derive(Debug, Clone, Copy)]
struct Bucket {
    refused: f64,
    at: Instant,
}

impl Bucket {
    fn level(&self, now: Instant, limit: Limit) -> f64 {
        let drained = now.saturating_duration_since(self.at).as_secs_f64() / limit.refill.as_secs_f64();
        (self.refused - drained).max(0.0)
    }

    /// How long until a proof may be checked again; zero if one may now.
    fn wait(&self, now: Instant, limit: Limit) -> Duration {
        let over = self.level(now, limit) - f64::from(limit.burst) + 1.0;
        if over <= 0.0 { Duration::ZERO } else { limit.refill.mul_f64(over) }
    }

    fn add(&mut self, now: Instant, limit: Limit) {
        self.refused = self.level(now, limit) + 1.0;
        self.at = now;
    }
}

/// The buckets of one scope (client addresses, or keys).
#[derive(Debug)]
struct Buckets<K: Hash + Eq> {
    map: DashMap<K, Bucket>,
    overflow: Mutex<Option<Bucket>>,
}

impl<K: Hash + Eq> Default for Buckets<K> {
    fn default() -> Self {
        Buckets { map: DashMap::new(), overflow: Mutex::new(None) }
    }
}

impl<K: Hash + Eq> Buckets<K> {
    fn wait<Q>(&self, key: &Q, now: Instant, limit: Limit) -> Duration
    where
        K: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        if limit.burst == 0 {
            return Duration::ZERO;
        }
        match self.map.get(key) {
            Some(bucket) => bucket.wait(now, limit),
            // The overflow holds back only those the map has no room for.
            None => {
                self.overflow.lock().unwrap_or_else(|e| e.into_inner()).map_or(Duration::ZERO, |b| b.wait(now, limit))
            }
        }
    }

    fn add(&self, key: K, now: Instant, limit: Limit) {
        if limit.burst == 0 {
            return;
        }
        if let Some(mut bucket) = self.map.get_mut(&key) {
            bucket.add(now, limit);
            return;
        }
        if self.map.len() >= MAX_TRACKED {
            self.map.retain(|_, b| b.level(now, limit) > 0.0);
        }
        if self.map.len() >= MAX_TRACKED {
            let mut overflow = self.overflow.lock().unwrap_or_else(|e| e.into_inner());
            overflow.get_or_insert(Bucket { refused: 0.0, at: now }).add(now, limit);
            return;
        }
        let mut bucket = Bucket { refused: 0.0, at: now };
        bucket.add(now, limit);
        self.map.insert(key, bucket);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
    }
}

/// Whose refused proofs hold a write back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitedBy {
    /// Its client address's.
    Client,
    /// Its key's, every client's together.
    Key,
}

impl LimitedBy {
    /// Its name in metrics.
    pub fn name(self) -> &'static str {
        match self {
            LimitedBy::Client => "client",
            LimitedBy::Key => "key",
        }
    }
}

/// A write held back: by whose refusals, and until when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Throttled {
    /// Whose refusals.
    pub by: LimitedBy,
    /// How long until one more proof is checked.
    pub retry_after: Duration,
}

/// Refused proofs by client address and by key.
#[derive(Debug, Default)]
pub struct Guesses {
    clients: Buckets<IpAddr>,
    keys: Buckets<Box<str>>,
}

/// The limits in force, per client address and per key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Per client address.
    pub client: Limit,
    /// Per key.
    pub key: Limit,
}

impl Guesses {
    /// Refuses a verified write whose proof may not be checked now: too many proofs from
    /// `client` (if it is known here) or for `key` were refused lately.
    pub fn admit(&self, client: Option<IpAddr>, key: &str, limits: Limits) -> Result<(), Throttled> {
        let now = Instant::now();
        let by_client = client.map_or(Duration::ZERO, |ip| self.clients.wait(&ip, now, limits.client));
        let by_key = self.keys.wait(key, now, limits.key);
        let throttled = match by_client >= by_key {
            true => Throttled { by: LimitedBy::Client, retry_after: by_client },
            false => Throttled { by: LimitedBy::Key, retry_after: by_key },
        };
        if throttled.retry_after.is_zero() { Ok(()) } else { Err(throttled) }
    }

    /// Counts a refused proof against `client` (if known here) and `key`.
    pub fn refused(&self, client: Option<IpAddr>, key: &str, limits: Limits) {
        let now = Instant::now();
        if let Some(ip) = client {
            self.clients.add(ip, now, limits.client);
        }
        self.keys.add(key.into(), now, limits.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLIENT: Limit = Limit { burst: 3, refill: Duration::from_secs(1) };
    const KEY: Limit = Limit { burst: 5, refill: Duration::from_millis(100) };
    const LIMITS: Limits = Limits { client: CLIENT, key: KEY };

    fn ip(last: u8) -> Option<IpAddr> {
        Some(IpAddr::from([127, 0, 0, last]))
    }

    fn retry(g: &Guesses, client: Option<IpAddr>, key: &str) -> Option<(Duration, &'static str)> {
        g.admit(client, key, LIMITS).err().map(|t| (t.retry_after, t.by.name()))
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_past_its_burst_waits_for_one_refill_per_refusal() {
        let g = Guesses::default();
        for _ in 0..3 {
            assert_eq!(retry(&g, ip(1), "/a"), None);
            g.refused(ip(1), "/a", Limits { key: Limit { burst: 0, ..KEY }, ..LIMITS });
        }
        assert_eq!(retry(&g, ip(1), "/b"), Some((Duration::from_secs(1), "client")), "any key, same client");
        assert_eq!(retry(&g, ip(2), "/a"), None, "another client");
        tokio::time::advance(Duration::from_millis(400)).await;
        assert_eq!(retry(&g, ip(1), "/a"), Some((Duration::from_millis(600), "client")));
        tokio::time::advance(Duration::from_millis(600)).await;
        assert_eq!(retry(&g, ip(1), "/a"), None, "one refusal drained: one more proof");
        g.refused(ip(1), "/a", Limits { key: Limit { burst: 0, ..KEY }, ..LIMITS });
        assert_eq!(retry(&g, ip(1), "/a"), Some((Duration::from_secs(1), "client")));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(retry(&g, ip(1), "/a"), None, "drained whole");
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_guessed_from_many_addresses_waits_too() {
        let g = Guesses::default();
        for last in 0..5 {
            assert_eq!(retry(&g, ip(last), "/a"), None);
            g.refused(ip(last), "/a", LIMITS);
        }
        assert_eq!(retry(&g, ip(9), "/a"), Some((Duration::from_millis(100), "key")), "a new address");
        assert_eq!(retry(&g, ip(9), "/b"), None, "another key");
        assert_eq!(retry(&g, None, "/a").map(|r| r.1), Some("key"), "a client not known here");
    }

    #[tokio::test(start_paused = true)]
    async fn no_limit_with_a_burst_of_zero() {
        let g = Guesses::default();
        let off = Limits { client: Limit { burst: 0, ..CLIENT }, key: Limit { burst: 0, ..KEY } };
        for _ in 0..100 {
            assert!(g.admit(ip(1), "/a", off).is_ok());
            g.refused(ip(1), "/a", off);
        }
        assert_eq!((g.clients.len(), g.keys.len()), (0, 0), "nothing tracked");
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_of_newcomers_shares_one_bucket_and_the_map_stays_bounded() {
        let g = Guesses::default();
        let limits =
            Limits { client: Limit { burst: 0, ..CLIENT }, key: Limit { burst: 2, refill: Duration::from_secs(60) } };
        for n in 0..MAX_TRACKED {
            g.refused(None, &format!("/k{n}"), limits);
        }
        assert_eq!(g.keys.len(), MAX_TRACKED);
        assert!(g.admit(None, "/new", limits).is_ok(), "the overflow is empty");
        g.refused(None, "/new1", limits);
        g.refused(None, "/new2", limits);
        assert_eq!(g.keys.len(), MAX_TRACKED, "bounded");
        assert!(g.admit(None, "/new3", limits).is_err(), "newcomers share the overflow's burst");
        assert!(g.admit(None, "/k0", limits).is_ok(), "a tracked key has its own bucket");
        tokio::time::advance(Duration::from_secs(3600)).await;
        g.refused(None, "/later", limits);
        assert_eq!(g.keys.len(), 1, "drained entries are swept when the map is full");
    }
}
