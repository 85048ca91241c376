//! Slowing down guessed tokens. Under `verify = "etcd"` a token passes if it is the create
//! revision of the lock's holder, and etcd's revisions are small and sequential: without a
//! bound, a client could try 1, 2, 3, … and be accepted within a second. So every client
//! address and every lock has a bucket of refused proofs (`not_lock_holder`) that drains at one
//! per `refill`; a verified write's proof is checked only while both of its buckets hold fewer
//! than `burst`, and otherwise the write gets `429 too_many_refusals` with the time until one
//! more proof is checked (the request path writes that answer: `request::proof`). It is the
//! same whatever the token, so a throttled guess learns nothing. An IPv6 client is counted by
//! its /64, which one host usually has whole.
//!
//! A bucket is one number, the instant it will be empty (the generic cell rate algorithm): a
//! refusal moves it `refill` later, and a proof may be checked while it is less than `burst`
//! refills away. The buckets are a fixed table per scope, a count-min sketch: each address or
//! lock hashes, with seeds drawn at start-up, to one bucket in each of two rows; a refusal fills
//! both, and a write waits only if both are full. So memory is fixed (256 KiB a scope), there
//! is nothing to sweep, and a flood of new addresses or locks cannot push anyone out; a write
//! is held back for others' refusals only if both of its buckets are shared with them, which
//! an attacker who does not know the seeds cannot aim at. Time is tokio's clock, so the tests
//! run on a paused one.

use std::hash::{BuildHasher, Hash, RandomState};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// Buckets in each of a sketch's two rows.
pub const BUCKETS: usize = 1 << 14;

/// How many refused proofs a bucket takes, and how fast it drains; a `burst` of 0 is no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit {
    /// Refusals in a row before proofs wait.
    pub burst: u32,
    /// The time one refusal takes to drain.
    pub refill: Duration,
}

/// The limits in force, per client address and per lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Per client address (an IPv6 one by its /64).
    pub client: Limit,
    /// Per lock, every client's refusals together.
    pub key: Limit,
}

/// Whose refused proofs hold a write back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitedBy {
    /// Its client address's.
    Client,
    /// Its lock's, every client's together.
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

/// One scope's buckets: two rows, each bucket the nanoseconds after `base` at which it is
/// empty.
#[derive(Debug)]
struct Sketch {
    rows: [(RandomState, Box<[AtomicU64]>); 2],
}

impl Sketch {
    fn new() -> Sketch {
        let row = || (RandomState::new(), std::iter::repeat_with(|| AtomicU64::new(0)).take(BUCKETS).collect());
        Sketch { rows: [row(), row()] }
    }

