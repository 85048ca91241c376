//! Why the fence refuses or stops a write: [`FenceError`], and why a resource is quarantined.

use std::time::Duration;

/// What a stale-token refusal adds when the token equals `max_seen`: the setting that decides
/// it, so that a holder meaning to write many times in one tenure learns what to change.
fn equal_hint(token: u64, max_seen: u64) -> &'static str {
    if token == max_seen {
        "; a token equal to max_seen is refused under equal_token = \"reject\" (one write per \
         token); equal_token = \"accept\" in a [[fence.rules]] entry for the prefix allows many \
         writes per tenure (docs/tokens.md)"
    } else {
        ""
    }
}

/// What a stale token is below: the resource's own `max_seen`, or a floor over it.
fn stale_level(resource: &str, level: u64, floor: Option<&str>) -> String {
    match floor {
        None => format!("{resource} has already accepted {level}"),
        Some(floor) => format!(
            "{resource} lies under the floor {floor} at {level}, left by a write that covered that subtree (or by \
            `init --floor`), which every key in it must be above"
        ),
    }
}

/// What a jump refusal measured from.
fn jump_base(resource: &str, base: u64, domain: Option<&str>) -> String {
    match domain {
        None => format!("max_seen {base} of {resource}"),
        Some(d) => format!("{base}, the highest token accepted in token domain {d} ({resource} has no max_seen yet)"),
    }
}

/// Why the fence refused or stopped a write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FenceError {
    /// The token is not above the highest one this resource has accepted, or a floor over it.
    #[error("token {token} is stale: {}{}", stale_level(resource, *max_seen, floor.as_deref()), equal_hint(*token, *max_seen))]
    Stale {
        /// The fence key.
        resource: String,
        /// The token the write carried.
        token: u64,
        /// The level the token must be above: the resource's `max_seen`, or the floor's.
        max_seen: u64,
        /// The subtree (`/dav/`, or `/`) whose floor sets the level, when a floor does.
        floor: Option<String>,
    },
    /// The token is further above the key's level (or its domain's highest token) than
    /// `max_jump` allows.
    #[error("token {token} is more than max_jump {max_jump} above {}", jump_base(resource, *base, domain.as_deref()))]
    Jump {
        /// The fence key.
        resource: String,
        /// The token the write carried.
        token: u64,
        /// The key's level, or the highest token of its domain when it has none.
        base: u64,
        /// The bound.
        max_jump: u64,
        /// The token domain whose highest token `base` is, when the key has no level.
        domain: Option<String>,
    },
    /// The write waited too long behind earlier writes to the same resource.
    #[error("{resource} is busy: earlier writes were still in flight after {waited:?}")]
    QueueTimeout {
        /// The fence key.
        resource: String,
        /// How long the write waited.
        waited: Duration,
    },
    /// An earlier write's outcome is unknown, so the resource is closed for a while.
    #[error("{resource} is closed for a while: {cause}")]
    Quarantined {
        /// The fence key.
        resource: String,
        /// Time until the resource reopens.
        retry_after: Duration,
        /// What left the outcome unknown.
        cause: QuarantineCause,
    },
    /// An operator asked to lower `max_seen`, which never happens.
    #[error("max_seen of {resource} is {max_seen}; it is never lowered to {to}")]
    WouldLower {
        /// The fence key.
        resource: String,
        /// Its current `max_seen`.
        max_seen: u64,
        /// The value asked for.
        to: u64,
    },
    /// An operator asked a reset to raise `max_seen`, which only `advance` does.
    #[error("max_seen of {resource} is {max_seen}; a reset only lowers it, and {to} is above (raise it with :advance)")]
    WouldRaise {
        /// The fence key.
        resource: String,
        /// Its current `max_seen`.
        max_seen: u64,
        /// The value asked for.
        to: u64,
    },
    /// An operator asked to reset a key with no `max_seen` and no floor at or below it.
    #[error("{resource} has no max_seen and no floor below it: there is nothing to reset")]
    NoFence {
        /// The fence key.
        resource: String,
    },
    /// A write to a resource the table does not hold, while the table's bytes (keys, floors
    /// and gates) would pass their limit with its gate.
    #[error(
        "{resource} is a new resource and the fence table is full ({max_bytes} bytes of keys, floors \
        and gates, store.max_table_bytes); only known resources accept writes"
    )]
    Full {
        /// The fence key.
        resource: String,
        /// The table's limit in bytes.
        max_bytes: u64,
    },
    /// A part, completion or abort names an upload that was not created for its object through
    /// fencegate (or whose binding was dropped: it ended, or could never complete).
    #[error("{} is not an open multipart upload of {object} that fencegate bound", if .upload.is_empty() { "the upload id" } else { .upload.as_str() })]
    UnknownUpload {
        /// The object the request names.
        object: String,
        /// The upload id it carries.
        upload: String,
    },
    /// A part, completion or abort carries another token than the one its upload was created
    /// with.
    #[error(
        "upload {upload} of {object} was created with token {bound}; its parts, completion and abort carry that token, not {token}"
    )]
    UploadToken {
        /// The object.
        object: String,
        /// The upload id.
        upload: String,
        /// The token the request carried.
        token: u64,
        /// The token the upload was created with.
        bound: u64,
    },
    /// A write or an operator's raise ended without an answer: the write's future panicked,
    /// or the raise's task panicked or was cancelled by its runtime's shutdown.
    #[error("the write failed inside fencegate: {0}")]
    TaskFailed(String),
}

/// Why a resource is quarantined: a write to it may still be applied by the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QuarantineCause {
    /// The backend did not answer an earlier write (timeout, broken connection, a body cut off).
    #[default]
    UnknownOutcome,
    /// A write to it was in flight when fencegate last stopped.
    InFlightAtStart,
    /// The backend did not answer an earlier write that was sent pinned (docs/pins.md): a
    /// pinned write that cannot leave the key absent may pass, the others wait.
    UnknownPinnedOutcome,
}

impl std::fmt::Display for QuarantineCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            QuarantineCause::UnknownOutcome => {
                "the backend did not answer an earlier write (it timed out or the connection broke), which it may still apply"
            }
            QuarantineCause::InFlightAtStart => {
                "a write to it was in flight when fencegate last stopped, and the backend may still apply it"
            }
            QuarantineCause::UnknownPinnedOutcome => {
                "the backend did not answer an earlier write, which it may still apply while the resource is in the state \
                that write was pinned to; until the quarantine ends only pinned writes that leave the resource in place pass"
            }
        })
    }
}
