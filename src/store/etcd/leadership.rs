//! The election: each instance holds a lease and campaigns by creating `P/leader` on it if the
//! key is absent. The winner reads the fence from etcd (`takeover`), has the writes in flight
//! quarantined, and leads until its lease lapses on its own clock, etcd says the lease is gone,
//! or a batch finds the guard gone. The others follow the key's URL and watch it for deletion
//! (a resignation or the old lease's expiry).
//!
//! A lost lease is never renewed: the instance steps down, takes a new lease and campaigns
//! again; its writes in flight are abandoned, their flight records left for the next leader.

use std::sync::Arc;
use std::time::Duration;

use super::lease::{Shared, Standing, Start};
use super::names::Names;
use super::takeover::{self, Adopted, Failed, Recorded};
use crate::etcd_client::{Client, Compare, EventKind, Op, Watch};
use crate::store::Table;

/// Told of each takeover before the new leader serves writes: the writes it must quarantine.
pub type TakeoverHook = Arc<dyn Fn(&Adopted) + Send + Sync>;

/// Between two tries when etcd does not answer.
const RETRY: Duration = Duration::from_millis(250);

/// What the election needs.
pub(crate) struct Campaign {
    pub(crate) client: Client,
    pub(crate) names: Names,
    pub(crate) shared: Arc<Shared>,
    pub(crate) table: Arc<Table>,
    pub(crate) ttl: Duration,
    pub(crate) advertise: String,
    pub(crate) recorded: Recorded,
    pub(crate) hook: TakeoverHook,
}

impl Campaign {
    fn stopped(&self) -> bool {
        matches!(self.shared.standing(), Standing::Stopped(_))
    }

    fn seek(&self, why: String) {
        if !matches!(self.shared.standing(), Standing::Seeking(ref w) if *w == why) {
            tracing::warn!(reason = %why, "the etcd store has no leader to write through");
        }
        self.shared.set(Standing::Seeking(why));
    }

    /// Runs until the store stops; resigns if it leads then.
    pub(crate) async fn run(self) {
        while !self.stopped() {
            let sent = self.shared.now();
            let lease = match self.client.grant(self.ttl).await {
                Ok(id) => id,
                Err(e) => {
                    self.seek(format!("etcd gave no lease: {e}"));
                    self.pause().await;
                    continue;
                }
            };
            self.shared.acknowledged(sent, self.ttl);
            // Aborted with this future too, should the runtime drop it.
            let keeper =
                Aborting(tokio::spawn(keep_alive(self.client.clone(), Arc::clone(&self.shared), lease, self.ttl)));
            let epoch = self.with_lease(lease).await;
            drop(keeper);
            self.shared.lapse();
            if let Some(epoch) = epoch.filter(|_| self.stopped()) {
                self.resign(epoch).await;
            }
            // Best effort: an expiry deletes its keys as well, only later.
            let _ = self.client.revoke(lease).await;
        }
    }

    /// Waits `RETRY`, or less if the store stops meanwhile.
    async fn pause(&self) {
        let _ = tokio::time::timeout(RETRY, self.shared.wake.notified()).await;
    }

    /// Campaigns, follows and leads on `lease` until it is lost or the store stops; returns the
    /// epoch if it was leading when it stopped.
    async fn with_lease(&self, lease: i64) -> Option<i64> {
        let leader = self.names.leader();
        let (mut checked, mut claimed) = (false, false);
        loop {
            if self.stopped() || !self.shared.lease_valid() {
                return None;
            }
            // Before it follows as before it leads: a follower's own rules decide which writes
            // it sends on and which it passes unchecked, and its key proves what it sends on.
            // (`open` checks and reads them only if etcd answers.)
            if !checked {
                match takeover::admitted(&self.client, &self.names, &self.recorded).await {
                    Ok(secret) => {
                        self.shared.set_secret(secret);
                        checked = true;
                    }
                    Err(Failed::Fatal(e)) => {
                        tracing::error!(error = %e, "the etcd store cannot serve: fenced writes are refused");
                        self.shared.stop(&e.to_string());
                        return None;
                    }
                    Err(Failed::Etcd(e)) => {
                        self.seek(format!("etcd did not give the fence's rules or key: {e}"));
                        self.pause().await;
                        continue;
                    }
                }
            }
            if !claimed {
                claimed = self.claim(lease).await;
                if !claimed {
                    self.pause().await;
                    continue;
                }
            }
            let put = Op::Put { key: leader.clone(), value: self.advertise.as_bytes().to_vec(), lease };
            let campaign = self
                .client
                .txn(&[Compare::CreateRevision(leader.clone(), 0)], &[put], &[Op::Get(leader.clone())])
                .await;
            let epoch = match campaign {
                Err(e) => {
                    // Perhaps it applied: the next try reads the key back and knows it by its lease.
                    self.seek(format!("etcd did not answer the election: {e}"));
                    self.pause().await;
                    continue;
                }
                Ok(r) if r.succeeded => r.revision,
                Ok(r) => match r.ranges.into_iter().next().flatten() {
                    Some(kv) if kv.lease == lease => kv.create_revision,
                    Some(kv) => {
                        let url = String::from_utf8_lossy(&kv.value).into_owned();
                        self.follow(url, kv.create_revision, r.revision).await;
                        continue;
                    }
                    None => continue,
                },
            };
            return self.lead(epoch, lease).await.then_some(epoch);
        }
    }

