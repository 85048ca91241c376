//! Canonicalisation under each policy, and the properties the fence relies on.

use super::*;
use proptest::prelude::*;

fn strict() -> PathPolicy {
    PathPolicy::default()
}

fn canonicalize_default(raw: &str) -> Result<String, PathError> {
    canonicalize(raw, &strict())
}

#[test]
fn aliases_of_one_resource_share_a_canonical_form() {
    for alias in [
        "/accounts/42",
        "/accounts//42",
        "//accounts/42",
        "/accounts/./42",
        "/accounts/x/../42",
        "/accounts/x/%2e%2e/42",
        "/accounts/x/%2E%2E/42",
        "/accounts/x/.%2e/42",
        "/accounts/%2e/42",
        "/%61ccounts/%34%32",
        "/accounts/x//..//42",
    ] {
        assert_eq!(canonicalize(alias, &strict()).as_deref(), Ok("/accounts/42"), "{alias}");
    }
}

#[test]
fn escapes_of_characters_safe_as_literals_are_decoded() {
    assert_eq!(canonicalize_default("/a%21").as_deref(), Ok("/a!"));
    assert_eq!(canonicalize_default("/a%3ab%40c").as_deref(), Ok("/a:b@c"));
    let allow = PathPolicy { matrix_params: MatrixParams::Allow, ..strict() };
    assert_eq!(canonicalize("/a%3ab%40c%3B", &allow).as_deref(), Ok("/a:b@c;"));
    assert_eq!(canonicalize_default("/a!").as_deref(), Ok("/a!"));
}

#[test]
fn hex_is_upper_cased_and_structural_escapes_kept() {
    assert_eq!(canonicalize_default("/a%3fb%7e%23%25%20%c3%a9").as_deref(), Ok("/a%3Fb~%23%25%20%C3%A9"));
    assert_eq!(canonicalize_default("/a%2541").as_deref(), Ok("/a%2541"), "decoded once, like a backend");
    assert_eq!(canonicalize_default("/a/").as_deref(), Ok("/a/"));
    assert_eq!(canonicalize_default("/A").as_deref(), Ok("/A"));
}

#[test]
fn ambiguous_spellings_are_refused() {
    for (raw, err) in [
        ("/a%2Fb", PathError::EscapedSlash),
        ("/a%2fb", PathError::EscapedSlash),
        ("/a%5cb", PathError::EscapedSlash),
        ("/a%00b", PathError::EncodedNul),
        ("/a%0ab", PathError::ControlCharacter),
        ("/a\\b", PathError::Backslash),
        ("/a#b", PathError::Fragment),
        ("/a%zz", PathError::BadPercentEncoding),
        ("/a%4", PathError::BadPercentEncoding),
        ("/..", PathError::AboveRoot),
        ("/a/../../b", PathError::AboveRoot),
        ("/a/%2e%2e/%2e%2e/b", PathError::AboveRoot),
        ("*", PathError::NotAbsolutePath),
        ("", PathError::NotAbsolutePath),
        ("/é", PathError::NonAscii),
        ("/files/a;jsessionid=1", PathError::MatrixParameters),
        ("/files/a%3Bx", PathError::MatrixParameters),
    ] {
        assert_eq!(canonicalize_default(raw), Err(err), "{raw:?}");
    }
}

#[test]
fn each_policy_changes_exactly_what_it_names() {
    let decode = PathPolicy { escaped_slashes: EscapedSlashes::Decode, ..strict() };
    assert_eq!(canonicalize("/a%2Fb/%2e%2e%2Fc", &decode).as_deref(), Ok("/a/c"));
    assert_eq!(canonicalize("/a%5Cb", &decode), Err(PathError::EscapedSlash), "%5C is never a separator");
    let keep = PathPolicy { merge_slashes: false, ..strict() };
    assert_eq!(canonicalize("/a//b", &keep).as_deref(), Ok("/a//b"));
    let fold = PathPolicy { case_sensitive: false, ..strict() };
    assert_eq!(canonicalize("/Files/README%3f.TXT", &fold).as_deref(), Ok("/files/readme%3F.txt"));
    assert_eq!(canonicalize("/%41", &fold).as_deref(), Ok("/a"), "decoded letters fold too");
    assert_eq!(canonicalize("/%C3%A4", &fold), Err(PathError::NonAsciiCaseFold), "no guessing at Unicode case");
    let strip = PathPolicy { trailing_slash: TrailingSlash::Strip, ..strict() };
    assert_eq!(canonicalize("/a/b/", &strip).as_deref(), Ok("/a/b"));
    assert_eq!(canonicalize("/a/b/.", &strip).as_deref(), Ok("/a/b"));
    assert_eq!(canonicalize("/", &strip).as_deref(), Ok("/"));
}

fn policy() -> impl Strategy<Value = PathPolicy> {
    (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()).prop_map(|(d, m, c, t, x)| PathPolicy {
        escaped_slashes: if d { EscapedSlashes::Decode } else { EscapedSlashes::Reject },
        merge_slashes: m,
        case_sensitive: c,
        trailing_slash: if t { TrailingSlash::Strip } else { TrailingSlash::Distinct },
        matrix_params: if x { MatrixParams::Allow } else { MatrixParams::Reject },
    })
}

/// One way of spelling a canonical segment that an RFC 3986 backend, with the policy's
/// rules, resolves to the same thing.
#[derive(Debug, Clone)]
enum Respell {
    Plain,
    /// Percent-encode the character at this index (unreserved or safe as a literal), in
    /// lower- or upper-case hex.
    Escape(usize, bool),
    /// Flip the case of letters (only where the backend ignores case).
    Case,
    /// Put `./` or `x/../` or an empty segment before it.
    Detour(u8),
}

