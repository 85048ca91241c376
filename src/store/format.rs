//! The on-disk encoding shared by log segments and snapshots (see `docs/store.md`).
//!
//! Every file starts with a 40-byte header: kind, format version, sequence number and a random
//! salt, protected by its own CRC32C. Records are `len u32 | crc u32 | token u64 | kind u8 |
//! key`, zero-padded to a multiple of 8 bytes so a length field never straddles a sector. Record
//! checksums are seeded with the file's identity and salt: bytes from another file, or a record
//! a client forged inside its own key, never validate.
//!
//! Version 2 added the floor records (kinds 6 to 8), version 3 the reset records (9 and 10),
//! version 4 the binding records (11 to 13); files of earlier versions, which cannot hold
//! them, are still read.

use std::hash::BuildHasher;
use std::io::{self, Write};

use super::{Change, MarkKind};

/// Size of every file header.
pub const HEADER_LEN: usize = 40;
/// Longest key a record may hold.
pub const MAX_KEY_LEN: usize = 64 * 1024;
/// Format version of the files this build writes.
pub const VERSION: u32 = 4;
/// Oldest format version this build reads.
pub const MIN_VERSION: u32 = 1;
/// The first version whose files may hold floor records.
pub const FLOORS_SINCE: u32 = 2;
/// The first version whose files may hold reset records.
pub const RESETS_SINCE: u32 = 3;
/// The first version whose files may hold binding records.
pub const BINDINGS_SINCE: u32 = 4;

/// The two kinds of file in a data directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    /// A log segment: batches of records, each closed by a commit marker.
    Segment,
    /// A snapshot: the whole table as of a segment boundary, then a trailer.
    Snapshot,
}

impl FileKind {
    fn magic(self) -> &'static [u8; 8] {
        match self {
            FileKind::Segment => b"FGATESEG",
            FileKind::Snapshot => b"FGATESNP",
        }
    }
}

/// What a record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `max_seen[key] >= token` (snapshots).
    State = 1,
    /// `max_seen[key] >= token`, and a write with this token is on its way to the backend.
    Advance = 2,
    /// The write with this token has been answered by the backend: no longer in flight.
    Answered = 3,
    /// Closes a batch; the token field holds the batch's start offset, the 8-byte payload the
    /// file length known durable when the batch was written.
    Commit = 4,
    /// Ends a snapshot; the token field holds its record count.
    Trailer = 5,
    /// `floor[key] >= token`, and a write with this token, covering everything under `key`, is
    /// on its way to the backend. Version 2 on.
    FloorAdvance = 6,
    /// The write with this token that raised the floor `key` has been answered. Version 2 on.
    FloorAnswered = 7,
    /// `floor[key] >= token` (snapshots). Version 2 on.
    FloorState = 8,
    /// `max_seen[key] = token`, lowered by an operator's reset. Unlike every other record it
    /// may lower the mark, so it counts only in log order: records before it are overruled,
    /// records after it raise the mark again. Version 3 on.
    Reset = 9,
    /// `floor[key] = token`, lowered by an operator's reset, in log order as [`Kind::Reset`].
    /// Version 3 on.
    FloorReset = 10,
    /// `binding[key] = token` (snapshots): the upload `key` names was created with `token`.
    /// Version 4 on.
    BindingState = 11,
    /// `binding[key] = token`, bound when the upload was created. Version 4 on.
    Bound = 12,
    /// The binding `key` is dropped: its upload ended, or can never complete. Counts in log
    /// order. Version 4 on.
    Dropped = 13,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::State,
            2 => Kind::Advance,
            3 => Kind::Answered,
            4 => Kind::Commit,
            5 => Kind::Trailer,
            6 => Kind::FloorAdvance,
            7 => Kind::FloorAnswered,
            8 => Kind::FloorState,
            9 => Kind::Reset,
            10 => Kind::FloorReset,
            11 => Kind::BindingState,
            12 => Kind::Bound,
            13 => Kind::Dropped,
            _ => return None,
        })
    }

    fn payload_ok(self, len: usize) -> bool {
        match self {
            Kind::Commit => len == 8,
            Kind::Trailer => len == 0,
            _ => len > 0,
        }
    }

    /// The record that says `says` of a mark of `kind`; `None` for what no record says (an
    /// answer or a reset of a binding, a drop of a key or floor: `MarkBatch::check` refuses
    /// such batches). With [`Kind::says`], the one place a record kind is tied to a kind of
    /// mark.
    pub fn keyed(says: Says, kind: MarkKind) -> Option<Kind> {
        Some(match (says, kind) {
            (Says::State, MarkKind::Key) => Kind::State,
            (Says::Advance, MarkKind::Key) => Kind::Advance,
            (Says::Answered, MarkKind::Key) => Kind::Answered,
            (Says::Reset, MarkKind::Key) => Kind::Reset,
            (Says::State, MarkKind::Floor) => Kind::FloorState,
            (Says::Advance, MarkKind::Floor) => Kind::FloorAdvance,
            (Says::Answered, MarkKind::Floor) => Kind::FloorAnswered,
            (Says::Reset, MarkKind::Floor) => Kind::FloorReset,
            (Says::State, MarkKind::Upload) => Kind::BindingState,
            (Says::Advance, MarkKind::Upload) => Kind::Bound,
            (Says::Drop, MarkKind::Upload) => Kind::Dropped,
            (Says::Answered | Says::Reset, MarkKind::Upload) | (Says::Drop, MarkKind::Key | MarkKind::Floor) => {
                return None;
            }
        })
    }

    /// What a keyed record says, and of which kind of mark; `None` for commit markers and
    /// trailers.
    pub fn says(self) -> Option<(Says, MarkKind)> {
        Some(match self {
            Kind::State => (Says::State, MarkKind::Key),
            Kind::Advance => (Says::Advance, MarkKind::Key),
            Kind::Answered => (Says::Answered, MarkKind::Key),
            Kind::Reset => (Says::Reset, MarkKind::Key),
            Kind::FloorState => (Says::State, MarkKind::Floor),
            Kind::FloorAdvance => (Says::Advance, MarkKind::Floor),
            Kind::FloorAnswered => (Says::Answered, MarkKind::Floor),
            Kind::FloorReset => (Says::Reset, MarkKind::Floor),
            Kind::BindingState => (Says::State, MarkKind::Upload),
            Kind::Bound => (Says::Advance, MarkKind::Upload),
            Kind::Dropped => (Says::Drop, MarkKind::Upload),
            Kind::Commit | Kind::Trailer => return None,
        })
    }

    /// The oldest format version whose files may hold this kind of record.
    pub fn since(self) -> u32 {
        match self {
            Kind::FloorAdvance | Kind::FloorAnswered | Kind::FloorState => FLOORS_SINCE,
            Kind::Reset | Kind::FloorReset => RESETS_SINCE,
            Kind::BindingState | Kind::Bound | Kind::Dropped => BINDINGS_SINCE,
            _ => MIN_VERSION,
        }
    }
}

