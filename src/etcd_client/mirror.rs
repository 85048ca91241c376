//! A watched copy of the keys under a prefix, and proof of how fresh it is.
//!
//! The copy starts from a linearizable range read and follows one watch from the revision
//! after it. A watch alone proves nothing about freshness: a stalled member or a silent stream
//! delivers nothing, which looks like nothing happening, and progress notifications cannot be
//! trusted on every etcd (3.4 before 3.4.25 may report a revision whose events have not been
//! sent; etcd issue 15220). So the mirror proves it with a write: every `max_lag / 4` it puts a
//! heartbeat key inside the watched range (outside any lock's keys). etcd delivers a watch's
//! events in revision order, and a put sent at instant T gets a revision above every change
//! committed before T; so once the watch delivers that put, the copy holds every change
//! committed before T. [`Mirror::holder`] answers only while that proof is younger than
//! `max_lag`, and fails closed otherwise.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::task::{AbortHandle, JoinSet};

use super::{Client, EtcdError, EventKind, Watch, prefix_end};

/// What the heartbeat keys have after the watched prefix, so they are never taken for a lock's
/// keys: a lock key is `NAME/<lease id in hex>`, and no lock name fencegate makes has a NUL.
const HEARTBEAT_MARK: &[u8] = b"\0fencegate-heartbeat/";

/// The lease heartbeat keys are put with, so that a stopped fencegate leaves none behind.
const HEARTBEAT_LEASE: Duration = Duration::from_secs(60);

/// Most heartbeats remembered while none is delivered.
const MAX_SENT: usize = 1024;

/// Settings of a mirror.
#[derive(Debug, Clone)]
pub struct MirrorOptions {
    /// How old the proof of freshness may be before the mirror stops answering.
    pub max_lag: Duration,
    /// Names this process's heartbeat key (several fencegates may watch one prefix).
    pub instance: String,
}

/// Why a mirror gave no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Freshness {
    /// No mirror holds the lock's keys.
    NotMirrored,
    /// It has not yet caught up with etcd since it started or since its watch broke.
    NotCaughtUp,
    /// Its last proof of freshness is this old, above `max_lag`.
    Lagging(Duration),
}

impl std::fmt::Display for Freshness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Freshness::NotMirrored => f.write_str("does not hold it"),
            Freshness::NotCaughtUp => f.write_str("has not caught up with etcd"),
            Freshness::Lagging(age) => {
                let age = Duration::from_millis(age.as_millis() as u64);
                write!(f, "was last proven complete {} ago, more than verify.max_lag", humantime::format_duration(age))
            }
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Every key under the prefix, with its create revision.
    keys: BTreeMap<Vec<u8>, i64>,
    /// The copy holds every change etcd committed before this instant.
    fresh_as_of: Option<Instant>,
}

/// A watched copy of the keys under a prefix. Dropping it stops its task.
#[derive(Debug)]
pub struct Mirror {
    prefix: Vec<u8>,
    max_lag: Duration,
    state: Arc<Mutex<State>>,
    task: Option<Task>,
}

/// A mirror's task, and what it takes to clean up after it: the heartbeat's lease.
#[derive(Debug)]
struct Task {
    abort: AbortHandle,
    runtime: tokio::runtime::Handle,
    client: Client,
    lease: Arc<AtomicI64>,
}

impl Drop for Mirror {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort.abort();
            // Revoking the lease deletes the heartbeat key at once, rather than when the lease
            // runs out.
            let lease = task.lease.load(Ordering::Relaxed);
            if lease != 0 {
                let client = task.client.clone();
                task.runtime.spawn(async move { client.revoke(lease).await });
            }
        }
    }
}

