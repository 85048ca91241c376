//! Slowing down guessed tokens. Under `verify = "etcd"` a token passes if it is the create
//! revision of the lock's holder, and etcd's revisions are small and sequential: without a
//! bound, a client could try 1, 2, 3, … and be accepted within a second. So every client
//! address and every fence key has a bucket of refused proofs (`not_lock_holder`,
//! `signature_rejected`) that drains at one per `refill`; a verified write's proof is checked
//! only while both of its buckets hold fewer than `burst`, and otherwise the write gets
//! `429 too_many_refusals` with the time until one more proof is checked. That answer is the
//! same whatever the token, so a throttled guess learns nothing.
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

use http::{Request, Response};

use super::classify::Plan;
use super::refusal::{ERROR_HEADER, Refusal};
use super::{ResponseBody, leader};
use crate::app::{Settings, State};
use crate::upstream::Peer;

/// Entries a map keeps before it sweeps drained ones and then sends newcomers to the overflow.
pub(crate) const MAX_TRACKED: usize = 65_536;

/// How many refused proofs a bucket takes, and how fast it drains; a `burst` of 0 is no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limit {
    /// Refusals in a row before proofs wait.
    pub(crate) burst: u32,
    /// The time one refusal takes to drain.
    pub(crate) refill: Duration,
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

/// Refused proofs by client address and by key.
#[derive(Debug, Default)]
pub(crate) struct Guesses {
    clients: Buckets<IpAddr>,
    keys: Buckets<Box<str>>,
}

/// The limits in force, per client address and per key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub(crate) client: Limit,
    pub(crate) key: Limit,
}

impl Guesses {
    /// Refuses a verified write whose proof may not be checked now: too many proofs from
    /// `client` (if it is known here) or for `key` were refused lately.
    pub(crate) fn admit(
        &self,
        client: Option<IpAddr>,
        key: &str,
        limits: Limits,
    ) -> Result<(), (Refusal, &'static str)> {
        let now = Instant::now();
        let by_client = client.map_or(Duration::ZERO, |ip| self.clients.wait(&ip, now, limits.client));
        let by_key = self.keys.wait(key, now, limits.key);
        let (retry_after, scope, whose) = match by_client >= by_key {
            true => (by_client, "client", "from this client".to_owned()),
            false => (by_key, "key", format!("for {key}")),
        };
        if retry_after.is_zero() {
            return Ok(());
        }
        Err((Refusal::TooManyRefusals { scope: whose, resource: key.to_owned(), retry_after }, scope))
    }

    /// Counts a refused proof against `client` (if known here) and `key`.
    pub(crate) fn refused(&self, client: Option<IpAddr>, key: &str, limits: Limits) {
        let now = Instant::now();
        if let Some(ip) = client {
            self.clients.add(ip, now, limits.client);
        }
        self.keys.add(key.into(), now, limits.key);
    }
}

/// Whether a refusal says that a verified write's proof was checked and failed: what a guess
/// gets.
pub(crate) fn is_refused_proof(code: &str) -> bool {
    matches!(code, "not_lock_holder" | "signature_rejected")
}

/// A verified write, as the limits see it: who sent it and the first key it touches.
#[derive(Debug)]
pub(super) struct Guess {
    /// The client's address; `None` for a write another instance of a shared fence sent on,
    /// whose client that instance counts.
    client: Option<IpAddr>,
    key: String,
    limits: Limits,
}

impl Guess {
    /// The guess a plan makes, if it is a verified write. `shared` says whether this instance
    /// shares its fence with others, the only case where a write may come from a peer: a
    /// single instance charges a write that claims so to its own client.
    pub(super) fn of<B>(
        plan: &Plan,
        req: &Request<B>,
        client: &Peer,
        settings: &Settings,
        shared: bool,
    ) -> Option<Guess> {
        let Plan::Write(write) = plan else { return None };
        if matches!(write.proof, super::verify::Proof::None) && write.locks.is_empty() {
            return None;
        }
        let verify = &settings.config.verify;
        let limits = Limits {
            client: Limit { burst: verify.client_refusal_burst, refill: verify.client_refusal_refill },
            key: Limit { burst: verify.key_refusal_burst, refill: verify.key_refusal_refill },
        };
        let sent_on = shared && req.headers().contains_key(&leader::FORWARDED_BY);
        let client = (!sent_on).then_some(client.addr.ip());
        Some(Guess { client, key: write.touches.first()?.key.clone(), limits })
    }

    /// Refuses the write unchecked if its client or key had too many proofs refused lately.
    pub(super) fn admit(&self, state: &State) -> Result<(), Refusal> {
        state.guesses.admit(self.client, &self.key, self.limits).map_err(|(refusal, scope)| {
            state.metrics.proof_limited(scope);
            refusal
        })
    }

    /// Counts the write's result: a refused proof here, or one the leader refused and this
    /// instance relayed (only fencegate's own answers carry [`ERROR_HEADER`]).
    pub(super) fn count(&self, state: &State, result: &Result<Response<ResponseBody>, Refusal>) {
        let refused = match result {
            Err(refusal) => is_refused_proof(refusal.code()),
            Ok(resp) => resp.headers().get(ERROR_HEADER).and_then(|c| c.to_str().ok()).is_some_and(is_refused_proof),
        };
        if refused {
            state.guesses.refused(self.client, &self.key, self.limits);
        }
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
        match g.admit(client, key, LIMITS) {
            Ok(()) => None,
            Err((Refusal::TooManyRefusals { retry_after, .. }, scope)) => Some((retry_after, scope)),
            Err((other, _)) => panic!("{other:?}"),
        }
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

    #[test]
    fn the_refusals_that_count_are_the_checked_proofs() {
        assert!(is_refused_proof("not_lock_holder") && is_refused_proof("signature_rejected"));
        for code in ["stale_token", "missing_signature", "invalid_signature", "verify_unavailable", "too_many_refusals"]
        {
            assert!(!is_refused_proof(code), "{code}");
        }
    }
}
