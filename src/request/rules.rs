//! What the `[[fence.rules]]` over a write's keys say: its token domain, what a token equal to
//! `max_seen` gets, what the token must prove, and how far it may jump.
//!
//! A key's setting is that of the longest rule prefix over it that sets one (a rule's token
//! domain is always set: `"default"` unless written). A subtree write is checked against every
//! key below it, so the rules inside its subtree count too. A write is refused when its keys
//! fall under different token domains or different `verify` settings; otherwise it gets the
//! strictest `equal_token` and the smallest `max_jump` among them.

use crate::config::{DEFAULT_DOMAIN, FenceConfig, PinMode, Rule, Verify};
use crate::fence::{Coverage, Domains, EqualToken, Touch, covers, node};
use crate::refusal::Refusal;

/// The settings one write is fenced under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Governed<'a> {
    /// The token domain of every key it touches.
    pub(super) domain: &'a str,
    /// What a token equal to `max_seen` gets.
    pub(super) equal: EqualToken,
    /// What the token must prove.
    pub(super) verify: Verify,
    /// How far above a key's level the token may be.
    pub(super) max_jump: Option<u64>,
}

/// The settings of a write of `touches`, or the refusal of one whose keys disagree.
pub(super) fn govern<'a>(touches: &[Touch], fence: &'a FenceConfig) -> Result<Governed<'a>, Refusal> {
    let rules = fence.rules.as_slice();
    if rules.is_empty() {
        return Ok(Governed { domain: DEFAULT_DOMAIN, equal: fence.equal_token, verify: Verify::None, max_jump: None });
    }
    // Each setting is looked up only where some rule gives it a value other than the default
    // (a domain, a proof, a jump): most rules set one or two (a prefix's pins, say), and each
    // lookup walks the rules for every key.
    let domain = match rules.iter().all(|r| r.token_domain == DEFAULT_DOMAIN) {
        true => DEFAULT_DOMAIN,
        false => one_domain(touches, rules)?,
    };
    let verify = match rules.iter().any(|r| r.verify.is_some()) {
        true => one_verify(touches, rules)?,
        false => Verify::None,
    };
    let max_jump = match rules.iter().any(|r| r.max_jump.is_some()) {
        true => touches
            .iter()
            .flat_map(|t| {
                setting(rules, &t.key, |r| r.max_jump).into_iter().chain(inside(t, rules).filter_map(|r| r.max_jump))
            })
            .min(),
        false => None,
    };
    Ok(Governed { domain, equal: equal_token(touches, fence), verify, max_jump })
}

/// Whether writes to `key` are pinned: the longest rule over it that says, else `default`.
pub(super) fn pin(key: &str, fence: &FenceConfig, default: PinMode) -> PinMode {
    setting(&fence.rules, key, |r| r.pin).unwrap_or(default)
}

/// The token domains of `rules`, as the fence knows them.
pub(crate) fn domains(rules: &[Rule]) -> Domains {
    Domains::new(rules.iter().map(|r| (r.prefix.clone(), r.token_domain.clone())))
}

/// The setting `field` of `key`: that of the longest rule prefix over it that sets one.
fn setting<T: Copy>(rules: &[Rule], key: &str, field: impl Fn(&Rule) -> Option<T>) -> Option<T> {
    Rule::longest(rules, key, |r| field(r).is_some()).and_then(field)
}

/// The rules inside the subtree `touch` covers (none for a single key).
fn inside<'a>(touch: &Touch, rules: &'a [Rule]) -> impl Iterator<Item = &'a Rule> {
    let here = node(&touch.key);
    let subtree = touch.coverage == Coverage::Subtree;
    rules.iter().filter(move |r| subtree && covers(here, node(&r.prefix)))
}

/// What a token equal to `max_seen` gets in a write of `touches`: `Reject` if any key it may
/// change is under `Reject`.
fn equal_token(touches: &[Touch], fence: &FenceConfig) -> EqualToken {
    if !fence.rules.iter().any(|r| r.equal_token.is_some()) {
        return fence.equal_token;
    }
    let strict = touches.iter().any(|touch| {
        setting(&fence.rules, &touch.key, |r| r.equal_token).unwrap_or(fence.equal_token) == EqualToken::Reject
            || inside(touch, &fence.rules).any(|r| r.equal_token == Some(EqualToken::Reject))
    });
    if strict { EqualToken::Reject } else { EqualToken::Accept }
}

