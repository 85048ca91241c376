//! Where an etcd prefix's fence begins: [`init`] (`fencegate init` with an etcd store) and
//! [`migrate`] (`fencegate migrate`, a file store's `max_seen` copied in).
//!
//! As with a data directory, an empty prefix and a lost one look alike, so the store refuses a
//! prefix without `P/batch`, and only these make one. Both refuse while an instance leads the
//! prefix (`P/leader` exists): a leader fences from the table it read at its takeover, and would
//! not see what they write. Both keep `P/census` (`names`) right: `init` writes it, and each
//! level `migrate` creates raises it in the same transaction.

use std::collections::BTreeMap;
use std::path::Path;

use super::flights::{self, Flight};
use super::names::{Names, batch_id, parse_token, token_value};
use crate::etcd_client::{Client, Compare, Op};
use crate::store::{Mark, MarkKind, MarkRef, StoreError};

/// The floor name that covers every key (`fence::tree`'s root).
const ROOT: &str = "/";

/// The line the etcd store adds to the fence's rules: how it records writes in flight (one
/// flight record per batch, `flights`). Builds that wrote a marker per write instead do not
/// read flight records, so a prefix whose rules hold this line is one they refuse to lead
/// (its rules differ from theirs by it), and a takeover of theirs cannot miss a write in flight.
pub(crate) const LAYOUT: &str = "store.in_flight = \"records\"";

/// Entries of a migrated data directory's writes in flight per record, at most.
const MIGRATED_PER_RECORD: usize = 100;
/// Bytes of names per migrated record, at most (as JSON up to six times as many, well under
/// etcd's request limit).
const MIGRATED_RECORD_BYTES: usize = 128 << 10;

/// The fence's rules as this build records them in etcd: `rules` (one setting a line, sorted)
/// with [`LAYOUT`].
pub fn stored_rules(rules: &str) -> String {
    let mut lines: Vec<&str> =
        rules.lines().filter(|line| !line.trim().is_empty() && !has_layout(line)).chain([LAYOUT]).collect();
    lines.sort_unstable();
    lines.join("\n")
}

/// How the rules etcd records compare with this build's (as [`stored_rules`] makes them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Agreement {
    /// They are this build's.
    Same,
    /// They differ only by lacking [`LAYOUT`]: rules an earlier build recorded, which this
    /// build's instances take (and complete).
    LacksLayout,
    /// They differ by these settings ([`record_differences`]).
    Differ(Vec<String>),
}

/// How `recorded` compares with `configured`.
pub fn agreement(recorded: &str, configured: &str) -> Agreement {
    let differences = record_differences(recorded, configured);
    if differences.is_empty() {
        Agreement::Same
    } else if !has_layout(recorded) && record_differences(&stored_rules(recorded), configured).is_empty() {
        Agreement::LacksLayout
    } else {
        Agreement::Differ(differences)
    }
}

/// Whether `rules` say how writes in flight are recorded, whatever the value.
fn has_layout(rules: &str) -> bool {
    let name = LAYOUT.split_once(" = ").map_or(LAYOUT, |(name, _)| name);
    rules.lines().any(|line| line.split_once(" = ").is_some_and(|(n, _)| n == name))
}

fn etcd_error(e: crate::etcd_client::EtcdError) -> StoreError {
    StoreError::Unavailable(e.to_string())
}

fn leading(names: &Names) -> StoreError {
    StoreError::Unavailable(format!(
        "an instance leads the fence under {:?}: stop every fencegate on this prefix first",
        String::from_utf8_lossy(names.prefix())
    ))
}

/// Starts the fence under `prefix`, with every key at `floor` (none for 0), recording `keying`,
/// the fence's `rules` and the census of its levels. Refuses a prefix that already holds a
/// fence.
pub async fn init(client: &Client, prefix: &str, keying: &str, rules: &str, floor: u64) -> Result<(), StoreError> {
    let names = Names::new(prefix);
    let rules = stored_rules(rules);
    let mut puts = vec![
        Op::Put { key: names.batch(), value: batch_id(0, 0), lease: 0 },
        Op::Put { key: names.keying(), value: keying.as_bytes().to_vec(), lease: 0 },
        Op::Put { key: names.rules(), value: rules.as_bytes().to_vec(), lease: 0 },
        Op::Put { key: names.census(), value: token_value(u64::from(floor > 0)), lease: 0 },
    ];
    if floor > 0 {
        puts.push(Op::Put { key: names.level(MarkRef::floor(ROOT)), value: token_value(floor), lease: 0 });
    }
    let guard = [Compare::CreateRevision(names.batch(), 0), Compare::CreateRevision(names.leader(), 0)];
    let done = client.txn(&guard, &puts, &[Op::Get(names.batch())]).await.map_err(etcd_error)?;
    match (done.succeeded, done.ranges.first()) {
        (true, _) => Ok(()),
        (false, Some(Some(_))) => Err(StoreError::AlreadyInitialisedEtcd { prefix: prefix.to_owned() }),
        (false, _) => Err(leading(&names)),
    }
}