    /// Claims this instance's advertised URL on `lease` (`P/instances/<advertise>`): the others
    /// send fenced writes to the leader's URL, and one that reached another instance advertising
    /// the same URL would be refused there, so such an instance neither leads nor follows, and
    /// says why. Whether the URL is this lease's.
    async fn claim(&self, lease: i64) -> bool {
        let key = self.names.instance(&self.advertise);
        let put = Op::Put { key: key.clone(), value: self.advertise.as_bytes().to_vec(), lease };
        match self.client.txn(&[Compare::CreateRevision(key.clone(), 0)], &[put], &[Op::Get(key)]).await {
            Ok(r) if r.succeeded => true,
            Ok(r) => match r.ranges.into_iter().next().flatten() {
                Some(kv) if kv.lease == lease => true,
                Some(_) => {
                    self.seek(format!(
                        "another instance advertises {} (store.advertise), or an earlier run of this one whose lease \
                        has not expired yet: each instance needs a URL of its own, at which the others reach it",
                        self.advertise
                    ));
                    false
                }
                // Released meanwhile: claimed at the next try.
                None => false,
            },
            Err(e) => {
                self.seek(format!("etcd did not answer the claim of this instance's URL: {e}"));
                false
            }
        }
    }

    /// Follows the leader at `url` until its key is deleted (or may have been), the lease
    /// lapses, or the store stops.
    async fn follow(&self, url: String, created: i64, revision: i64) {
        if url == self.advertise {
            // An earlier run of this instance, on a lease that has not expired yet.
            self.seek("the leader key is an earlier run's of this instance, until its lease expires".into());
        } else {
            if self.shared.standing() != Standing::Following(url.clone()) {
                tracing::info!(leader = %url, "following the fence's leader");
            }
            self.shared.set(Standing::Following(url));
        }
        let leader = self.names.leader();
        let mut watch = match Watch::open(&self.client, &leader, b"", revision + 1).await {
            Ok(w) => w,
            Err(_) => return self.pause().await,
        };
        loop {
            let period = self.ttl.min(self.shared.lease_left().max(RETRY));
            tokio::select! {
                events = watch.next() => match events {
                    Ok(events) if events.iter().any(|e| e.kind == EventKind::Delete) => return,
                    Ok(_) => {}
                    Err(_) => return,
                },
                _ = self.shared.wake.notified() => {}
                // Once a lease period, the key is read again (a read, repeatable and no raft
                // write): a watch that stopped delivering must not keep this instance following
                // a leader that is gone. While etcd does not answer, it goes on following.
                _ = tokio::time::sleep(period) => match self.client.range(&leader, None).await {
                    Ok((kvs, _)) if kvs.first().is_some_and(|kv| kv.create_revision == created) => {}
                    Ok(_) => return,
                    Err(_) => {}
                },
            }
            if self.stopped() || !self.shared.lease_valid() {
                return;
            }
        }
    }

    /// Takes over and leads; returns whether it still led when the store stopped.
    async fn lead(&self, epoch: i64, lease: i64) -> bool {
        self.shared.set(Standing::TakingOver);
        tracing::info!(epoch, "elected to lead the fence: reading it from etcd");
        let read = match takeover::read(&self.client, &self.names, &self.table, &self.recorded).await {
            Ok(read) => read,
            Err(Failed::Fatal(e)) => {
                tracing::error!(error = %e, "the etcd store cannot serve: fenced writes are refused");
                self.shared.stop(&e.to_string());
                return true;
            }
            Err(Failed::Etcd(e)) => {
                self.seek(format!("the takeover could not read the fence from etcd: {e}"));
                return false;
            }
        };
        let found = u64::try_from(read.adopted.marks).unwrap_or(u64::MAX);
        let adopted = read.adopted;
        let layout = read.without_layout.as_deref().map(|recorded| (recorded, self.recorded.rules.as_str()));
        match takeover::write_back(&self.client, &self.names, epoch, (read.census, found), layout).await {
            Ok(true) if layout.is_some() => tracing::info!(
                "recorded with the fence's rules that writes in flight are kept as flight records: \
                 builds that keep them as markers do not lead this prefix"
            ),
            Ok(true) => {}
            Ok(false) => {
                self.seek("the leader key, the census or the fence's rules changed during the takeover".into());
                return false;
            }
            Err(e) => {
                self.seek(format!("the takeover could not write what it read back to etcd (census, layout): {e}"));
                return false;
            }
        }
        (self.hook)(&adopted);
        self.shared.set_start(Start { batch: read.batch, census: found, flights: read.flights });
        if !self.shared.lease_valid() {
            self.seek("the lease lapsed during the takeover".into());
            return false;
        }
        tracing::info!(
            epoch,
            marks = adopted.marks,
            in_flight = adopted.in_flight.len() + adopted.floors_in_flight.len(),
            "leading the fence"
        );
        self.shared.set(Standing::Leading { epoch, lease });
        // Its own key, watched: deleted by hand, it steps down at once rather than send what it
        // committed while another instance takes over. A watch that breaks is opened again
        // (from a read that proves the key is still its own), never left off.
        let mut own: Option<Watch> = None;
        let mut reopen = tokio::time::Instant::now();
        loop {
            let lapse = self.shared.lease_left();
            tokio::select! {
                _ = self.shared.wake.notified() => {}
                _ = tokio::time::sleep(lapse) => {}
                events = next_events(&mut own) => match events {
                    Ok(events) if !events.is_empty() => {
                        self.step_down(epoch, "the leader key was deleted or replaced in etcd");
                    }
                    Ok(_) => {}
                    Err(_) => {
                        own = None;
                        reopen = tokio::time::Instant::now() + RETRY;
                    }
                },
                _ = tokio::time::sleep_until(reopen), if own.is_none() => {
                    tokio::select! {
                        opened = self.watch_own(epoch) => own = opened,
                        _ = self.shared.wake.notified() => {}
                        _ = tokio::time::sleep(lapse) => {}
                    }
                    reopen = tokio::time::Instant::now() + RETRY;
                }
            }
            match self.shared.standing() {
                Standing::Stopped(_) => return true,
                Standing::Leading { epoch: e, .. } if e == epoch && self.shared.lease_valid() => {}
                Standing::Leading { .. } => {
                    self.seek("the lease lapsed: stepping down, writes in flight are abandoned".into());
                    return false;
                }
                _ => return false,
            }
        }
    }

