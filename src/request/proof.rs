//! Proving a token: what a write under a rule's `verify` setting must carry, read by
//! classification (no I/O), and its check against the keys in force, made before the write
//! is prechecked or waits for its turn. The fence's `signature` module knows signatures; this one
//! knows where they come from (a header, the config) and what a refusal of one is.

use std::net::IpAddr;

use http::header::HeaderName;
use http::{HeaderMap, Request, Response};

use super::ResponseBody;
use super::classify::Plan;
use crate::config::{StoreKind, Verify, VerifyConfig};
use crate::fence::Touch;
use crate::fence::guesses::{Limit, Limits, Throttled};
use crate::fence::lock_names::LockError;
use crate::fence::signature::{HmacKeys, Signature, SignatureError, unix_now};
use crate::refusal::Refusal;
use crate::state::{Settings, State};
use crate::store::Role;
use crate::upstream::Peer;
use crate::upstream::leader;

/// What a fenced write's token must prove, as read from the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proof {
    /// Nothing: the number alone is checked.
    None,
    /// A signature over the token in its token domain, by one of `[[verify.hmac_keys]]`.
    Hmac {
        /// The parsed signature header.
        signature: Signature,
        /// The token domain of the write's keys, which the signature must name.
        domain: String,
    },
}

/// Reads the proof a write under `verify` carries in its headers, refusing one that is missing
/// or malformed.
pub(super) fn read(headers: &HeaderMap, config: &VerifyConfig, verify: Verify, domain: &str) -> Result<Proof, Refusal> {
    match verify {
        // etcd's holder is looked up from the write's lock names (`request::holders`).
        Verify::None | Verify::Etcd => Ok(Proof::None),
        Verify::Hmac => {
            let signature = signature(headers, &config.signature_header)?;
            Ok(Proof::Hmac { signature, domain: domain.to_owned() })
        }
    }
}

/// The one value of the signature header, parsed.
fn signature(headers: &HeaderMap, header: &HeaderName) -> Result<Signature, Refusal> {
    let mut values = headers.get_all(header).iter();
    let Some(value) = values.next() else {
        return Err(Refusal::MissingSignature { header: header.to_string() });
    };
    if values.next().is_some() {
        return Err(Refusal::InvalidSignature(SignatureError::Repeated));
    }
    Signature::parse(value.as_bytes()).map_err(Refusal::InvalidSignature)
}

/// Checks `proof` for `token`, now; a refusal names the first key of `touches`.
pub(super) fn check(proof: &Proof, token: u64, touches: &[Touch], hmac: &HmacKeys) -> Result<(), Refusal> {
    match proof {
        Proof::None => Ok(()),
        Proof::Hmac { signature, domain } => hmac.verify(signature, domain, token, unix_now()).map_err(|reason| {
            let resource = touches.first().map_or_else(String::new, |t| t.key.clone());
            Refusal::SignatureRejected { resource, reason }
        }),
    }
}

/// A write verified against an etcd lock, as the limits on guessing see it: who sent it and
/// the lock whose holder it claims to be. Only such writes are limited: a signature's MAC
/// cannot be walked as a revision can, and counting its refusals would only let anyone hold a
/// signed key's writer back.
#[derive(Debug)]
pub(super) struct Guess {
    /// The client's address: the connection's, or for a write a follower sent on, the one it
    /// names; `None` if it names none.
    client: Option<IpAddr>,
    lock: String,
    limits: Limits,
}

impl Guess {
    /// The guess a plan makes, if it is a write verified against an etcd lock that this
    /// instance fences (a follower sends it on, and the leader counts it). Only an instance
    /// that shares its fence may get a write from a peer: a single one charges a write that
    /// claims so to its own client.
    pub(super) fn of<B>(
        plan: &Plan,
        req: &Request<B>,
        client: &Peer,
        settings: &Settings,
        state: &State,
    ) -> Option<Guess> {
        let Plan::Write(write) = plan else { return None };
        let lock = write.locks.first()?;
        let shared = match state.store.role() {
            Role::Fences => matches!(settings.config.store.kind, StoreKind::Etcd),
            Role::Forward(_) | Role::Unavailable(_) => return None,
        };
        let verify = &settings.config.verify;
        let limits = Limits {
            client: Limit { burst: verify.client_refusal_burst, refill: verify.client_refusal_refill },
            key: Limit { burst: verify.key_refusal_burst, refill: verify.key_refusal_refill },
        };
        let client = match shared && leader::forwarded(req, state.store.peer_secret().as_deref()) {
            true => leader::sent_on_for(req.headers()),
            false => client.ip(),
        };
        Some(Guess { client, lock: lock.clone(), limits })
    }