impl Mirror {
    /// Starts mirroring the keys under `prefix` on the current runtime.
    pub fn start(client: Client, prefix: Vec<u8>, options: MirrorOptions) -> Mirror {
        let state = Arc::new(Mutex::new(State::default()));
        // One heartbeat key per mirror, even for the same prefix twice in one process (a rule
        // dropped by a reload and added back while the old mirror still stops).
        static MIRRORS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = MIRRORS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut options = options;
        options.instance = format!("{}-{n}", options.instance);
        let lease = Arc::new(AtomicI64::new(0));
        let follow = Follow {
            client: client.clone(),
            prefix: prefix.clone(),
            options: options.clone(),
            state: state.clone(),
            lease: lease.clone(),
        };
        let abort = tokio::spawn(follow.run()).abort_handle();
        let task = Task { abort, runtime: tokio::runtime::Handle::current(), client, lease };
        Mirror { prefix, max_lag: options.max_lag, state, task: Some(task) }
    }

    /// A mirror of fixed keys that follows nothing and stays fresh: for benchmarks.
    #[doc(hidden)]
    pub fn fixed(prefix: Vec<u8>, keys: impl IntoIterator<Item = (Vec<u8>, i64)>) -> Mirror {
        let state = State { keys: keys.into_iter().collect(), fresh_as_of: Some(Instant::now()) };
        Mirror { prefix, max_lag: Duration::from_secs(1 << 30), state: Arc::new(Mutex::new(state)), task: None }
    }

    /// The prefix it mirrors.
    pub fn prefix(&self) -> &[u8] {
        &self.prefix
    }

    /// How old its proof of freshness is; `None` before it has caught up.
    pub fn age(&self) -> Option<Duration> {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).fresh_as_of.map(|t| t.elapsed())
    }

    /// The create revision of the current holder of the lock `name` (the smallest among the
    /// keys under `name/`, as etcd's lock decides), `None` if nobody holds it; or why the copy
    /// cannot be trusted now. `name/` must lie under the mirrored prefix.
    pub fn holder(&self, name: &[u8]) -> Result<Option<i64>, Freshness> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let age = state.fresh_as_of.map(|t| t.elapsed()).ok_or(Freshness::NotCaughtUp)?;
        if age > self.max_lag {
            return Err(Freshness::Lagging(age));
        }
        let mut under = name.to_vec();
        under.push(b'/');
        let end = prefix_end(&under);
        let holders = state.keys.range(under.clone()..end).filter(|(k, _)| !is_heartbeat(&self.prefix, k));
        Ok(holders.map(|(_, rev)| *rev).min())
    }
}

fn is_heartbeat(prefix: &[u8], key: &[u8]) -> bool {
    key.strip_prefix(prefix).is_some_and(|rest| rest.windows(HEARTBEAT_MARK.len()).any(|w| w == HEARTBEAT_MARK))
}

/// The task that keeps a mirror's copy current.
struct Follow {
    client: Client,
    prefix: Vec<u8>,
    options: MirrorOptions,
    state: Arc<Mutex<State>>,
    /// The heartbeat's lease, for the mirror to revoke when it stops.
    lease: Arc<AtomicI64>,
}

/// The heartbeat's lease, when it was last renewed, and the last sequence number sent.
struct Beat {
    lease: i64,
    renewed: Option<Instant>,
    seq: u64,
}

/// Heartbeats sent and not yet seen on the watch: sequence, send instant, acknowledged.
type Sent = VecDeque<(u64, Instant, Option<Instant>)>;

impl Follow {
    fn heartbeat_key(&self) -> Vec<u8> {
        [&self.prefix[..], HEARTBEAT_MARK, self.options.instance.as_bytes()].concat()
    }