    /// A watch of this instance's leader key from a read that found it still its own; a key
    /// that is not its own any more steps it down. `None` while etcd does not answer (the
    /// lease clock decides meanwhile, and the caller tries again).
    async fn watch_own(&self, epoch: i64) -> Option<Watch> {
        let leader = self.names.leader();
        match self.client.range(&leader, None).await {
            Ok((kvs, revision)) if kvs.first().is_some_and(|kv| kv.create_revision == epoch) => {
                Watch::open(&self.client, &leader, b"", revision + 1).await.ok()
            }
            Ok(_) => {
                self.step_down(epoch, "the leader key was deleted or replaced in etcd");
                None
            }
            Err(_) => None,
        }
    }

    /// Steps down from leading in `epoch`, saying why, if it still does.
    fn step_down(&self, epoch: i64, why: &str) {
        if self.shared.step_down(epoch, why) {
            tracing::warn!(reason = why, "no longer the leader: stepping down");
        }
    }

    /// Deletes the leader key if it is still this instance's: a clean hand-over.
    async fn resign(&self, epoch: i64) {
        let leader = self.names.leader();
        let resigned =
            self.client.txn(&[Compare::CreateRevision(leader.clone(), epoch)], &[Op::Delete(leader)], &[]).await;
        match resigned {
            Ok(r) if r.succeeded => tracing::info!(epoch, "resigned the fence's leadership"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "could not resign; the lease's expiry will hand over"),
        }
    }
}

/// A task aborted when this is dropped.
struct Aborting(tokio::task::JoinHandle<()>);

impl Drop for Aborting {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Renews `lease` every quarter of its TTL, counting each acknowledgement from its send; stops
/// when etcd says the lease is gone, or when the lease lapsed before an answer came.
async fn keep_alive(client: Client, shared: Arc<Shared>, lease: i64, ttl: Duration) {
    let period = (ttl / 4).max(Duration::from_millis(100));
    // Each send a period after the last one was sent, not after its answer: a slow answer does
    // not push the next renewal later (the config check counts on that).
    let mut next = tokio::time::Instant::now() + period;
    loop {
        tokio::time::sleep_until(next).await;
        next = (next + period).max(tokio::time::Instant::now());
        if shared.stopped() {
            return;
        }
        let sent = shared.now();
        match client.keep_alive_once(lease).await {
            // Not once the lease lapsed on this instance's clock (or it stepped down, or
            // stopped): a lost lease is never trusted again, whatever etcd says of it.
            Ok(_) if shared.stopped() || !shared.lease_valid() => {
                shared.wake.notify_one();
                return;
            }
            Ok(left) if left > 0 => shared.acknowledged(sent, Duration::from_secs(left.unsigned_abs())),
            Ok(_) => {
                tracing::warn!(lease, "etcd says the lease expired");
                shared.lapse();
                shared.wake.notify_one();
                return;
            }
            Err(e) if !shared.lease_valid() => {
                tracing::warn!(lease, error = %e, "the lease lapsed before etcd answered a keep-alive");
                shared.wake.notify_one();
                return;
            }
            Err(_) => {}
        }
    }
}

/// The next events of `watch`; never resolves without one (a watch that could not be opened).
async fn next_events(
    watch: &mut Option<Watch>,
) -> Result<Vec<crate::etcd_client::Event>, crate::etcd_client::EtcdError> {
    match watch {
        Some(w) => w.next().await,
        None => std::future::pending().await,
    }
}