/// What a keyed record says of its mark, whatever the mark's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Says {
    /// The mark stands at least at the token (snapshots).
    State,
    /// The mark stands at least at the token, and a write with it is on its way to the backend.
    Advance,
    /// The write with the token that raised the mark has been answered.
    Answered,
    /// The mark is set to the token by an operator's reset, in log order.
    Reset,
    /// The mark is removed (a binding's drop), in log order.
    Drop,
}

impl From<Change> for Says {
    /// What the records of a batch making `change` say.
    fn from(change: Change) -> Says {
        match change {
            Change::Advance => Says::Advance,
            Change::Reset => Says::Reset,
            Change::Answered => Says::Answered,
            Change::Drop => Says::Drop,
        }
    }
}

/// The versions this build reads, as an error message names them.
fn readable_versions() -> String {
    match VERSION - MIN_VERSION {
        0 => format!("{VERSION}"),
        1 => format!("{MIN_VERSION} and {VERSION}"),
        _ => format!("{MIN_VERSION} to {VERSION}"),
    }
}

/// A file's identity as written in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Sequence number (segment number; for a snapshot, the first segment after it).
    pub seq: u64,
    /// Random per-file salt.
    pub salt: u64,
    /// Format version: [`VERSION`] for every file this build creates.
    pub version: u32,
}

impl Header {
    /// A header for a new file, with a fresh random salt.
    pub fn new(seq: u64) -> Header {
        // RandomState is keyed from the OS's randomness; no extra dependency needed.
        let salt = std::collections::hash_map::RandomState::new().hash_one(seq);
        Header { seq, salt, version: VERSION }
    }

    /// Checksum seed of the records in this file.
    pub fn seed(&self, kind: FileKind) -> u32 {
        let crc = crc32c::crc32c_append(crc32c::crc32c(kind.magic()), &self.seq.to_le_bytes());
        crc32c::crc32c_append(crc, &self.salt.to_le_bytes())
    }