fn respell() -> impl Strategy<Value = Respell> {
    prop_oneof![
        Just(Respell::Plain),
        (0..8usize, any::<bool>()).prop_map(|(i, up)| Respell::Escape(i, up)),
        Just(Respell::Case),
        (0..3u8).prop_map(Respell::Detour),
    ]
}

fn spell(segment: &str, how: &Respell, policy: &PathPolicy) -> String {
    match how {
        Respell::Plain => segment.to_owned(),
        Respell::Escape(i, up) => {
            let i = i % segment.len();
            let c = segment.as_bytes()[i];
            let hex = if *up { format!("%{c:02X}") } else { format!("%{c:02x}") };
            format!("{}{hex}{}", &segment[..i], &segment[i + 1..])
        }
        Respell::Case if !policy.case_sensitive => segment.to_ascii_uppercase(),
        Respell::Case => segment.to_owned(),
        Respell::Detour(0) => format!("./{segment}"),
        Respell::Detour(1) => format!("x/../{segment}"),
        Respell::Detour(_) if policy.merge_slashes => format!("/{segment}"),
        Respell::Detour(_) => format!("%2e/{segment}"),
    }
}

proptest! {
    #[test]
    fn every_alias_of_a_path_gets_its_key(
        policy in policy(),
        segments in prop::collection::vec("[a-zA-Z0-9_~.!$&'()*+,=:@-]{1,6}", 1..6),
        hows in prop::collection::vec(respell(), 6),
        trailing in any::<bool>(),
        extra_slash in any::<bool>(),
    ) {
        let segments: Vec<String> = segments.into_iter().filter(|s| s != "." && s != "..").collect();
        prop_assume!(!segments.is_empty());
        let plain = format!("/{}{}", segments.join("/"), if trailing { "/" } else { "" });
        let Ok(key) = canonicalize(&plain, &policy) else { return Ok(()) };
        let respelled: Vec<String> = segments.iter().zip(&hows).map(|(s, h)| spell(s, h, &policy)).collect();
        let mut alias = format!("/{}", respelled.join("/"));
        // A trailing slash the backend ignores may be added or left out.
        if trailing || (policy.trailing_slash == TrailingSlash::Strip && extra_slash) {
            alias.push('/');
        }
        prop_assert_eq!(canonicalize(&alias, &policy), Ok(key.clone()), "{} vs {}", alias, plain);
        // What is forwarded is exactly what was fenced.
        prop_assert_eq!(crate::fence::keys::resource_key(&key, &[]), key.as_str());
    }

    #[test]
    fn canonical_form_holds_under_every_policy(policy in policy(), segs in prop::collection::vec(segment(), 0..8)) {
        let raw = format!("/{}", segs.join("/"));
        if let Ok(c) = canonicalize(&raw, &policy) {
            prop_assert_eq!(canonicalize(&c, &policy), Ok(c.clone()), "not idempotent");
            prop_assert!(c.starts_with('/'));
            if policy.merge_slashes {
                prop_assert!(!c.contains("//"), "{}", c);
            }
            let lower = c.to_ascii_lowercase();
            prop_assert!(!lower.contains("%2f") && !lower.contains("%5c") && !lower.contains("%2e"), "{}", c);
            prop_assert!(c.split('/').all(|s| s != "." && s != ".."), "{}", c);
            if policy.matrix_params == MatrixParams::Reject {
                prop_assert!(!c.contains(';'));
            }
            if !policy.case_sensitive {
                prop_assert_eq!(lowercase_outside_escapes(&c), c.clone());
            }
            if policy.trailing_slash == TrailingSlash::Strip && c.len() > 1 {
                prop_assert!(!c.ends_with('/'));
            }
        }
    }
}

proptest! {
    #[test]
    fn the_fast_check_agrees_with_the_full_route(
        policy in policy(),
        segs in prop::collection::vec(
            prop_oneof!["[a-zA-Z0-9._~;%!@+-]{0,5}", "%[0-9a-fA-F]{2}", Just(".".to_string()), Just("..".to_string())],
            0..6,
        ),
        trailing in any::<bool>(),
    ) {
        let raw = format!("/{}{}", segs.join("/"), if trailing { "/" } else { "" });
        if already_canonical(&raw, &policy) {
            prop_assert_eq!(canonicalize_fully(&raw, &policy), Ok(raw.clone()));
        }
        prop_assert_eq!(canonicalize(&raw, &policy), canonicalize_fully(&raw, &policy));
    }
}

fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z0-9_~-]{1,4}",
        Just(".".to_string()),
        Just("..".to_string()),
        Just("%2e".to_string()),
        Just("%2E%2e".to_string()),
        Just("".to_string()),
        "%[0-9a-fA-F]{2}",
        "[!$&'()*+,;=:@]{1,2}",
    ]
}

proptest! {
    #[test]
    fn canonical_form_is_a_fixed_point_with_no_ambiguity(segs in prop::collection::vec(segment(), 0..8)) {
        let raw = format!("/{}", segs.join("/"));
        if let Ok(c) = canonicalize_default(&raw) {
            prop_assert_eq!(canonicalize_default(&c), Ok(c.clone()));
            prop_assert!(c.starts_with('/'));
            prop_assert!(!c.contains("//"), "{}", c);
            let lower = c.to_ascii_lowercase();
            prop_assert!(!lower.contains("%2f") && !lower.contains("%5c") && !lower.contains("%2e"));
            prop_assert!(c.split('/').all(|s| s != "." && s != ".."), "{}", c);
        }
    }
}