/// What a migration did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Migrated {
    /// Keys and floors whose level etcd now holds from the file store.
    pub raised: usize,
    /// Keys and floors etcd already held at or above the file store's level.
    pub kept: usize,
    /// Writes in flight in the file store, copied as markers: the next leader quarantines them.
    pub in_flight: usize,
}

/// Copies the `max_seen` of every key and floor of the data directory `dir` into etcd, never
/// lowering one, and its writes in flight as flight records. Initialises the prefix if it is not yet;
/// refuses a directory or prefix keyed under other rules than `keying`, and a directory a
/// process holds.
pub async fn migrate(
    client: &Client,
    prefix: &str,
    keying: &str,
    rules: &str,
    dir: &Path,
) -> Result<Migrated, StoreError> {
    let names = Names::new(prefix);
    let found = crate::store::inspect(dir)?;
    let recorded = std::fs::read_to_string(dir.join(crate::store::file::KEYING_FILE)).unwrap_or_default();
    if recorded != keying {
        return Err(StoreError::KeyingChanged { dir: dir.to_owned(), recorded, configured: keying.to_owned() });
    }
    match init(client, prefix, keying, rules, 0).await {
        Ok(()) | Err(StoreError::AlreadyInitialisedEtcd { .. }) => {}
        Err(e) => return Err(e),
    }
    let read = client.txn(&[], &[Op::Get(names.keying()), Op::Get(names.census())], &[]).await.map_err(etcd_error)?;
    let in_etcd = read.ranges.first().cloned().flatten().map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
    if in_etcd.as_deref() != Some(keying) {
        return Err(StoreError::KeyingChangedEtcd {
            prefix: prefix.to_owned(),
            recorded: in_etcd.unwrap_or_default(),
            configured: keying.to_owned(),
        });
    }
    let mut marks = Vec::new();
    found.table.for_each(MarkKind::Key, |key, token, _| marks.push((Mark::key(key), token)));
    found.table.for_each(MarkKind::Floor, |p, token, _| marks.push((Mark::floor(p), token)));
    let mut migrated = Migrated::default();
    // The census as etcd holds it (read again whenever a create finds it changed); none on a
    // prefix an earlier build initialised, whose next takeover writes it.
    let mut census = read_census(&names, read.ranges.get(1).cloned().flatten())?;
    for (mark, token) in marks {
        if raise(client, &names, &names.level(mark.borrowed()), token, &mut census).await? {
            migrated.raised += 1;
        } else {
            migrated.kept += 1;
        }
    }
    let flying = found.in_flight.iter().map(|(k, t)| (Mark::key(k.as_str()), *t));
    let flying: Vec<(Mark, u64)> =
        flying.chain(found.floors_in_flight.iter().map(|(p, t)| (Mark::floor(p.as_str()), *t))).collect();
    if !flying.is_empty() {
        record_layout(client, &names, rules).await?;
    }
    // Records of epoch 0, which no leader has (an epoch is a create revision): older than any
    // leader's. A sequence a record already holds (an earlier migration's) is passed over.
    let mut sequence = 1;
    for entries in per_record(&flying) {
        loop {
            let key = names.flight(&Flight::Batch(batch_id(0, sequence)));
            sequence += 1;
            let guard = [Compare::CreateRevision(key.clone(), 0), Compare::CreateRevision(names.leader(), 0)];
            let value = flights::encode(entries.iter().map(|(mark, token)| (mark, *token)));
            let put = [Op::Put { key, value, lease: 0 }];
            let done = client.txn(&guard, &put, &[Op::Get(names.leader())]).await.map_err(etcd_error)?;
            if done.succeeded {
                break;
            }
            if done.ranges.first().is_some_and(Option::is_some) {
                return Err(leading(&names));
            }
        }
        migrated.in_flight += entries.len();
    }
    Ok(migrated)
}