    /// Encodes the header.
    pub fn encode(&self, kind: FileKind) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..8].copy_from_slice(kind.magic());
        h[8..12].copy_from_slice(&self.version.to_le_bytes());
        h[16..24].copy_from_slice(&self.seq.to_le_bytes());
        h[24..32].copy_from_slice(&self.salt.to_le_bytes());
        let crc = crc32c::crc32c(&h[..32]);
        h[32..36].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Checks a header; returns it or what is wrong with it.
    pub fn parse(kind: FileKind, h: &[u8]) -> Result<Header, String> {
        let h = h.get(..HEADER_LEN).ok_or("file is shorter than its header")?;
        if &h[..8] != kind.magic() {
            return Err("not a fencegate file of this kind (bad magic)".into());
        }
        if crc32c::crc32c(&h[..32]).to_le_bytes() != h[32..36] {
            return Err("header checksum mismatch".into());
        }
        let version = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        if !(MIN_VERSION..=VERSION).contains(&version) {
            return Err(format!(
                "format version {version} is not supported (this build reads {})",
                readable_versions()
            ));
        }
        let u64_at = |at: usize| h[at..at + 8].iter().rev().fold(0u64, |acc, b| acc << 8 | u64::from(*b));
        Ok(Header { seq: u64_at(16), salt: u64_at(24), version })
    }
}

/// Bytes a record with a key of `key_len` bytes occupies, padding included.
pub fn record_len(key_len: usize) -> usize {
    (17 + key_len).next_multiple_of(8)
}

/// CRC32C, seeded, of a record's bytes without the checksum field: the length, then token,
/// kind and payload. Two calls over the record as laid out, since each call has a fixed cost
/// that dwarfs these few bytes.
fn checksum(seed: u32, record: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c_append(seed, &record[..4]), &record[8..])
}

fn encode_raw(buf: &mut Vec<u8>, seed: u32, kind: Kind, payload: &[u8], token: u64) {
    debug_assert!(payload.len() <= MAX_KEY_LEN && kind.payload_ok(payload.len()));
    let len = (9 + payload.len()) as u32;
    let start = buf.len();
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&[0; 4]);
    buf.extend_from_slice(&token.to_le_bytes());
    buf.push(kind as u8);
    buf.extend_from_slice(payload);
    let crc = checksum(seed, &buf[start..]);
    buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
    buf.resize(start + record_len(payload.len()), 0);
}

/// Appends one keyed record (a key's or a floor's State, Advance or Answered) to `buf`.
pub fn encode(buf: &mut Vec<u8>, seed: u32, kind: Kind, key: &str, token: u64) {
    encode_raw(buf, seed, kind, key.as_bytes(), token);
}

/// Appends the commit marker of a batch that starts at `batch_start`, written when the file
/// was known durable up to `durable`.
pub fn encode_commit(buf: &mut Vec<u8>, seed: u32, batch_start: u64, durable: u64) {
    encode_raw(buf, seed, Kind::Commit, &durable.to_le_bytes(), batch_start);
}

/// Writes a snapshot trailer holding the record count.
pub fn write_trailer(w: &mut impl Write, seed: u32, count: u64) -> io::Result<()> {
    let mut buf = Vec::with_capacity(24);
    encode_raw(&mut buf, seed, Kind::Trailer, &[], count);
    w.write_all(&buf)
}

/// A valid record.
#[derive(Debug, PartialEq, Eq)]
pub struct Record<'a> {
    /// What it says.
    pub kind: Kind,
    /// The key (empty for commit markers and trailers).
    pub key: &'a str,
    /// The token (batch start for commit markers, count for trailers).
    pub token: u64,
    /// For a commit marker: the file length known durable when its batch was written.
    pub durable: u64,
    /// Bytes it occupies.
    pub used: usize,
}

/// Why the bytes at an offset are not a valid record.
#[derive(Debug, PartialEq, Eq)]
pub enum Bad {
    /// The buffer ends inside the record.
    Truncated,
    /// The length field is impossible.
    Length(u32),
    /// The checksum does not match.
    Checksum,
    /// The checksum matches but the content is impossible.
    Malformed,
}

impl std::fmt::Display for Bad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bad::Truncated => write!(f, "record cut short"),
            Bad::Length(n) => write!(f, "record length {n} is out of range"),
            Bad::Checksum => write!(f, "checksum mismatch"),
            Bad::Malformed => write!(f, "record kind or key is invalid"),
        }
    }
}

