//! A new leader's read of the fence from etcd: every level, floor and flight record under the
//! prefix (and the in-flight markers of older builds), page by page at one revision, into the
//! table. It comes after the leader's own key was created, so it sees every batch the previous
//! leader committed (its batches were guarded by a leader key that is gone by now), flight
//! records and all.
//!
//! It counts the levels it loads and refuses a prefix that holds fewer than its census
//! (`P/census`, `names`) records: levels were deleted, and serving would forget their
//! `max_seen`. A prefix without a census (an earlier build initialised it) gets one, counted from
//! what this read found; so does one whose census is lower than what was found.

use std::sync::Arc;

use super::flights::{self, Flight, Flights};
use super::names::{Named, Names, parse_token, token_value};
use super::provision::Agreement;
use crate::etcd_client::{Client, Compare, EtcdError, Op, prefix_end};
use crate::store::{MarkKind, StoreError, Table};

/// Keys read per page.
const PAGE: i64 = 1000;

/// What a takeover found beyond the levels it loaded.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Adopted {
    /// Writes the previous leader forwarded with no answer recorded, as `(key, token)`: the
    /// backend may still apply them, so their resources start quarantined.
    pub in_flight: Vec<(String, u64)>,
    /// The same for writes that raised a floor, as `(floor, token)`.
    pub floors_in_flight: Vec<(String, u64)>,
    /// Keys and floors loaded.
    pub marks: usize,
}

/// Why a takeover could not be made.
#[derive(Debug)]
pub(crate) enum Failed {
    /// etcd did not answer or refused: try again later.
    Etcd(EtcdError),
    /// The prefix cannot be served at all.
    Fatal(StoreError),
}

impl From<EtcdError> for Failed {
    fn from(e: EtcdError) -> Self {
        Failed::Etcd(e)
    }
}

/// Why an etcd prefix holds no fence: never initialised, or its state lost.
pub(crate) fn not_initialised(prefix: &[u8]) -> StoreError {
    StoreError::NotInitialisedEtcd { prefix: String::from_utf8_lossy(prefix).into_owned() }
}

/// What an instance's configuration says the fence is: the key rules its keys are made under
/// and the settings that decide a write's fate, both recorded with the fence.
#[derive(Debug, Clone)]
pub(crate) struct Recorded {
    pub(crate) keying: String,
    pub(crate) rules: String,
}

/// What [`initialised`] found.
pub(crate) struct Initialised {
    /// The last batch id.
    pub(crate) batch: Vec<u8>,
    /// The rules as recorded, where they lack only the layout line of this build
    /// ([`super::provision::LAYOUT`]): a prefix an earlier build wrote, whose next leader
    /// records the line (which earlier builds then refuse to lead by).
    pub(crate) without_layout: Option<String>,
}

/// Checks that the prefix was initialised under `recorded`'s keying and holds its rules (a
/// prefix without a record of its rules gets this instance's).
pub(crate) async fn initialised(client: &Client, names: &Names, recorded: &Recorded) -> Result<Initialised, Failed> {
    let gets = [Op::Get(names.batch()), Op::Get(names.keying()), Op::Get(names.rules())];
    let read = client.txn(&[], &gets, &[]).await?;
    let (Some(Some(batch)), Some(keying), Some(rules)) = (read.ranges.first(), read.ranges.get(1), read.ranges.get(2))
    else {
        return Err(Failed::Fatal(not_initialised(names.prefix())));
    };
    let prefix = || String::from_utf8_lossy(names.prefix()).into_owned();
    let text =
        |kv: &Option<crate::etcd_client::Kv>| kv.as_ref().map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
    let keying = text(keying).unwrap_or_default();
    if keying != recorded.keying {
        return Err(Failed::Fatal(StoreError::KeyingChangedEtcd {
            prefix: prefix(),
            recorded: keying,
            configured: recorded.keying.clone(),
        }));
    }
    let rules = match text(rules) {
        Some(rules) => rules,
        None => record_rules(client, names, &recorded.rules).await?,
    };
    let without_layout = match super::provision::agreement(&rules, &recorded.rules) {
        Agreement::Same => None,
        Agreement::LacksLayout => Some(rules),
        Agreement::Differ(differences) => {
            return Err(Failed::Fatal(StoreError::RulesDifferEtcd {
                prefix: prefix(),
                differences: differences.join("; "),
            }));
        }
    };
    Ok(Initialised { batch: batch.value.clone(), without_layout })
}

