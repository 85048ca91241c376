//! The on-disk encoding shared by log segments and snapshots (see `docs/store.md`).
//!
//! Every file starts with a 32-byte header naming its kind, format version and sequence
//! number, protected by its own CRC32C. Records are `len u32 | crc u32 | token u64 | key`,
//! zero-padded to a multiple of 8 bytes so a length field never straddles a sector. Each file
//! seeds its record checksums with its own identity, so bytes left over from another file can
//! never validate here.

use std::io::{self, Write};

/// Size of every file header.
pub const HEADER_LEN: usize = 32;
/// Longest key a record may hold.
pub const MAX_KEY_LEN: usize = 64 * 1024;
/// Current format version of both file kinds.
pub const VERSION: u32 = 1;

/// The two kinds of file in a data directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A log segment: records appended as advances happen.
    Segment,
    /// A snapshot: the whole table as of a segment boundary, plus a trailer.
    Snapshot,
}

impl Kind {
    fn magic(self) -> &'static [u8; 8] {
        match self {
            Kind::Segment => b"FGATESEG",
            Kind::Snapshot => b"FGATESNP",
        }
    }
}

/// Checksum seed of the records in file `seq` of `kind`.
pub fn seed(kind: Kind, seq: u64) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(kind.magic()), &seq.to_le_bytes())
}

/// Encodes a file header.
pub fn header(kind: Kind, seq: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..8].copy_from_slice(kind.magic());
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32c::crc32c(&h[..24]);
    h[24..28].copy_from_slice(&crc.to_le_bytes());
    h
}

/// Checks a file header; returns its sequence number or what is wrong with it.
pub fn parse_header(kind: Kind, h: &[u8]) -> Result<u64, String> {
    let h = h.get(..HEADER_LEN).ok_or("file is shorter than its header")?;
    if &h[..8] != kind.magic() {
        return Err("not a fencegate file of this kind (bad magic)".into());
    }
    if crc32c::crc32c(&h[..24]).to_le_bytes() != h[24..28] {
        return Err("header checksum mismatch".into());
    }
    let version = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
    if version != VERSION {
        return Err(format!("format version {version} is not supported (this build reads {VERSION})"));
    }
    let mut seq = [0u8; 8];
    seq.copy_from_slice(&h[16..24]);
    Ok(u64::from_le_bytes(seq))
}

/// Bytes a record with a key of `key_len` bytes occupies, padding included.
pub fn record_len(key_len: usize) -> usize {
    (16 + key_len).next_multiple_of(8)
}

/// Appends one record to `buf`.
pub fn encode(buf: &mut Vec<u8>, seed: u32, key: &str, token: u64) {
    debug_assert!(!key.is_empty() && key.len() <= MAX_KEY_LEN);
    let len = (8 + key.len()) as u32;
    let crc = crc32c::crc32c_append(seed, &len.to_le_bytes());
    let crc = crc32c::crc32c_append(crc, &token.to_le_bytes());
    let crc = crc32c::crc32c_append(crc, key.as_bytes());
    let start = buf.len();
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(&crc.to_le_bytes());
    buf.extend_from_slice(&token.to_le_bytes());
    buf.extend_from_slice(key.as_bytes());
    buf.resize(start + record_len(key.len()), 0);
}

/// Appends a snapshot trailer: a record with length 0 whose token field holds the count.
pub fn encode_trailer(w: &mut impl Write, seed: u32, count: u64) -> io::Result<()> {
    let crc = crc32c::crc32c_append(crc32c::crc32c_append(seed, &0u32.to_le_bytes()), &count.to_le_bytes());
    w.write_all(&0u32.to_le_bytes())?;
    w.write_all(&crc.to_le_bytes())?;
    w.write_all(&count.to_le_bytes())
}

/// What [`decode`] found at an offset.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// A valid record and the bytes it occupies.
    Record { key: &'a str, token: u64, used: usize },
    /// A valid snapshot trailer.
    Trailer { count: u64 },
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
    /// The key is not UTF-8.
    Utf8,
}

impl std::fmt::Display for Bad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bad::Truncated => write!(f, "record cut short"),
            Bad::Length(n) => write!(f, "record length {n} is out of range"),
            Bad::Checksum => write!(f, "checksum mismatch"),
            Bad::Utf8 => write!(f, "key is not UTF-8"),
        }
    }
}

fn word(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at + 4)?;
    Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// Decodes the record (or trailer) at the start of `b`.
pub fn decode(b: &[u8], seed: u32) -> Result<Decoded<'_>, Bad> {
    let (Some(len), Some(crc)) = (word(b, 0), word(b, 4)) else { return Err(Bad::Truncated) };
    let token_bytes: [u8; 8] = b.get(8..16).ok_or(Bad::Truncated)?.try_into().map_err(|_| Bad::Truncated)?;
    let token = u64::from_le_bytes(token_bytes);
    let head = crc32c::crc32c_append(crc32c::crc32c_append(seed, &len.to_le_bytes()), &token_bytes);
    if len == 0 {
        return if head == crc { Ok(Decoded::Trailer { count: token }) } else { Err(Bad::Checksum) };
    }
    let key_len = (len as usize).checked_sub(8).filter(|k| (1..=MAX_KEY_LEN).contains(k)).ok_or(Bad::Length(len))?;
    let used = record_len(key_len);
    let key = b.get(16..16 + key_len).ok_or(Bad::Truncated)?;
    if b.len() < used {
        return Err(Bad::Truncated);
    }
    if crc32c::crc32c_append(head, key) != crc {
        return Err(Bad::Checksum);
    }
    let key = std::str::from_utf8(key).map_err(|_| Bad::Utf8)?;
    Ok(Decoded::Record { key, token, used })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_are_eight_byte_aligned() {
        let mut buf = Vec::new();
        encode(&mut buf, 7, "/a", 5);
        encode(&mut buf, 7, "/accounts/42", u64::MAX);
        assert_eq!(buf.len() % 8, 0);
        let Ok(Decoded::Record { key, token, used }) = decode(&buf, 7) else { panic!() };
        assert_eq!((key, token), ("/a", 5));
        assert_eq!(decode(&buf[used..], 7), Ok(Decoded::Record { key: "/accounts/42", token: u64::MAX, used: 32 }));
    }

    #[test]
    fn another_files_seed_never_validates() {
        let mut buf = Vec::new();
        encode(&mut buf, seed(Kind::Segment, 1), "/a", 5);
        assert_eq!(decode(&buf, seed(Kind::Segment, 2)), Err(Bad::Checksum));
    }

    #[test]
    fn damage_is_classified() {
        let mut buf = Vec::new();
        encode(&mut buf, 1, "/a", 5);
        assert_eq!(decode(&buf[..10], 1), Err(Bad::Truncated));
        let mut flipped = buf.clone();
        flipped[17] ^= 1;
        assert_eq!(decode(&flipped, 1), Err(Bad::Checksum));
        assert_eq!(decode(&[0xff; 24], 1), Err(Bad::Length(u32::MAX)));
        assert_eq!(decode(&[0; 24], 1), Err(Bad::Checksum), "zeros are never a trailer");
    }

    #[test]
    fn headers_name_their_kind_and_version() {
        let h = header(Kind::Snapshot, 9);
        assert_eq!(parse_header(Kind::Snapshot, &h), Ok(9));
        assert!(parse_header(Kind::Segment, &h).is_err());
        let mut bad = h;
        bad[8] = 2;
        assert!(parse_header(Kind::Snapshot, &bad).unwrap_err().contains("checksum"));
    }
}