    /// Refuses the write unchecked if its client or lock had too many proofs refused lately.
    pub(super) fn admit(&self, state: &State) -> Result<(), Refusal> {
        state.guesses.admit(self.client, &self.lock, self.limits).map_err(|Throttled { by, retry_after }| {
            state.metrics.proof_limited(by.name());
            Refusal::TooManyRefusals { by, lock: self.lock.clone(), retry_after }
        })
    }

    /// Counts the write's result if its proof was checked and refused: what a guess gets.
    pub(super) fn count(&self, state: &State, result: &Result<Response<ResponseBody>, Refusal>) {
        if let Err(refusal) = result {
            self.count_refusal(state, refusal);
        }
    }

    /// Counts `refusal` of the write if its proof was checked and refused.
    pub(super) fn count_refusal(&self, state: &State, refusal: &Refusal) {
        if let Refusal::Lock(LockError::NotHolder { .. }) = refusal {
            state.guesses.refused(self.client, &self.lock, self.limits);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::HmacKey;
    use crate::fence::Coverage;
    use crate::fence::signature::{Secret, sign};
    use crate::state::settings::hmac_keys;

    fn config() -> VerifyConfig {
        let secret = Secret::new(b"a-secret-of-32-bytes-for-tests!!".to_vec()).unwrap();
        let key = HmacKey { id: "k1".into(), secret_file: "/k1".into(), secret: Some(secret) };
        VerifyConfig {
            signature_header: HeaderName::from_static("fencing-token-signature"),
            clock_skew: Duration::from_secs(30),
            max_lag: Duration::from_secs(2),
            client_refusal_burst: 10,
            client_refusal_refill: Duration::from_secs(1),
            key_refusal_burst: 100,
            key_refusal_refill: Duration::from_millis(100),
            hmac_keys: vec![key],
        }
    }

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("fencing-token-signature", v.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_signature_is_read_only_where_a_rule_asks_and_checked_with_the_keys_in_force() {
        let c = config();
        let good = sign(c.hmac_keys[0].secret.as_ref().unwrap(), "k1", "d", 9, unix_now() + 60).unwrap();
        assert!(matches!(read(&headers(&[]), &c, Verify::None, "d"), Ok(Proof::None)));
        let code = |h: HeaderMap| read(&h, &c, Verify::Hmac, "d").unwrap_err().code();
        assert_eq!(code(headers(&[])), "missing_signature");
        assert_eq!(code(headers(&[&good, &good])), "invalid_signature", "one header line");
        assert_eq!(code(headers(&["v1.k1.x.y"])), "invalid_signature");
        let proof = read(&headers(&[&good]), &c, Verify::Hmac, "d").unwrap();
        let touches = [Touch { key: "/a".into(), coverage: Coverage::Key }];
        let verifiers = hmac_keys(&c);
        assert!(check(&proof, 9, &touches, &verifiers).is_ok());
        let refused = check(&proof, 10, &touches, &verifiers).unwrap_err();
        assert_eq!((refused.code(), refused.resource()), ("signature_rejected", Some("/a")));
        let other = read(&headers(&[&good]), &c, Verify::Hmac, "e").unwrap();
        assert_eq!(check(&other, 9, &touches, &verifiers).unwrap_err().code(), "signature_rejected", "another domain");
        let none = hmac_keys(&VerifyConfig { hmac_keys: Vec::new(), ..c.clone() });
        assert_eq!(check(&proof, 9, &touches, &none).unwrap_err().code(), "signature_rejected", "a key dropped");
    }
}
