//! The keys a DeleteObjects body names: `<Delete><Object><Key>…</Key></Object>…</Delete>`, read
//! with a real XML parser (entities and character references resolved, text kept as written)
//! under a size bound. S3 takes at most 1,000 keys of at most 1,024 bytes each.

use serde::Deserialize;

use crate::refusal::Refusal;

/// Most bytes of a DeleteObjects body read: 1,000 keys of 1,024 bytes each, written with
/// character references and the XML around them.
pub(super) const MAX_BODY: usize = 8 << 20;

/// Most keys one DeleteObjects may name, as S3 takes.
const MAX_KEYS: usize = 1000;

#[derive(Deserialize)]
struct Delete {
    #[serde(rename = "Object", default)]
    objects: Vec<Object>,
}

#[derive(Deserialize)]
struct Object {
    #[serde(rename = "Key")]
    key: String,
}

/// The keys `body` names; a body that is not such a document, names no key or more than S3
/// takes is refused, since what the server would delete is then unknowable.
pub(super) fn keys(body: &[u8]) -> Result<Vec<String>, Refusal> {
    let malformed =
        |why: String| Refusal::BadRequest(format!("the DeleteObjects body is not one fencegate can read: {why}"));
    let text = std::str::from_utf8(body).map_err(|_| malformed("not UTF-8".into()))?;
    let delete: Delete = quick_xml::de::from_str(text).map_err(|e| malformed(e.to_string()))?;
    match delete.objects.len() {
        0 => Err(malformed("it names no key".into())),
        n if n > MAX_KEYS => Err(malformed(format!("it names {n} keys, more than the {MAX_KEYS} S3 takes"))),
        _ => Ok(delete.objects.into_iter().map(|o| o.key).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_read_as_written_with_references_resolved() {
        let body = br#"<?xml version="1.0" encoding="UTF-8"?>
<Delete xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Quiet>true</Quiet>
<Object><Key>a</Key></Object><Object><Key> sp ace </Key><VersionId>v1</VersionId></Object>
<Object><Key>x&amp;y&#x2F;z</Key></Object><Object><Key><![CDATA[c<d]]></Key></Object></Delete>"#;
        assert_eq!(keys(body).unwrap(), ["a", " sp ace ", "x&y/z", "c<d"]);
    }

    #[test]
    fn bodies_that_name_nothing_or_too_much_are_refused() {
        assert!(keys(b"<Delete></Delete>").is_err());
        assert!(keys(b"<Delete><Object><Key>a</Key></Object>").is_err(), "unclosed");
        assert!(keys(b"not xml").is_err());
        assert!(keys(&[0xff, 0xfe]).is_err());
        let many: String = (0..1001).map(|i| format!("<Object><Key>k{i}</Key></Object>")).collect();
        assert!(keys(format!("<Delete>{many}</Delete>").as_bytes()).is_err());
    }
}
