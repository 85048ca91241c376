//! Lock names: which lock of the lock service guards a fence key, for tokens verified against
//! the lock's current holder.
//!
//! A [`LockTemplate`] is written over the segments of the canonical path (`/locks/accounts/{2}`
//! names, for the key `/accounts/42`, the lock `/locks/accounts/42`). A placeholder is a whole
//! segment `{n}`, 1-based, and takes the key's n-th segment as the key spells it (canonical:
//! percent-encoded where the path is, with the path policy's case), so clients must lock exactly
//! that name. Two templates are refused together when one could name a lock that is a prefix
//! (at a `/`) of a lock the other names, since etcd's lock keeps its holders under `NAME/` and
//! the shorter lock would count the longer one's holders as its own.

/// Why a write was refused by its lock's holder.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LockError {
    /// The token is not the create revision of the lock's current holder.
    #[error("token {token} is not the create revision of the current holder of the lock {lock}")]
    NotHolder {
        /// The lock's name.
        lock: String,
        /// The token the write carried.
        token: u64,
        /// The current holder's create revision, if anyone holds it: for the log only, never
        /// told the client (it is the token that would pass).
        holder: Option<i64>,
    },
    /// The view of the locks is not proven fresh: the holder cannot be told now.
    #[error("the lock {lock} cannot be checked now: the view of etcd's locks {reason}")]
    Unavailable {
        /// The lock's name.
        lock: String,
        /// Why not.
        reason: String,
    },
    /// The key has fewer segments than its rule's lock template takes.
    #[error("{key} has no lock: the template {template} takes more segments than the key has")]
    NoLockName {
        /// The fence key.
        key: String,
        /// The rule's template.
        template: String,
    },
}

/// A lock name template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockTemplate {
    text: String,
    parts: Vec<Part>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    /// A key's segment, 1-based.
    Segment(usize),
}

/// Why a template cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LockTemplateError {
    /// Not of the form `/a/{n}/...`.
    #[error("{0}")]
    Malformed(String),
}

impl LockTemplate {
    /// Parses `/lit/{n}/...`: segments separated by `/`, each a literal or a placeholder `{n}`
    /// with n from 1.
    pub fn parse(text: &str) -> Result<LockTemplate, LockTemplateError> {
        let bad = |why: &str| Err(LockTemplateError::Malformed(format!("{text:?}: {why}")));
        let Some(rest) = text.strip_prefix('/') else { return bad("must start with /") };
        if rest.is_empty() || rest.ends_with('/') {
            return bad("must name a lock: no trailing /");
        }
        let mut parts = Vec::new();
        for segment in rest.split('/') {
            if segment.is_empty() {
                return bad("has an empty segment");
            }
            match segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                Some(n) => match n.parse::<usize>() {
                    Ok(n) if n >= 1 => parts.push(Part::Segment(n)),
                    _ => return bad("a placeholder is {n} with n from 1"),
                },
                None if segment.contains(['{', '}']) => return bad("a placeholder must be a whole segment"),
                None if segment.contains('\0') => return bad("has a NUL"),
                None => parts.push(Part::Literal(segment.to_owned())),
            }
        }
        // Without one, every key shares one lock whose holders' keys lie under the name, where
        // the view's heartbeat would have to go too (and count as a contender).
        if !parts.iter().any(|p| matches!(p, Part::Segment(_))) {
            return bad("needs a placeholder {n}: one lock for every key is one lock for the whole prefix");
        }
        Ok(LockTemplate { text: text.to_owned(), parts })
    }

    /// The template as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The highest segment a placeholder takes (0: none): keys need at least this many.
    pub fn max_segment(&self) -> usize {
        self.parts.iter().map(|p| if let Part::Segment(n) = p { *n } else { 0 }).max().unwrap_or(0)
    }

    /// What every name it makes starts with: the literal segments before the first
    /// placeholder, with a `/` after them. No lock's `NAME/` lies at or above it.
    pub fn literal_prefix(&self) -> String {
        let mut prefix = String::from("/");
        for part in &self.parts {
            match part {
                Part::Literal(s) => {
                    prefix.push_str(s);
                    prefix.push('/');
                }
                Part::Segment(_) => break,
            }
        }
        prefix
    }

    /// The lock that guards `key` (a canonical fence key), or `None` if the key has fewer
    /// segments than the template takes.
    pub fn name(&self, key: &str) -> Option<String> {
        let segments: Vec<&str> = key.split('/').filter(|s| !s.is_empty()).collect();
        let mut name = String::with_capacity(self.text.len() + key.len());
        for part in &self.parts {
            name.push('/');
            match part {
                Part::Literal(s) => name.push_str(s),
                Part::Segment(n) => name.push_str(segments.get(n - 1)?),
            }
        }
        Some(name)
    }

    /// Whether some name of `self` could be a proper prefix, at a `/`, of some name of `other`
    /// (or the other way round): a placeholder may take any segment.
    pub fn overlaps(&self, other: &LockTemplate) -> bool {
        let nests = |short: &LockTemplate, long: &LockTemplate| {
            short.parts.len() < long.parts.len()
                && short.parts.iter().zip(&long.parts).all(|pair| match pair {
                    (Part::Literal(a), Part::Literal(b)) => a == b,
                    _ => true,
                })
        };
        nests(self, other) || nests(other, self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(text: &str) -> LockTemplate {
        LockTemplate::parse(text).unwrap()
    }

    #[test]
    fn names_come_from_the_keys_segments() {
        let accounts = t("/locks/accounts/{2}");
        assert_eq!(accounts.name("/accounts/42").as_deref(), Some("/locks/accounts/42"));
        assert_eq!(accounts.name("/accounts/42/history").as_deref(), Some("/locks/accounts/42"));
        assert_eq!(accounts.name("/accounts/a%20b").as_deref(), Some("/locks/accounts/a%20b"), "as the key spells it");
        assert_eq!(accounts.name("/accounts"), None, "too few segments");
        assert_eq!(accounts.name("/accounts/"), None);
        assert_eq!(accounts.literal_prefix(), "/locks/accounts/");
        assert_eq!(accounts.max_segment(), 2);
        assert_eq!(t("/locks/{1}/x/{2}").name("/b/o").as_deref(), Some("/locks/b/x/o"));
        assert_eq!(t("/{1}").name("/anything").as_deref(), Some("/anything"));
        assert_eq!(t("/{1}").literal_prefix(), "/");
    }

    #[test]
    fn malformed_templates_are_refused() {
        for bad in [
            "/all",
            "/locks/all",
            "",
            "locks/{1}",
            "/",
            "/locks/",
            "/a//{1}",
            "/a/{0}",
            "/a/{x}",
            "/a/k{1}",
            "/a/{1}x",
            "/a\0/{1}",
        ] {
            assert!(LockTemplate::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn templates_that_could_name_a_prefix_of_each_others_locks_overlap() {
        assert!(t("/locks/{1}").overlaps(&t("/locks/{1}/sub")));
        assert!(t("/locks/{1}").overlaps(&t("/locks/a/{2}")), "the placeholder may take 'a'");
        assert!(t("/locks/a/{2}").overlaps(&t("/locks/{1}")));
        assert!(!t("/locks/{1}").overlaps(&t("/locks/{2}")), "same length: never a proper prefix");
        assert!(!t("/locks/a/{2}").overlaps(&t("/locks/b/{2}/x")));
        assert!(!t("/locks/accounts/{2}").overlaps(&t("/locks/queues/{2}")));
    }
}