/// What an instance checks and reads before it follows or leads: the prefix initialised under
/// `recorded` ([`initialised`]), and the fence's key for writes sent on ([`secret`]).
pub(crate) async fn admitted(client: &Client, names: &Names, recorded: &Recorded) -> Result<Arc<[u8]>, Failed> {
    initialised(client, names, recorded).await?;
    secret(client, names).await
}

/// The fence's key for writes sent on between instances (`P/secret`): read, or made (32 random
/// bytes, put only if absent) on a prefix without one.
pub(crate) async fn secret(client: &Client, names: &Names) -> Result<Arc<[u8]>, Failed> {
    let key = names.secret();
    let mut made = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut made)
        .map_err(|_| Failed::Fatal(StoreError::Failed("no random bytes for the fence's key".into())))?;
    let put = [Op::Put { key: key.clone(), value: made.to_vec(), lease: 0 }];
    let done = client.txn(&[Compare::CreateRevision(key.clone(), 0)], &put, &[Op::Get(key)]).await?;
    if done.succeeded {
        return Ok(made.into());
    }
    match done.ranges.into_iter().next().flatten() {
        Some(kv) if !kv.value.is_empty() => Ok(kv.value.into()),
        _ => Err(Failed::Etcd(EtcdError::Unavailable {
            endpoint: String::new(),
            call: "the fence's key".into(),
            message: "deleted as it was read".into(),
        })),
    }
}

/// Records `rules` as the fence's where none are recorded; returns the fence's rules.
async fn record_rules(client: &Client, names: &Names, rules: &str) -> Result<String, Failed> {
    let put = [Op::Put { key: names.rules(), value: rules.as_bytes().to_vec(), lease: 0 }];
    let done = client.txn(&[Compare::CreateRevision(names.rules(), 0)], &put, &[Op::Get(names.rules())]).await?;
    if done.succeeded {
        tracing::info!("recorded this instance's fence rules with the fence: every instance must share them");
        return Ok(rules.to_owned());
    }
    // Another instance recorded its own meanwhile.
    let theirs = done.ranges.first().cloned().flatten();
    Ok(theirs.map(|kv| String::from_utf8_lossy(&kv.value).into_owned()).unwrap_or_default())
}

/// What a takeover read besides the table.
#[derive(Debug)]
pub(crate) struct Read {
    /// The writes in flight, and the levels loaded.
    pub(crate) adopted: Adopted,
    /// The last batch id.
    pub(crate) batch: Vec<u8>,
    /// The census, if the prefix has one.
    pub(crate) census: Option<u64>,
    /// The writes in flight, by flight.
    pub(crate) flights: Flights,
    /// The recorded rules, where they lack this build's layout line.
    pub(crate) without_layout: Option<String>,
}

/// Loads every level, floor and binding under the prefix into `table`, exactly as etcd holds
/// it (an operator's reset on another leader lowered it there, another leader dropped the
/// binding), and returns the writes in flight, the last batch id and the census. Refuses a
/// prefix holding fewer levels than its census.
pub(crate) async fn read(client: &Client, names: &Names, table: &Table, recorded: &Recorded) -> Result<Read, Failed> {
    let Initialised { batch, without_layout } = initialised(client, names, recorded).await?;
    // Every page is read at the first one's revision, so that the table is one moment's. A
    // compaction past that revision (etcd's auto-compaction, an operator's) ends such a read:
    // it is made again at the current revision, a few times, before the takeover gives up.
    let mut tries = 0;
    loop {
        match read_at_one_revision(client, names, table).await {
            Err(Failed::Etcd(EtcdError::RevisionCompacted)) if tries < COMPACTED_TRIES => {
                tries += 1;
                tracing::info!(tries, "etcd compacted the revision the takeover read at: reading the fence again");
            }
            Err(e) => return Err(e),
            Ok((adopted, census, flights)) => return Ok(Read { adopted, batch, census, flights, without_layout }),
        }
    }
}

/// How many times a takeover reads the fence again after a compaction.
const COMPACTED_TRIES: u32 = 3;

