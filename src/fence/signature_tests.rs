use std::time::Duration;

use proptest::prelude::*;

use super::*;

const KEY: &[u8] = b"fencegate-test-vector-key-0001";
/// docs/tokens.md's test vector, made by Python's hmac module (tests/proxy/verify_hmac.rs checks it
/// against Python again).
const VECTOR: &str = "v1.2026-12.1798761600.VZM0a-kk2OxawpeacXqAUTMvsalDMphGceWO79KilRY";

fn secret(bytes: &[u8]) -> Secret {
    Secret::new(bytes.to_vec()).unwrap()
}

fn keys(skew: u64) -> HmacKeys {
    let s = secret(KEY);
    HmacKeys::new([("2026-12", &s)], Duration::from_secs(skew))
}

#[test]
fn sign_makes_the_documented_vector_and_verify_accepts_it() {
    assert_eq!(sign(&secret(KEY), "2026-12", "default", 48213, 1798761600).unwrap(), VECTOR);
    let sig = Signature::parse(VECTOR.as_bytes()).unwrap();
    assert_eq!((sig.kid(), sig.expiry()), ("2026-12", 1798761600));
    assert_eq!(keys(30).verify(&sig, "default", 48213, 1798761600), Ok(()));
    assert_eq!(message("k", "d", 7, 0), b"v1\nk\nd\n7\n0");
}

#[test]
fn a_signature_binds_its_token_domain_expiry_and_key() {
    let k = keys(30);
    let sig = Signature::parse(VECTOR.as_bytes()).unwrap();
    let wrong = |r: Result<(), Rejected>| r.unwrap_err().reason();
    assert_eq!(wrong(k.verify(&sig, "default", 48214, 0)), "wrong_mac", "another token");
    assert_eq!(wrong(k.verify(&sig, "consul", 48213, 0)), "wrong_mac", "another domain");
    let later = VECTOR.replace("1798761600", "1798761601");
    assert_eq!(wrong(k.verify(&Signature::parse(later.as_bytes()).unwrap(), "default", 48213, 0)), "wrong_mac");
    let other = secret(b"another-secret-of-enough-bytes");
    let rotated = HmacKeys::new([("2026-12", &other)], Duration::from_secs(30));
    assert_eq!(wrong(rotated.verify(&sig, "default", 48213, 0)), "wrong_mac", "another secret under the id");
    let elsewhere = HmacKeys::new([("2027-01", &other)], Duration::from_secs(30));
    let err = elsewhere.verify(&sig, "default", 48213, 0).unwrap_err();
    assert_eq!((err.reason(), err.kid()), ("unknown_key", "2026-12"));
    assert!(HmacKeys::new([], Duration::from_secs(1)).is_empty());
}

#[test]
fn expiry_is_allowed_the_clock_skew_and_no_more() {
    let k = keys(30);
    let sig = Signature::parse(VECTOR.as_bytes()).unwrap();
    let at = |now| k.verify(&sig, "default", 48213, now);
    assert_eq!(at(1798761600 + 30), Ok(()), "expiry + skew is still accepted");
    let err = at(1798761600 + 31).unwrap_err();
    assert_eq!(err, Rejected::Expired { kid: "2026-12".into(), expiry: 1798761600, now: 1798761631, skew: 30 });
    assert!(err.to_string().contains("expired at 1798761600"), "{err}");
    let forever = sign(&secret(KEY), "2026-12", "default", 1, u64::MAX).unwrap();
    assert_eq!(k.verify(&Signature::parse(forever.as_bytes()).unwrap(), "default", 1, u64::MAX), Ok(()), "no overflow");
}