    fn set_fresh(&self, fresh: Option<Instant>) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.fresh_as_of = fresh.map(|t| state.fresh_as_of.map_or(t, |old| old.max(t)));
    }

    async fn run(self) {
        let retry = (self.options.max_lag / 4).max(Duration::from_millis(50));
        // Kept across rounds, so that a heartbeat of an earlier round that etcd commits late
        // can never pass for one of a later round.
        let mut beat = Beat { lease: 0, renewed: None, seq: 0 };
        loop {
            match self.follow(&mut beat).await {
                Err(EtcdError::Compacted(rev)) => {
                    tracing::warn!(prefix = %String::from_utf8_lossy(&self.prefix), compacted = rev,
                        "etcd compacted past the lock watch; reading the locks again (verified writes wait)")
                }
                Err(e) => {
                    tracing::warn!(prefix = %String::from_utf8_lossy(&self.prefix), error = %e,
                        "lost the etcd lock watch; verified writes are refused until it is back");
                    tokio::time::sleep(retry).await;
                }
                Ok(()) => {}
            }
            self.set_fresh(None);
        }
    }

    /// Lists, watches and heartbeats until the watch breaks.
    async fn follow(&self, beat: &mut Beat) -> Result<(), EtcdError> {
        let end = prefix_end(&self.prefix);
        let listed_at = Instant::now();
        let (kvs, revision) = self.client.range(&self.prefix, Some(&end)).await?;
        let mut watch = Watch::open(&self.client, &self.prefix, &end, revision + 1).await?;
        {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            state.keys = kvs.into_iter().map(|kv| (kv.key, kv.create_revision)).collect();
        }
        // A linearizable read holds every change committed before it was sent.
        self.set_fresh(Some(listed_at));
        tracing::info!(prefix = %String::from_utf8_lossy(&self.prefix), revision, "watching etcd locks");

        let key = self.heartbeat_key();
        let mut sent: Sent = VecDeque::new();
        let mut puts: JoinSet<(u64, Result<(), EtcdError>)> = JoinSet::new();
        let mut tick = tokio::time::interval((self.options.max_lag / 4).max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                events = watch.next() => {
                    let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                    for event in events? {
                        if event.kv.key == key {
                            let seen = std::str::from_utf8(&event.kv.value).ok().and_then(|v| v.parse::<u64>().ok());
                            if let Some(seen) = seen {
                                while let Some(&(s, at, _)) = sent.front().filter(|(s, ..)| *s <= seen) {
                                    sent.pop_front();
                                    if s == seen {
                                        state.fresh_as_of = Some(state.fresh_as_of.map_or(at, |old| old.max(at)));
                                    }
                                }
                            }
                            continue;
                        }
                        match event.kind {
                            EventKind::Put => { state.keys.insert(event.kv.key, event.kv.create_revision); }
                            EventKind::Delete => { state.keys.remove(&event.kv.key); }
                        }
                    }
                }
                _ = tick.tick() => {
                    // A heartbeat etcd acknowledged that the watch has not delivered within
                    // max_lag: the stream is stuck. Start over.
                    if sent.iter().any(|(_, _, acked)| acked.is_some_and(|a| a.elapsed() > self.options.max_lag)) {
                        return Err(EtcdError::WatchEnded("a heartbeat etcd took was not delivered".into()));
                    }
                    if beat.lease == 0 || beat.renewed.is_none_or(|at| at.elapsed() >= HEARTBEAT_LEASE / 4) {
                        beat.lease = self.renew(beat.lease).await;
                        self.lease.store(beat.lease, Ordering::Relaxed);
                        beat.renewed = Some(Instant::now());
                    }
                    beat.seq += 1;
                    let seq = beat.seq;
                    // While etcd is away its puts fail; the oldest go first.
                    if sent.len() >= MAX_SENT {
                        sent.pop_front();
                    }
                    sent.push_back((seq, Instant::now(), None));
                    let (client, key, lease, timeout) = (self.client.clone(), key.clone(), beat.lease, self.options.max_lag);
                    puts.spawn(async move {
                        let value = seq.to_string();
                        let put = client.put_with_lease(&key, value.as_bytes(), lease);
                        let result = tokio::time::timeout(timeout, put).await;
                        (seq, result.unwrap_or_else(|_| Err(EtcdError::WatchEnded("heartbeat timed out".into()))).map(drop))
                    });
                }
                Some(Ok((done, result))) = puts.join_next() => {
                    if result.is_ok()
                        && let Some(entry) = sent.iter_mut().find(|(s, ..)| *s == done)
                    {
                        entry.2 = Some(Instant::now());
                    }
                }
            }
        }
    }

    /// Keeps the heartbeat's lease alive, or takes a new one; 0 (no lease) if etcd gives none.
    async fn renew(&self, lease: i64) -> i64 {
        if lease != 0 && self.client.keep_alive_once(lease).await.is_ok_and(|ttl| ttl > 0) {
            return lease;
        }
        self.client.grant(HEARTBEAT_LEASE).await.unwrap_or(0)
    }
}

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