/// [`read`]'s pass over the prefix, every page at the first one's revision: the writes in
/// flight and the levels loaded, the census, and the flights.
async fn read_at_one_revision(
    client: &Client,
    names: &Names,
    table: &Table,
) -> Result<(Adopted, Option<u64>, Flights), Failed> {
    // Keys and floors are loaded and reset to what etcd holds; bindings, which another leader
    // may have dropped since this instance last led, are read afresh.
    table.clear_bindings();
    let end = prefix_end(names.prefix());
    let mut from = names.prefix().to_vec();
    let mut revision = 0;
    let mut adopted = Adopted::default();
    let mut flying = Vec::new();
    let mut census = None;
    loop {
        let page = client.range_page(&from, &end, PAGE, revision).await?;
        revision = page.revision;
        for kv in &page.kvs {
            let named = names.parse(&kv.key);
            if let Named::Flight(id) = named {
                let Some(entries) = flights::decode(&kv.value) else {
                    let key = String::from_utf8_lossy(&kv.key);
                    return Err(Failed::Fatal(StoreError::Failed(format!("etcd key {key} holds no flight record"))));
                };
                flying.push((Flight::Batch(id), entries));
                continue;
            }
            let Some(token) = parse_token(&kv.value) else {
                if named != Named::Other {
                    let key = String::from_utf8_lossy(&kv.key);
                    return Err(Failed::Fatal(StoreError::Failed(format!("etcd key {key} holds no token"))));
                }
                continue;
            };
            match named {
                Named::Level(mark) => {
                    table.load(mark.borrowed(), token, false);
                    table.reset(mark.borrowed(), token);
                    // The census counts levels; a binding is not one.
                    adopted.marks += usize::from(mark.kind.is_level());
                }
                // A binding is never in flight: no build writes its marker.
                Named::InFlight(mark) if mark.kind.is_level() => {
                    flying.push((Flight::Marker(mark.clone()), vec![(mark, token)]));
                }
                Named::Census => census = Some(token),
                Named::InFlight(_) | Named::Flight(_) | Named::Other => {}
            }
        }
        match page.kvs.last() {
            Some(last) if page.more => {
                from = last.key.clone();
                from.push(0);
                crate::store::failpoint("store::takeover_page");
            }
            _ => break,
        }
    }
    let found = u64::try_from(adopted.marks).unwrap_or(u64::MAX);
    if let Some(recorded) = census.filter(|recorded| found < *recorded) {
        let prefix = String::from_utf8_lossy(names.prefix()).into_owned();
        return Err(Failed::Fatal(StoreError::LostMarksEtcd { prefix, recorded, found }));
    }
    // After every level is in: each mark's newest flight marks its entry in flight, at the
    // level etcd holds (a reset may have lowered the level below the flight's token; a flight
    // never raises it).
    let flights = Flights::adopt(flying);
    for (mark, token) in flights.in_flight() {
        let at = mark.borrowed();
        let reported = match mark.kind {
            MarkKind::Key => &mut adopted.in_flight,
            MarkKind::Floor => &mut adopted.floors_in_flight,
            MarkKind::Upload => continue,
        };
        table.load(at, table.level(at).unwrap_or(token), true);
        reported.push((mark.name.to_string(), token));
    }
    adopted.in_flight.sort_unstable();
    adopted.floors_in_flight.sort_unstable();
    Ok((adopted, census, flights))
}

/// What a takeover writes back once it has read the prefix, in one transaction guarded by
/// `epoch`'s leader key. Whether the prefix holds it now (false: the leader key, the census or
/// the rules changed meanwhile).
///
/// - The census is made `found`, the levels the takeover found, where it is absent or lower
///   (`census`, as read): from then on it counts every level the prefix holds.
/// - With `layout`, the rules as recorded (lacking only this build's layout line) are replaced
///   by this build's `rules`: from then on builds that write markers instead of flight records
///   refuse to lead the prefix.
pub(crate) async fn write_back(
    client: &Client,
    names: &Names,
    epoch: i64,
    (census, found): (Option<u64>, u64),
    layout: Option<(&str, &str)>,
) -> Result<bool, EtcdError> {
    let mut guard = vec![Compare::CreateRevision(names.leader(), epoch)];
    let mut puts = Vec::new();
    if census.is_none_or(|recorded| recorded < found) {
        guard.push(match census {
            Some(count) => Compare::Value(names.census(), token_value(count)),
            None => Compare::CreateRevision(names.census(), 0),
        });
        puts.push(Op::Put { key: names.census(), value: token_value(found), lease: 0 });
    }
    if let Some((recorded, rules)) = layout {
        let (unchanged, put) = super::provision::replace_rules(names, Some(recorded), rules);
        guard.push(unchanged);
        puts.push(put);
    }
    if puts.is_empty() {
        return Ok(true);
    }
    Ok(client.txn(&guard, &puts, &[]).await?.succeeded)
}