    fn buckets<'a, K: Hash + ?Sized>(&'a self, key: &'a K) -> impl Iterator<Item = &'a AtomicU64> + 'a {
        self.rows.iter().map(move |(seed, row)| {
            // The low bits of a keyed SipHash: uniform, and unknown to clients.
            let at = usize::try_from(seed.hash_one(key) % BUCKETS as u64).unwrap_or(0);
            &row[at]
        })
    }

    /// How long `key` waits now (`now` nanoseconds after the base): the least of its buckets'.
    fn wait<K: Hash + ?Sized>(&self, key: &K, now: u64, limit: Limit) -> Duration {
        if limit.burst == 0 {
            return Duration::ZERO;
        }
        let allowance = nanos(limit.refill).saturating_mul(u64::from(limit.burst - 1));
        let wait = |empty_at: u64| empty_at.saturating_sub(now).saturating_sub(allowance);
        let least = self.buckets(key).map(|b| wait(b.load(Ordering::Relaxed))).min().unwrap_or(0);
        Duration::from_nanos(least)
    }

    /// Counts a refusal against `key` in each of its buckets.
    fn add<K: Hash + ?Sized>(&self, key: &K, now: u64, limit: Limit) {
        if limit.burst == 0 {
            return;
        }
        let refill = nanos(limit.refill);
        for bucket in self.buckets(key) {
            let _ = bucket.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |empty_at| {
                Some(empty_at.max(now).saturating_add(refill))
            });
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// What a client address is counted by: the address, or an IPv6 one's /64.
fn counted(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) if v6.to_ipv4_mapped().is_none() => IpAddr::V6((u128::from(v6) & !u128::from(u64::MAX)).into()),
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

/// Refused proofs by client address and by lock.
#[derive(Debug)]
pub struct Guesses {
    base: Instant,
    clients: Sketch,
    keys: Sketch,
}

impl Default for Guesses {
    fn default() -> Self {
        Guesses { base: Instant::now(), clients: Sketch::new(), keys: Sketch::new() }
    }
}

impl Guesses {
    fn now(&self) -> u64 {
        nanos(Instant::now().saturating_duration_since(self.base))
    }

    /// Refuses a verified write whose proof may not be checked now: too many proofs from
    /// `client` (if it is known) or for `key` were refused lately.
    pub fn admit(&self, client: Option<IpAddr>, key: &str, limits: Limits) -> Result<(), Throttled> {
        let now = self.now();
        let by_client = client.map_or(Duration::ZERO, |ip| self.clients.wait(&counted(ip), now, limits.client));
        let by_key = self.keys.wait(key, now, limits.key);
        let throttled = match by_client >= by_key {
            true => Throttled { by: LimitedBy::Client, retry_after: by_client },
            false => Throttled { by: LimitedBy::Key, retry_after: by_key },
        };
        if throttled.retry_after.is_zero() { Ok(()) } else { Err(throttled) }
    }

    /// Counts a refused proof against `client` (if known) and `key`.
    pub fn refused(&self, client: Option<IpAddr>, key: &str, limits: Limits) {
        let now = self.now();
        if let Some(ip) = client {
            self.clients.add(&counted(ip), now, limits.client);
        }
        self.keys.add(key, now, limits.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CLIENT: Limit = Limit { burst: 3, refill: Duration::from_secs(1) };
    const KEY: Limit = Limit { burst: 5, refill: Duration::from_millis(100) };
    const LIMITS: Limits = Limits { client: CLIENT, key: KEY };
    const NO_KEY_LIMIT: Limits = Limits { client: CLIENT, key: Limit { burst: 0, refill: KEY.refill } };

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
            g.refused(ip(1), "/a", NO_KEY_LIMIT);
        }
        assert_eq!(retry(&g, ip(1), "/b"), Some((Duration::from_secs(1), "client")), "any lock, same client");
        assert_eq!(retry(&g, ip(2), "/a"), None, "another client");
        tokio::time::advance(Duration::from_millis(400)).await;
        assert_eq!(retry(&g, ip(1), "/a"), Some((Duration::from_millis(600), "client")));
        tokio::time::advance(Duration::from_millis(600)).await;
        assert_eq!(retry(&g, ip(1), "/a"), None, "one refusal drained: one more proof");
        g.refused(ip(1), "/a", NO_KEY_LIMIT);
        assert_eq!(retry(&g, ip(1), "/a"), Some((Duration::from_secs(1), "client")));
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(retry(&g, ip(1), "/a"), None, "drained whole");
        g.refused(ip(1), "/a", NO_KEY_LIMIT);
        assert_eq!(retry(&g, ip(1), "/a"), None, "a drained bucket starts from empty, not from its past");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lock_guessed_from_many_addresses_waits_too() {
        let g = Guesses::default();
        for last in 0..5 {
            assert_eq!(retry(&g, ip(last), "/locks/a"), None);
            g.refused(ip(last), "/locks/a", LIMITS);
        }
        assert_eq!(retry(&g, ip(9), "/locks/a"), Some((Duration::from_millis(100), "key")), "a new address");
        assert_eq!(retry(&g, ip(9), "/locks/b"), None, "another lock");
        assert_eq!(retry(&g, None, "/locks/a").map(|r| r.1), Some("key"), "a client not known");
    }

    #[tokio::test(start_paused = true)]
    async fn an_ipv6_client_is_counted_by_its_slash_64() {
        let g = Guesses::default();
        let v6 = |s: &str| Some(s.parse::<IpAddr>().unwrap());
        for n in 0..3 {
            g.refused(v6(&format!("2001:db8:1:2::{n}")), &format!("/{n}"), NO_KEY_LIMIT);
        }
        assert!(retry(&g, v6("2001:db8:1:2:ffff::9"), "/x").is_some(), "the same /64");
        assert_eq!(retry(&g, v6("2001:db8:1:3::1"), "/x"), None, "another /64");
        for _ in 0..3 {
            g.refused(v6("::ffff:127.0.0.7"), "/y", NO_KEY_LIMIT);
        }
        assert!(retry(&g, ip(7), "/x").is_some(), "an IPv4-mapped address is its IPv4 one");
    }

    #[tokio::test(start_paused = true)]
    async fn no_limit_with_a_burst_of_zero() {
        let g = Guesses::default();
        let off = Limits { client: Limit { burst: 0, ..CLIENT }, key: Limit { burst: 0, ..KEY } };
        for _ in 0..100 {
            assert!(g.admit(ip(1), "/a", off).is_ok());
            g.refused(ip(1), "/a", off);
        }
        assert_eq!(g.admit(ip(1), "/a", LIMITS), Ok(()), "nothing was counted");
    }

    #[tokio::test(start_paused = true)]
    async fn a_flood_holds_back_a_lock_only_where_both_its_buckets_filled_and_memory_is_fixed() {
        let g = Guesses::default();
        let limits =
            Limits { client: Limit { burst: 0, ..CLIENT }, key: Limit { burst: 2, refill: Duration::from_secs(60) } };
        // Two refusals (the burst) each for as many locks as a row has buckets: a bucket is full
        // where one of them landed, 1 - 1/e of them, and an untouched lock waits only where
        // both of its are, (1 - 1/e)^2, about 40%.
        for n in 0..BUCKETS {
            for _ in 0..2 {
                g.refused(None, &format!("/locks/{n}"), limits);
            }
        }
        assert!(g.admit(None, "/locks/0", limits).is_err(), "a lock that was guessed waits");
        let held: usize = (0..1000).filter(|n| g.admit(None, &format!("/other/{n}"), limits).is_err()).count();
        assert!((250..550).contains(&held), "{held} of 1000 untouched locks held back");
        let (rows, buckets) = (g.keys.rows.len(), g.keys.rows[0].1.len());
        assert_eq!((rows, buckets), (2, BUCKETS), "nothing grows");
    }
}