/// Decodes the record at the start of `b`.
pub fn decode(b: &[u8], seed: u32) -> Result<Record<'_>, Bad> {
    let fixed: &[u8; 17] = b.get(..17).and_then(|f| f.try_into().ok()).ok_or(Bad::Truncated)?;
    let len = u32::from_le_bytes([fixed[0], fixed[1], fixed[2], fixed[3]]);
    let crc = u32::from_le_bytes([fixed[4], fixed[5], fixed[6], fixed[7]]);
    let token = fixed[8..16].iter().rev().fold(0u64, |acc, b| acc << 8 | u64::from(*b));
    let key_len = (len as usize).checked_sub(9).filter(|k| *k <= MAX_KEY_LEN).ok_or(Bad::Length(len))?;
    let used = record_len(key_len);
    if b.len() < used {
        return Err(Bad::Truncated);
    }
    let key = &b[17..17 + key_len];
    if checksum(seed, &b[..17 + key_len]) != crc {
        return Err(Bad::Checksum);
    }
    let kind = Kind::from_u8(fixed[16]).filter(|k| k.payload_ok(key.len())).ok_or(Bad::Malformed)?;
    if kind == Kind::Commit {
        let durable = key.iter().rev().fold(0u64, |acc, b| acc << 8 | u64::from(*b));
        return Ok(Record { kind, key: "", token, durable, used });
    }
    let key = std::str::from_utf8(key).map_err(|_| Bad::Malformed)?;
    Ok(Record { kind, key, token, durable: 0, used })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_are_eight_byte_aligned() {
        let mut buf = Vec::new();
        encode(&mut buf, 7, Kind::Advance, "/a", 5);
        encode(&mut buf, 7, Kind::Answered, "/accounts/42", u64::MAX);
        encode_commit(&mut buf, 7, 40, 32);
        assert_eq!(buf.len() % 8, 0);
        let r = decode(&buf, 7).unwrap();
        assert_eq!((r.kind, r.key, r.token, r.used), (Kind::Advance, "/a", 5, 24));
        let r = decode(&buf[24..], 7).unwrap();
        assert_eq!((r.kind, r.key, r.token, r.used), (Kind::Answered, "/accounts/42", u64::MAX, 32));
        let commit = decode(&buf[56..], 7).unwrap();
        assert_eq!((commit.kind, commit.token, commit.durable), (Kind::Commit, 40, 32));
    }

    #[test]
    fn the_record_bytes_and_checksum_are_pinned() {
        // Logs written by earlier versions must still verify: CRC32C from the file's seed over
        // the length, then token, kind and key, as laid out; zero padding to 8 bytes.
        let mut buf = Vec::new();
        encode(&mut buf, 7, Kind::Advance, "/a", 5);
        let parts: [&[u8]; 4] = [&11u32.to_le_bytes(), &5u64.to_le_bytes(), &[2], b"/a"];
        let crc = parts.iter().fold(7, |crc, part| crc32c::crc32c_append(crc, part));
        assert_eq!(buf[4..8], crc.to_le_bytes());
        assert_eq!(buf, [11, 0, 0, 0, 74, 75, 196, 127, 5, 0, 0, 0, 0, 0, 0, 0, 2, b'/', b'a', 0, 0, 0, 0, 0]);
    }

    #[test]
    fn another_files_seed_never_validates() {
        let (one, two) = (Header::new(1), Header::new(1));
        assert_ne!(one.salt, two.salt, "each file gets its own salt");
        let mut buf = Vec::new();
        encode(&mut buf, one.seed(FileKind::Segment), Kind::Advance, "/a", 5);
        assert_eq!(decode(&buf, two.seed(FileKind::Segment)), Err(Bad::Checksum));
    }

    #[test]
    fn damage_is_classified() {
        let mut buf = Vec::new();
        encode(&mut buf, 1, Kind::Advance, "/a", 5);
        assert_eq!(decode(&buf[..10], 1), Err(Bad::Truncated));
        assert_eq!(decode(&buf[..20], 1), Err(Bad::Truncated));
        let mut flipped = buf.clone();
        flipped[17] ^= 1;
        assert_eq!(decode(&flipped, 1), Err(Bad::Checksum));
        assert_eq!(decode(&[0xff; 24], 1), Err(Bad::Length(u32::MAX)));
        assert_eq!(decode(&[0; 24], 1), Err(Bad::Length(0)), "zeros are never a record");
    }

    #[test]
    fn headers_name_their_kind_version_and_salt() {
        let h = Header::new(9);
        assert_eq!(h.version, 4);
        let bytes = h.encode(FileKind::Snapshot);
        assert_eq!(bytes[8..12], [4, 0, 0, 0]);
        assert_eq!(Header::parse(FileKind::Snapshot, &bytes), Ok(h));
        assert!(Header::parse(FileKind::Segment, &bytes).is_err());
        let mut bad = bytes;
        bad[8] = 5;
        assert!(Header::parse(FileKind::Snapshot, &bad).unwrap_err().contains("checksum"));
    }

    #[test]
    fn version_one_is_read_and_an_unknown_version_is_refused_by_name() {
        let old = Header { version: 1, ..Header::new(4) };
        assert_eq!(Header::parse(FileKind::Segment, &old.encode(FileKind::Segment)), Ok(old));
        for (version, named) in [(5, "format version 5"), (0, "format version 0"), (u32::MAX, "4294967295")] {
            let newer = Header { version, ..Header::new(4) };
            let err = Header::parse(FileKind::Segment, &newer.encode(FileKind::Segment)).unwrap_err();
            assert!(err.contains(named) && err.contains("not supported (this build reads 1 to 4)"), "{err}");
        }
    }

    #[test]
    fn floor_records_round_trip_and_only_version_two_may_hold_them() {
        let mut buf = Vec::new();
        for (i, kind) in [Kind::FloorAdvance, Kind::FloorAnswered, Kind::FloorState].into_iter().enumerate() {
            encode(&mut buf, 7, kind, "/dir/", 40 + i as u64);
        }
        let mut at = 0;
        for (i, kind) in [Kind::FloorAdvance, Kind::FloorAnswered, Kind::FloorState].into_iter().enumerate() {
            let r = decode(&buf[at..], 7).unwrap();
            assert_eq!((r.kind, r.key, r.token), (kind, "/dir/", 40 + i as u64));
            assert_eq!((kind as u8, kind.since()), (6 + i as u8, 2));
            at += r.used;
        }
        assert_eq!(Kind::keyed(Says::Advance, MarkKind::Floor), Some(Kind::FloorAdvance));
        assert_eq!(Kind::keyed(Says::Answered, MarkKind::Key), Some(Kind::Answered));
        for kind in (1..=13u8).filter_map(Kind::from_u8) {
            let keyed = kind.says().map(|(says, mark)| Kind::keyed(says, mark));
            assert!(keyed.is_none_or(|k| k == Some(kind)), "{kind:?} maps back to itself");
        }
        assert_eq!(Kind::Advance.since(), 1);
        let mut unknown = Vec::new();
        encode(&mut unknown, 7, Kind::Advance, "/a", 1);
        unknown[16] = 14;
        let crc = checksum(7, &unknown[..19]);
        unknown[4..8].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode(&unknown, 7), Err(Bad::Malformed), "kind 14 is not a record");
    }

    #[test]
    fn binding_records_round_trip_and_only_version_four_may_hold_them() {
        let mut buf = Vec::new();
        for says in [Says::State, Says::Advance, Says::Drop] {
            encode(&mut buf, 7, Kind::keyed(says, MarkKind::Upload).unwrap(), "/b/k\nid", 5);
        }
        let mut at = 0;
        for (i, kind) in [Kind::BindingState, Kind::Bound, Kind::Dropped].into_iter().enumerate() {
            let r = decode(&buf[at..], 7).unwrap();
            assert_eq!((r.kind, r.key, r.kind as u8, r.kind.since()), (kind, "/b/k\nid", 11 + i as u8, 4));
            at += r.used;
        }
        assert_eq!(Kind::keyed(Says::Drop, MarkKind::Key), None, "a key is never dropped");
        assert_eq!(Kind::keyed(Says::Reset, MarkKind::Upload), None, "nor a binding reset");
    }

    #[test]
    fn reset_records_round_trip_and_only_version_three_may_hold_them() {
        let mut buf = Vec::new();
        encode(&mut buf, 7, Kind::keyed(Says::Reset, MarkKind::Key).unwrap(), "/a", 5);
        encode(&mut buf, 7, Kind::keyed(Says::Reset, MarkKind::Floor).unwrap(), "/d", 6);
        let r = decode(&buf, 7).unwrap();
        assert_eq!((r.kind, r.key, r.token, r.kind as u8, r.kind.since()), (Kind::Reset, "/a", 5, 9, 3));
        let r = decode(&buf[r.used..], 7).unwrap();
        assert_eq!((r.kind, r.key, r.token, r.kind as u8, r.kind.since()), (Kind::FloorReset, "/d", 6, 10, 3));
    }
}