/// The one token domain of a write's keys. Keys whose tokens come from different counters (a
/// subtree that holds keys of another domain, a MOVE between domains) are refused: comparing
/// tokens across them means nothing, and a floor would lock the other domain's holders out for
/// good.
fn one_domain<'a>(touches: &[Touch], rules: &'a [Rule]) -> Result<&'a str, Refusal> {
    let domain_of = |key: &str| Rule::domain_of(rules, key);
    let mut first: Option<&str> = None;
    for touch in touches {
        let domain = domain_of(&touch.key);
        if let Some(inner) = inside(touch, rules).find(|r| r.token_domain != domain) {
            return Err(Refusal::CrossDomain(format!(
                "the subtree at {} (token domain {domain}) holds {} (token domain {})",
                touch.key, inner.prefix, inner.token_domain
            )));
        }
        match first {
            Some(other) if other != domain => {
                return Err(Refusal::CrossDomain(format!("it changes keys of token domains {other} and {domain}")));
            }
            _ => first = Some(domain),
        }
    }
    Ok(first.unwrap_or(DEFAULT_DOMAIN))
}

/// What proves the tokens of `key`: the `verify` setting of the longest rule over it that sets
/// one and, for etcd, that rule's lock template.
fn proof_of<'a>(rules: &'a [Rule], key: &str) -> (Verify, Option<&'a str>) {
    match Rule::verifying(rules, key) {
        Some(r) => (r.verify.unwrap_or(Verify::None), r.lock.as_ref().map(|t| t.as_str())),
        None => (Verify::None, None),
    }
}

/// How a refusal names a proof.
fn proof_name((verify, lock): (Verify, Option<&str>)) -> String {
    match lock {
        Some(lock) => format!("verify = {}, lock = {lock}", verify.name()),
        None => format!("verify = {}", verify.name()),
    }
}

/// The one `verify` setting of a write's keys. A write that changes keys under different
/// settings is refused: checked under the weaker one, an unproven token would raise the level
/// of keys that demand proof (a forged huge token would lock their holders out); under the
/// stronger one, holders of the other keys could not write at all. A subtree must also be
/// under one lock template: only the subtree's own key's lock is checked, so a key inside it
/// guarded by another etcd lock would be changed, and its holder locked out, by a holder of
/// the outer one.
fn one_verify(touches: &[Touch], rules: &[Rule]) -> Result<Verify, Refusal> {
    let mut first: Option<(&str, Verify)> = None;
    for touch in touches {
        let proof = proof_of(rules, &touch.key);
        let verify = proof.0;
        if let Some(inner) = inside(touch, rules).find(|r| proof_of(rules, &r.prefix) != proof) {
            return Err(Refusal::CrossVerify(format!(
                "the subtree at {} ({}) holds {} ({})",
                touch.key,
                proof_name(proof),
                inner.prefix,
                proof_name(proof_of(rules, &inner.prefix))
            )));
        }
        match first {
            Some((other_key, other)) if other != verify => {
                return Err(Refusal::CrossVerify(format!(
                    "it changes {other_key} (verify = {}) and {} (verify = {})",
                    other.name(),
                    touch.key,
                    verify.name()
                )));
            }
            _ => first = Some((&touch.key, verify)),
        }
    }
    Ok(first.map_or(Verify::None, |(_, v)| v))
}

#[cfg(test)]
mod tests {
    use super::super::classify::Plan;
    use super::super::protocol::http::classify;
    use super::super::protocol::http::tests::{config, request};
    use super::*;

