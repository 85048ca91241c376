//! Property checks on arbitrary input, shared by the `cargo fuzz` targets in `fuzz/` and by
//! `tests/meta/fuzz_corpus.rs`, which replays the checked-in corpus on the stable toolchain. Each
//! check panics only when a property fails, never because the input is garbage.

use crate::config::Config;
use crate::fence::path::{self, EscapedSlashes, MatrixParams, PathPolicy, TrailingSlash};
use crate::fence::token;
use crate::store::format::{FileKind, HEADER_LEN, Header, VERSION};
use crate::store::recovery::{self, Mode, segment_name};
use crate::store::{MarkKind, Table};

/// The token parser accepts exactly the decimal u64s.
pub fn token(data: &[u8]) {
    let std_parse = std::str::from_utf8(data).ok().filter(|s| s.bytes().all(|b| b.is_ascii_digit()));
    let expected = std_parse.and_then(|s| s.parse::<u64>().ok());
    assert_eq!(token::parse(data).ok(), expected, "{data:?}");
}

/// The first byte picks a path policy; the rest is the path.
pub fn path(data: &[u8]) {
    let Some((&bits, rest)) = data.split_first() else { return };
    let Ok(raw) = std::str::from_utf8(rest) else { return };
    let policy = PathPolicy {
        escaped_slashes: if bits & 1 == 0 { EscapedSlashes::Reject } else { EscapedSlashes::Decode },
        merge_slashes: bits & 2 == 0,
        case_sensitive: bits & 4 == 0,
        trailing_slash: if bits & 8 == 0 { TrailingSlash::Distinct } else { TrailingSlash::Strip },
        matrix_params: if bits & 16 == 0 { MatrixParams::Reject } else { MatrixParams::Allow },
    };
    let Ok(c) = path::canonicalize(raw, &policy) else { return };
    assert_eq!(path::canonicalize(&c, &policy).as_ref(), Ok(&c), "not idempotent: {raw:?}");
    assert!(c.starts_with('/'), "{raw:?} -> {c:?}");
    assert!(!policy.merge_slashes || !c.contains("//"), "{raw:?} -> {c:?}");
    assert!(c.split('/').all(|s| s != "." && s != ".."), "dot segment: {raw:?} -> {c:?}");
    let lower = c.to_ascii_lowercase();
    for escape in ["%2f", "%5c", "%2e", "%00"] {
        assert!(!lower.contains(escape), "{escape} left in {raw:?} -> {c:?}");
    }
    assert!(policy.matrix_params == MatrixParams::Allow || !c.contains(';'), "{raw:?} -> {c:?}");
    assert!(policy.trailing_slash == TrailingSlash::Distinct || c == "/" || !c.ends_with('/'), "{c:?}");
    // What is forwarded must be a valid request target, and exactly the key.
    assert!(http::uri::PathAndQuery::try_from(c.as_str()).is_ok(), "unforwardable: {c:?}");
    assert_eq!(crate::fence::keys::resource_key(&c, &[]), c);
}

/// A configuration either fails with an error or yields settings that load back the same.
pub fn config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(config) = Config::from_toml_str(text) else { return };
    let printed = config.to_toml();
    let again = Config::from_toml_str(&printed).unwrap_or_else(|e| panic!("effective settings do not load: {e}"));
    assert_eq!(again.to_toml(), printed);
}

/// Arbitrary bytes after a valid segment header: recovery never panics, a read-only pass and
/// a repairing pass agree, and after a repair the segment recovers cleanly to the same table.
pub fn recovery(data: &[u8]) {
    let Ok(dir) = tempfile::tempdir() else { return };
    // A fixed salt, so a corpus can hold valid records for the fuzzer to mutate.
    let header = Header { seq: 1, salt: 0, version: VERSION }.encode(FileKind::Segment);
    let mut file = Vec::with_capacity(HEADER_LEN + data.len());
    file.extend_from_slice(&header);
    file.extend_from_slice(data);
    if std::fs::write(dir.path().join(segment_name(1)), &file).is_err() {
        return;
    }
    let contents = |t: &Table| {
        let mut all = Vec::new();
        t.for_each(MarkKind::Key, |k, v, f| all.push((false, k.to_owned(), v, f)));
        t.for_each(MarkKind::Floor, |p, v, f| all.push((true, p.to_owned(), v, f)));
        all.sort();
        all
    };
    let (read_only, repaired, again) = (Table::new(), Table::new(), Table::new());
    let first = recovery::recover(dir.path(), &read_only, Mode::ReadOnly);
    let second = recovery::recover(dir.path(), &repaired, Mode::Repair);
    match (&first, &second) {
        (Ok(_), Ok(_)) => assert_eq!(contents(&read_only), contents(&repaired)),
        (Err(_), Err(_)) => return,
        _ => panic!("read-only and repairing recovery disagree: {first:?} vs {second:?}"),
    }
    let third = recovery::recover(dir.path(), &again, Mode::Repair).expect("a repaired log recovers");
    assert!(third.torn.is_none(), "a repaired log is whole");
    assert_eq!(contents(&again), contents(&repaired));
}

/// Seed inputs for [`recovery`]: valid batches, and the ways a crash cuts them.
pub fn recovery_seeds() -> Vec<Vec<u8>> {
    use crate::store::format::{Kind, encode, encode_commit};
    let seed = Header { seq: 1, salt: 0, version: VERSION }.seed(FileKind::Segment);
    let mut one = Vec::new();
    encode(&mut one, seed, Kind::Advance, "/accounts/42", 34);
    encode(&mut one, seed, Kind::Advance, "/b", 7);
    encode_commit(&mut one, seed, HEADER_LEN as u64, HEADER_LEN as u64);
    let mut two = one.clone();
    let start = (HEADER_LEN + one.len()) as u64;
    encode(&mut two, seed, Kind::Answered, "/accounts/42", 34);
    encode(&mut two, seed, Kind::Advance, "/b", 8);
    encode_commit(&mut two, seed, start, start);
    let mut seeds = vec![Vec::new(), one.clone(), two.clone()];
    seeds.push(two[..two.len() - 5].to_vec());
    seeds.push([two.clone(), vec![0; 64]].concat());
    let mut holed = two.clone();
    holed[one.len()..one.len() + 16].fill(0);
    seeds.push(holed);
    // A batch advancing a floor and a key together, then the floor's answer.
    let mut floors = two.clone();
    let start = (HEADER_LEN + two.len()) as u64;
    encode(&mut floors, seed, Kind::FloorAdvance, "/accounts/", 35);
    encode(&mut floors, seed, Kind::Advance, "/accounts/42", 35);
    encode_commit(&mut floors, seed, start, start);
    let start = (HEADER_LEN + floors.len()) as u64;
    encode(&mut floors, seed, Kind::FloorAnswered, "/accounts/", 35);
    encode_commit(&mut floors, seed, start, start);
    seeds.push(floors[..floors.len() - 40].to_vec());
    seeds.push(floors);
    seeds
}