/// The entries of migrated writes in flight, a record's worth at a time: at most
/// [`MIGRATED_PER_RECORD`] and [`MIGRATED_RECORD_BYTES`] of names.
fn per_record(flying: &[(Mark, u64)]) -> Vec<&[(Mark, u64)]> {
    let mut records = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, (mark, _)) in flying.iter().enumerate() {
        if i > start && (i - start == MIGRATED_PER_RECORD || bytes + mark.name.len() > MIGRATED_RECORD_BYTES) {
            records.push(&flying[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += mark.name.len();
    }
    if start < flying.len() {
        records.push(&flying[start..]);
    }
    records
}

/// Records [`LAYOUT`] with the fence's rules, while no instance leads, before flight records
/// are written: a build that does not read them must not lead the prefix after. Rules an
/// earlier build recorded get the line added; a prefix without rules gets `rules`, as the first
/// instance to start would record them.
async fn record_layout(client: &Client, names: &Names, rules: &str) -> Result<(), StoreError> {
    let read = client.txn(&[], &[Op::Get(names.rules())], &[]).await.map_err(etcd_error)?;
    let recorded = read.ranges.first().cloned().flatten().map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
    let stored = match &recorded {
        Some(recorded) if has_layout(recorded) => return Ok(()),
        Some(recorded) => stored_rules(recorded),
        None => stored_rules(rules),
    };
    let (unchanged, put) = replace_rules(names, recorded.as_deref(), &stored);
    let guard = [unchanged, Compare::CreateRevision(names.leader(), 0)];
    if client.txn(&guard, &[put], &[]).await.map_err(etcd_error)?.succeeded { Ok(()) } else { Err(leading(names)) }
}

/// The guard and the put that replace the recorded rules, `recorded` (`None`: absent), with
/// `rules`: the provisioning's layout line (no leader yet) and a takeover's (by the new leader)
/// write the rules this way.
pub(super) fn replace_rules(names: &Names, recorded: Option<&str>, rules: &str) -> (Compare, Op) {
    let unchanged = match recorded {
        Some(recorded) => Compare::Value(names.rules(), recorded.as_bytes().to_vec()),
        None => Compare::CreateRevision(names.rules(), 0),
    };
    (unchanged, Op::Put { key: names.rules(), value: rules.as_bytes().to_vec(), lease: 0 })
}

/// Sets `key` to `token` if it is absent or lower, while no instance leads; whether it did. A
/// level it creates raises the census in the same transaction, guarded by `census`, the census
/// as last read (`None`: absent).
async fn raise(
    client: &Client,
    names: &Names,
    key: &[u8],
    token: u64,
    census: &mut Option<u64>,
) -> Result<bool, StoreError> {
    let value = token_value(token);
    let put = Op::Put { key: key.to_vec(), value: value.clone(), lease: 0 };
    let no_leader = Compare::CreateRevision(names.leader(), 0);
    let reads = [Op::Get(key.to_vec()), Op::Get(names.leader()), Op::Get(names.census())];
    loop {
        let mut absent = vec![Compare::CreateRevision(key.to_vec(), 0), no_leader.clone()];
        let mut create = vec![put.clone()];
        match *census {
            Some(count) => {
                absent.push(Compare::Value(names.census(), token_value(count)));
                create.push(Op::Put { key: names.census(), value: token_value(count + 1), lease: 0 });
            }
            None => absent.push(Compare::CreateRevision(names.census(), 0)),
        }
        let first = client.txn(&absent, &create, &reads).await.map_err(etcd_error)?;
        if first.succeeded {
            if let Some(count) = census.as_mut() {
                *count += 1;
            }
            return Ok(true);
        }
        if first.ranges.get(1).is_some_and(Option::is_some) {
            return Err(leading(names));
        }
        *census = read_census(names, first.ranges.get(2).cloned().flatten())?;
        let Some(Some(existing)) = first.ranges.first() else { continue };
        match parse_token(&existing.value) {
            Some(t) if t >= token => return Ok(false),
            Some(_) => {}
            None => {
                let key = String::from_utf8_lossy(key);
                return Err(StoreError::Failed(format!("etcd key {key} holds no token; refusing to migrate over it")));
            }
        }
        // Padded values: a byte-wise LESS is a numeric one.
        let lower = [Compare::ValueLess(key.to_vec(), value.clone()), no_leader.clone()];
        if client.txn(&lower, std::slice::from_ref(&put), &[]).await.map_err(etcd_error)?.succeeded {
            return Ok(true);
        }
    }
}

/// The census `P/census` holds, read as `kv`: `None` if absent.
fn read_census(names: &Names, kv: Option<crate::etcd_client::Kv>) -> Result<Option<u64>, StoreError> {
    kv.map(|kv| {
        parse_token(&kv.value).ok_or_else(|| {
            StoreError::Failed(format!("etcd key {} holds no count", String::from_utf8_lossy(&names.census())))
        })
    })
    .transpose()
}

/// What differs between two records, one setting a line: `name: recorded X, configured Y`,
/// `unset` for a setting one of them lacks.
pub fn record_differences(recorded: &str, configured: &str) -> Vec<String> {
    differences(("recorded", recorded), ("configured", configured))
}

/// What differs between two records, each named by its label (`recorded`, `running`,
/// `configured`): `name: <label> X, <label> Y` a setting, `unset` for one a record lacks.
pub fn differences((one, first): (&str, &str), (other, second): (&str, &str)) -> Vec<String> {
    let parse = |text: &str| -> BTreeMap<String, String> {
        text.lines()
            .filter_map(|line| line.split_once(" = "))
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect()
    };
    let (first, second) = (parse(first), parse(second));
    let mut names: Vec<&String> = first.keys().chain(second.keys()).collect();
    names.sort();
    names.dedup();
    names
        .into_iter()
        .filter(|name| first.get(*name) != second.get(*name))
        .map(|name| {
            let said = |v: Option<&String>| v.cloned().unwrap_or_else(|| "unset".to_owned());
            format!("{name}: {one} {}, {other} {}", said(first.get(name)), said(second.get(name)))
        })
        .collect()
}

/// The fence's rules under `prefix` as etcd records them (`None` before any instance or `init`
/// recorded them), and, with `set`, `rules` recorded in their place. Setting them is refused
/// while an instance leads the prefix: instances check the record when they start and when
/// they take the lead, so once every instance stopped and started again with the new rules,
/// none fences by the old ones.
pub async fn rules(client: &Client, prefix: &str, rules: &str, set: bool) -> Result<Option<String>, StoreError> {
    let names = Names::new(prefix);
    let rules = &stored_rules(rules);
    let get = [Op::Get(names.rules()), Op::Get(names.batch())];
    let read = client.txn(&[], &get, &[]).await.map_err(etcd_error)?;
    if read.ranges.get(1).cloned().flatten().is_none() {
        return Err(super::takeover::not_initialised(names.prefix()));
    }
    let recorded = read.ranges.first().cloned().flatten().map(|kv| String::from_utf8_lossy(&kv.value).into_owned());
    if set && recorded.as_deref() != Some(rules) {
        let put = [Op::Put { key: names.rules(), value: rules.as_bytes().to_vec(), lease: 0 }];
        let done = client.txn(&[Compare::CreateRevision(names.leader(), 0)], &put, &[]).await.map_err(etcd_error)?;
        if !done.succeeded {
            return Err(leading(&names));
        }
        tracing::warn!(prefix, "the fence's rules were set by an operator: instances with other rules are refused");
    }
    Ok(recorded)
}

#[cfg(test)]
mod tests {
    use super::{Agreement, LAYOUT, agreement, record_differences, stored_rules};

    #[test]
    fn differences_name_each_setting_with_both_values() {
        let recorded = "fence.equal_token = \"reject\"\nfence.rules./a.max_jump = 10\nfence.rules./b.prefix = \"/b\"";
        let configured = "fence.equal_token = \"reject\"\nfence.rules./a.max_jump = 11\nfence.rules./a.pin = \"etag\"";
        assert_eq!(
            record_differences(recorded, configured),
            [
                "fence.rules./a.max_jump: recorded 10, configured 11",
                "fence.rules./a.pin: recorded unset, configured \"etag\"",
                "fence.rules./b.prefix: recorded \"/b\", configured unset",
            ]
        );
        assert!(record_differences(recorded, recorded).is_empty());
    }

    #[test]
    fn the_layout_line_tells_this_build_from_earlier_ones() {
        let configured = "fence.equal_token = \"reject\"\nverify.clock_skew = \"30s\"";
        let stored = stored_rules(configured);
        assert_eq!(stored, format!("fence.equal_token = \"reject\"\n{LAYOUT}\nverify.clock_skew = \"30s\""));
        assert_eq!(stored_rules(&stored), stored, "added once");
        // An earlier build, configured alike, finds the line and refuses to lead by it.
        assert_eq!(
            record_differences(&stored, configured),
            ["store.in_flight: recorded \"records\", configured unset"]
        );
        // This build takes an earlier build's record, and only one that lacks nothing else.
        assert_eq!(agreement(configured, &stored), Agreement::LacksLayout);
        assert_eq!(agreement(&stored, &stored), Agreement::Same, "nothing to add");
        let other = "fence.equal_token = \"accept\"";
        assert!(
            matches!(agreement(other, &stored), Agreement::Differ(d) if d.len() == 3),
            "{:?}",
            agreement(other, &stored)
        );
    }
}
