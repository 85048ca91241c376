//! The access log (`log.access`): one line per proxied request, whatever became of it, at info
//! under the target `fencegate::access`. A request gathers its line's fields here and hands them
//! to the log's access thread (`crate::logging::access`), which formats and writes them, so a
//! line costs a serving thread no formatting, and no system call while lines come; with the
//! setting off, or the level above `info`, a request pays a branch and allocates nothing for it.

use std::time::{Instant, SystemTime};

use http::header::{REFERER, USER_AGENT};
use http::{Method, Request, StatusCode};

use super::classify::Plan;
use crate::config::AccessFormat;
use crate::logging::access::{Combined, Line};
use crate::upstream::Peer;

/// What the access line says about one request, gathered as it goes.
#[derive(Debug)]
pub(crate) struct Entry {
    method: Method,
    path: String,
    /// The fence keys it touches, joined by ",": empty when it is not a fenced write.
    keys: String,
    token: Option<u64>,
    started: Instant,
    layout: AccessFormat,
    /// What the combined layouts add, gathered only for them.
    combined: Option<Box<Combined>>,
}

impl Entry {
    /// Starts the line of `req`, from `client`, received at `started`, in `layout`, if access
    /// lines are written at all.
    pub(crate) fn start<B>(req: &Request<B>, client: &Peer, layout: AccessFormat, started: Instant) -> Option<Entry> {
        crate::logging::access_enabled().then(|| {
            let mut entry = Entry::new(req.method(), req.uri().path(), started);
            entry.layout = layout;
            if layout != AccessFormat::Log {
                let header = |name| req.headers().get(name).cloned();
                entry.combined = Some(Box::new(Combined {
                    client: client.ip(),
                    query: req.uri().query().map(str::to_owned),
                    version: req.version(),
                    body_bytes: None,
                    referer: header(REFERER),
                    user_agent: header(USER_AGENT),
                }));
            }
            entry
        })
    }

    fn new(method: &Method, path: &str, started: Instant) -> Entry {
        Entry {
            method: method.clone(),
            path: path.to_owned(),
            keys: String::new(),
            token: None,
            started,
            layout: AccessFormat::Log,
            combined: None,
        }
    }

    /// Notes what the classification made of it.
    pub(crate) fn plan(&mut self, plan: &Plan) {
        if let Plan::Write(write) = plan {
            self.token = Some(write.token);
            self.keys = write.touches.iter().map(|t| t.key.as_str()).collect::<Vec<_>>().join(",");
        }
    }

    /// Writes the line: `outcome` is `forwarded`, `passed` or the refusal's code, `status` what
    /// the client got where fencegate knows it, `backend` the backend's status when it
    /// answered, `body_bytes` the length of the response's body when its head says it (none for
    /// a HEAD).
    pub(crate) fn log(
        mut self,
        outcome: &'static str,
        status: Option<StatusCode>,
        backend: Option<StatusCode>,
        body_bytes: Option<u64>,
    ) {
        if let Some(combined) = self.combined.as_mut() {
            combined.body_bytes = if self.method == Method::HEAD { Some(0) } else { body_bytes };
        }
        crate::logging::access(Line {
            at: SystemTime::now(),
            duration_us: u64::try_from(self.started.elapsed().as_micros()).unwrap_or(u64::MAX),
            layout: self.layout,
            combined: self.combined,
            method: self.method,
            path: self.path,
            keys: self.keys,
            token: self.token,
            outcome,
            status: status.map(|s| s.as_u16()),
            backend_status: backend.map(|s| s.as_u16()),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::{Coverage, Touch};

    #[test]
    fn a_fenced_write_names_its_keys_and_token() {
        let mut e = Entry::new(&Method::PUT, "/a", Instant::now());
        e.plan(&Plan::Pass { target: "/a".parse().unwrap() });
        assert_eq!((e.keys.as_str(), e.token), ("", None));
        let touches = ["/a", "/b/"].map(|k| Touch { key: k.into(), coverage: Coverage::Key }).to_vec();
        let write = super::super::classify::Write {
            token: 7,
            touches,
            target: "/a".parse().unwrap(),
            set_headers: Vec::new(),
            body_limit: None,
            equal: crate::fence::EqualToken::Reject,
            locks: Vec::new(),
            max_jump: None,
            proof: super::super::proof::Proof::None,
            upload: None,
            pin: None,
        };
        e.plan(&Plan::Write(write));
        assert_eq!((e.keys.as_str(), e.token), ("/a,/b/", Some(7)));
    }
}