    #[test]
    fn writes_across_verify_settings_are_refused_and_the_smallest_max_jump_wins() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("k");
        std::fs::write(&key, "a-secret-of-32-bytes-for-tests!!").unwrap();
        let c = config(&format!(
            "[[fence.rules]]\nprefix = \"/signed/\"\nverify = \"hmac\"\nmax_jump = 500\n\
             [[fence.rules]]\nprefix = \"/signed/inner/\"\nmax_jump = 50\n\
             [[fence.rules]]\nprefix = \"/signed/open/\"\nverify = \"none\"\n\
             [[fence.rules]]\nprefix = \"/plain/\"\nmax_jump = 9\n\
             [[verify.hmac_keys]]\nid = \"k\"\nsecret_file = {:?}\n",
            key.display().to_string()
        ));
        let headers = [("fencing-token", "5"), ("fencing-token-signature", "v1.k.1.x")];
        let plan = |method: &str, path: &str, dest: &str| {
            let mut all = headers.to_vec();
            all.push(("destination", dest));
            classify(&request(method, path, &all, ""), &c).map_err(|e| e.code())
        };
        let jump = |method: &str, path: &str, dest: &str| match plan(method, path, dest) {
            Ok(Plan::Write(w)) => w.max_jump,
            other => panic!("{method} {path}: {other:?}"),
        };
        assert_eq!(plan("PUT", "/signed/a", "/x").unwrap_err(), "invalid_signature", "verified: the header is read");
        assert_eq!(jump("PUT", "/plain/a", "/x"), Some(9), "unverified: the header is not read");
        assert_eq!(jump("PUT", "/signed/open/a", "/x"), Some(500), "verify and max_jump are inherited apart");
        assert_eq!(jump("PUT", "/elsewhere", "/x"), None);
        assert_eq!(jump("MOVE", "/plain/a", "/elsewhere"), Some(9), "the smallest over the keys");
        assert_eq!(jump("DELETE", "/signed/open/", "/x"), Some(500));
        assert_eq!(plan("MOVE", "/signed/a", "/elsewhere").unwrap_err(), "cross_verify_write");
        assert_eq!(plan("MOVE", "/elsewhere", "/signed/a").unwrap_err(), "cross_verify_write");
        assert_eq!(plan("DELETE", "/", "/x").unwrap_err(), "cross_verify_write", "a subtree holding signed keys");
        assert_eq!(plan("DELETE", "/signed/", "/x").unwrap_err(), "cross_verify_write", "and one holding open ones");
        assert_eq!(plan("COPY", "/signed/a", "/plain/b").map(|_| ()), Ok(()), "a COPY's source is only read");
        let inner = plan("DELETE", "/signed/inner/", "/x").unwrap_err();
        assert_eq!(inner, "invalid_signature", "a subtree within one setting is verified");
    }

    #[test]
    fn a_subtree_holding_keys_of_another_lock_is_refused() {
        let c = config(
            "[etcd]\nendpoints = [\"http://127.0.0.1:9\"]\n\
             [[fence.rules]]\nprefix = \"/accounts/\"\nverify = \"etcd\"\nlock = \"/locks/accounts/{2}\"\n\
             [[fence.rules]]\nprefix = \"/accounts/42/audit/\"\nverify = \"etcd\"\nlock = \"/locks/audit/{4}\"\n\
             [[fence.rules]]\nprefix = \"/accounts/42/tuned/\"\nmax_jump = 9\n",
        );
        let plan = |method: &str, path: &str, dest: &str| {
            let headers = [("fencing-token", "5"), ("destination", dest)];
            classify(&request(method, path, &headers, ""), &c).map_err(|e| e.code())
        };
        let locks = |method: &str, path: &str| match plan(method, path, "/x") {
            Ok(Plan::Write(w)) => w.locks,
            other => panic!("{method} {path}: {other:?}"),
        };
        for (method, path, dest) in [
            ("DELETE", "/accounts/42", "/x"),
            ("DELETE", "/accounts/42/", "/x"),
            ("MOVE", "/accounts/42", "/accounts/43"),
        ] {
            assert_eq!(plan(method, path, dest).map(|_| ()), Err("cross_verify_write"), "{method} {path}");
        }
        assert_eq!(locks("PUT", "/accounts/42/audit/x"), ["/locks/audit/x"]);
        assert_eq!(locks("DELETE", "/accounts/42/x/"), ["/locks/accounts/42"]);
        assert_eq!(locks("DELETE", "/accounts/42/tuned/"), ["/locks/accounts/42"], "a rule that only tunes max_jump");
    }

    #[test]
    fn the_fence_maps_keys_to_the_domains_the_rules_name() {
        let c = config(
            "[[fence.rules]]\nprefix = \"/consul/\"\ntoken_domain = \"consul\"\n\
             [[fence.rules]]\nprefix = \"/consul/e\"\nmax_jump = 10\n\
             [[fence.rules]]\nprefix = \"/consul/d\"\ntoken_domain = \"default\"\n\
             [[fence.rules]]\nprefix = \"/consul/d/own\"\nequal_token = \"accept\"\n\
             [[fence.rules]]\nprefix = \"/other\"\nmax_jump = 10\n",
        );
        let d = domains(&c.fence.rules);
        assert_eq!((d.of("/consul/a"), d.of("/x")), ("consul", "default"));
        assert_eq!(d.of("/consul/e/1"), "consul", "a rule that does not set the domain inherits it");
        assert_eq!(
            (d.of("/consul/d/1"), d.of("/consul/d/own/1")),
            ("default", "default"),
            "from the longest that sets it"
        );
        assert_eq!(d.of("/other/1"), "default", "no rule over it sets one");
    }

    #[test]
    fn a_write_across_token_domains_is_refused() {
        let c = config(
            "[[fence.rules]]\nprefix = \"/consul/\"\ntoken_domain = \"consul\"\n\
             [[fence.rules]]\nprefix = \"/consul/etcd\"\ntoken_domain = \"default\"\n",
        );
        let token = ("fencing-token", "5");
        let code = |method: &str, path: &str, dest: &str| {
            classify(&request(method, path, &[token, ("destination", dest)], ""), &c).map_err(|e| e.code())
        };
        assert!(code("PUT", "/consul/a", "/x").is_ok(), "one key is always in one domain");
        assert!(code("DELETE", "/consul/a/", "/x").is_ok(), "a subtree within one domain");
        assert!(code("MOVE", "/consul/a", "/consul/b").is_ok());
        assert_eq!(code("MOVE", "/consul/a", "/elsewhere").unwrap_err(), "cross_domain_write");
        assert_eq!(code("DELETE", "/", "/x").unwrap_err(), "cross_domain_write", "a subtree holding another domain");
        assert_eq!(code("DELETE", "/consul/", "/x").unwrap_err(), "cross_domain_write", "and one nested in it");
        assert!(code("DELETE", "/consul/etcd/x/", "/x").is_ok(), "the longest prefix names the domain");
        assert!(code("COPY", "/consul/a", "/b").is_ok(), "a COPY's source is read, not fenced");
    }

    #[test]
    fn equal_tokens_follow_the_strictest_rule_over_what_a_write_may_change() {
        let c = config(
            "[[fence.rules]]\nprefix = \"/tenure/\"\nequal_token = \"accept\"\n\
             [[fence.rules]]\nprefix = \"/tenure/once\"\nequal_token = \"reject\"\n\
             [[fence.rules]]\nprefix = \"/tenure/domain\"\ntoken_domain = \"default\"\n",
        );
        let token = ("fencing-token", "5");
        let equal = |method: &str, path: &str, dest: &str| {
            let Plan::Write(w) = classify(&request(method, path, &[token, ("destination", dest)], ""), &c).unwrap()
            else {
                panic!("{method} {path} is a write")
            };
            w.equal
        };
        use EqualToken::{Accept, Reject};
        assert_eq!(equal("PUT", "/tenure/doc", "/x"), Accept);
        assert_eq!(equal("PUT", "/elsewhere", "/x"), Reject, "fence.equal_token where no rule sets it");
        assert_eq!(equal("PUT", "/tenure/once/doc", "/x"), Reject, "the longest prefix that sets it");
        assert_eq!(equal("PUT", "/tenure/domain/doc", "/x"), Accept, "a rule that does not set it inherits");
        assert_eq!(equal("MOVE", "/tenure/a", "/tenure/b"), Accept);
        assert_eq!(equal("MOVE", "/tenure/a", "/elsewhere"), Reject, "a Destination under reject");
        assert_eq!(equal("DELETE", "/tenure/a/", "/x"), Accept);
        assert_eq!(equal("DELETE", "/tenure/", "/x"), Reject, "a subtree holding a prefix under reject");
        assert_eq!(equal("PUT", "/tenure/doc", "/x"), Accept);
        let plain = config("[fence]\nequal_token = \"accept\"\n");
        let Plan::Write(w) = classify(&request("PUT", "/a", &[token], ""), &plain).unwrap() else { panic!() };
        assert_eq!(w.equal, Accept, "no rule: fence.equal_token");
    }
}