#[test]
fn malformed_headers_are_refused_never_repaired() {
    let mac = VECTOR.rsplit('.').next().unwrap();
    let cases = [
        (String::new(), SignatureError::Shape),
        ("v1.2026-12.1798761600".to_owned(), SignatureError::Shape),
        (format!("{VECTOR}.x"), SignatureError::Shape),
        (format!("v2.2026-12.1798761600.{mac}"), SignatureError::Version("v2".into())),
        (format!("V1.2026-12.1798761600.{mac}"), SignatureError::Version("V1".into())),
        (format!("v1..1798761600.{mac}"), SignatureError::Kid),
        (format!("v1.20 26.1798761600.{mac}"), SignatureError::Kid),
        (format!("v1.{}.1798761600.{mac}", "k".repeat(65)), SignatureError::Kid),
        (format!("v1.2026-12.01798761600.{mac}"), SignatureError::Expiry),
        (format!("v1.2026-12.+1798761600.{mac}"), SignatureError::Expiry),
        (format!("v1.2026-12.0x10.{mac}"), SignatureError::Expiry),
        (format!("v1.2026-12..{mac}"), SignatureError::Expiry),
        (format!("v1.2026-12.18446744073709551616.{mac}"), SignatureError::Expiry),
        (format!("v1.2026-12.1798761600.{mac}="), SignatureError::Mac),
        (format!("v1.2026-12.1798761600.{}", &mac[..42]), SignatureError::Mac),
        (format!("v1.2026-12.1798761600.{}+", &mac[..42]), SignatureError::Mac),
        (format!("v1.2026-12.1798761600.{}/", &mac[..42]), SignatureError::Mac),
        // The last character carries 2 bits that are not part of the MAC: only one spelling.
        (format!("v1.2026-12.1798761600.{}Z", &mac[..42]), SignatureError::Mac),
    ];
    for (value, error) in cases {
        assert_eq!(Signature::parse(value.as_bytes()), Err(error), "{value:?}");
    }
    assert_eq!(Signature::parse(b"v1.k.1.\xff"), Err(SignatureError::Shape));
    assert!(Signature::parse(format!("v1.2026-12.0.{mac}").as_bytes()).is_ok(), "0 is a decimal");
}

#[test]
fn keys_need_sixteen_bytes_and_key_ids_a_narrow_grammar() {
    assert_eq!(Secret::new(Vec::new()), Err(KeyError::Empty));
    assert_eq!(Secret::new(vec![b'x'; 15]), Err(KeyError::TooShort(15)));
    assert_eq!(Secret::new(vec![b'x'; 16]).unwrap().len(), 16);
    assert_eq!(Secret::new(vec![b'x'; MAX_KEY_BYTES + 1]), Err(KeyError::TooLong));
    for kid in ["2026-12", "a", "A_z-9", &"k".repeat(64)] {
        assert!(valid_kid(kid), "{kid}");
    }
    for kid in ["", "a.b", "a b", "é", "a\n", &"k".repeat(65)] {
        assert!(!valid_kid(kid), "{kid:?}");
        assert_eq!(sign(&secret(KEY), kid, "default", 1, 1), Err(KeyError::InvalidId(kid.to_owned())));
    }
}

#[test]
fn a_key_file_is_its_bytes_without_trailing_whitespace_and_is_never_printed() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("key");
    std::fs::write(&file, b" fencegate-test-vector-key-0001 \r\n\t\n").unwrap();
    let s = Secret::from_file(&file).unwrap();
    assert_eq!(s.0, b" fencegate-test-vector-key-0001", "leading whitespace is part of the key");
    assert_eq!(format!("{s:?}"), "Secret(31 bytes)");
    let debug = format!("{:?}", HmacKeys::new([("k1", &s)], Duration::from_secs(1)));
    assert!(!debug.contains("fencegate-test") && debug.contains("k1"), "{debug}");
    std::fs::write(&file, b"short\n").unwrap();
    assert_eq!(Secret::from_file(&file), Err(KeyError::TooShort(5)));
    std::fs::write(&file, b"\n\n").unwrap();
    assert_eq!(Secret::from_file(&file), Err(KeyError::Empty));
    std::fs::write(&file, vec![b'x'; MAX_KEY_BYTES + 1]).unwrap();
    assert_eq!(Secret::from_file(&file), Err(KeyError::TooLong));
    assert!(matches!(Secret::from_file(&dir.path().join("missing")), Err(KeyError::Missing { .. })), "revokes it");
    assert!(matches!(Secret::from_file(dir.path()), Err(KeyError::Read { .. })), "a directory is no key file");
}

proptest! {
    #[test]
    fn whatever_is_signed_verifies_and_any_other_token_does_not(token: u64, other: u64, expiry: u64, domain in "[a-z]{1,12}") {
        let k = keys(0);
        let value = sign(&secret(KEY), "2026-12", &domain, token, expiry).unwrap();
        let sig = Signature::parse(value.as_bytes()).unwrap();
        prop_assert_eq!(k.verify(&sig, &domain, token, expiry), Ok(()));
        prop_assume!(other != token);
        prop_assert_eq!(k.verify(&sig, &domain, other, expiry).unwrap_err().reason(), "wrong_mac");
    }

    #[test]
    fn parsing_never_panics(value in proptest::collection::vec(any::<u8>(), 0..120)) {
        let _ = Signature::parse(&value);
    }
}
