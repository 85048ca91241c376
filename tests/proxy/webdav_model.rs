//! Model-based checks of fenced WebDAV writes: random mixes of PUT, DELETE, MOVE and COPY go
//! through the proxy, some at once, to a recording WebDAV stub (`common/webdav.rs`), and the
//! properties are checked on the stub's own record of which files each write changed and
//! which writes were at the backend together, never on fencegate's key sets:
//!
//! - every change to a file carries a token above every earlier change to that file;
//! - no two writes whose regions overlap were at the backend at once;
//! - each answer is the backend's, for a write the backend received exactly once, or
//!   fencegate's own refusal, for a write the backend never received; a stale refusal is
//!   explained by a write the backend received with an overlapping region and a token at
//!   least as high.
//!
//! [`DEFAULT_CASES`] random programs in a local `cargo test`; `FG_WEBDAV_CASES=N` runs N
//! (`.ci/run` sets 256).

use crate::common;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use common::webdav::{self, OP_HEADER, Record, Region, Violation, WebDavStub};
use common::{Harness, Resp};
use fencegate::Config;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::{TestCaseError, TestRunner};

/// A small tree: nested enough that subtrees contain each other, small enough that random
/// writes collide often.
const PATHS: [&str; 7] = ["/a", "/a/x", "/a/y", "/a/x/z", "/b", "/b/x", "/c"];

/// Refusals a correct proxy may give these programs. Anything else from fencegate itself (a
/// backend error, an internal error) means it lost track of a write.
const ACCEPTABLE_REFUSALS: [&str; 4] = ["stale_token", "queue_timeout", "resource_quarantined", "invalid_header"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Put,
    Delete,
    /// DELETE of the path with a trailing slash, as a client deletes a collection.
    DeleteSlash,
    Move,
    Copy,
}

/// How a MOVE or COPY spells its Destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DestForm {
    Path,
    /// `http://<proxy>/path`, naming this server.
    Uri,
    /// `http://elsewhere.example/path`: another server, which fencegate must refuse.
    Foreign,
}

#[derive(Clone)]
struct Op {
    kind: Kind,
    path: &'static str,
    dest: &'static str,
    form: DestForm,
    token: u64,
}

impl Op {
    fn method(&self) -> &'static str {
        match self.kind {
            Kind::Put => "PUT",
            Kind::Delete | Kind::DeleteSlash => "DELETE",
            Kind::Move => "MOVE",
            Kind::Copy => "COPY",
        }
    }

    fn target(&self) -> String {
        match self.kind {
            Kind::DeleteSlash => format!("{}/", self.path),
            _ => self.path.to_owned(),
        }
    }

    /// The Destination header as sent to the proxy at `proxy` (`host:port`).
    fn destination(&self, proxy: &str) -> Option<String> {
        if !matches!(self.kind, Kind::Move | Kind::Copy) {
            return None;
        }
        Some(match self.form {
            DestForm::Path => self.dest.to_owned(),
            DestForm::Uri => format!("http://{proxy}{}", self.dest),
            DestForm::Foreign => format!("http://elsewhere.example{}", self.dest),
        })
    }

    /// What the op may change, in the stub's terms.
    fn regions(&self) -> Vec<Region> {
        webdav::regions(self.method(), &self.target(), self.destination("proxy").as_deref())
    }
}

impl fmt::Debug for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.method(), self.target())?;
        if let Some(dest) = self.destination("proxy") {
            write!(f, " -> {dest}")?;
        }
        write!(f, " @{}", self.token)
    }
}

/// Ops sent `batch` at a time: each batch all at once, the next when all have been answered.
#[derive(Clone)]
struct Program {
    ops: Vec<Op>,
    batch: usize,
}

impl fmt::Debug for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (b, batch) in self.ops.chunks(self.batch).enumerate() {
            writeln!(f, "batch {b}: {batch:?}")?;
        }
        Ok(())
    }
}

/// Whether `path` is `root` or below it.
fn at_or_below(path: &str, root: &str) -> bool {
    path.strip_prefix(root).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

fn op() -> impl Strategy<Value = (Kind, &'static str, &'static str, DestForm, u64)> {
    use Kind::*;
    let kind = prop_oneof![3 => Just(Put), 1 => Just(Delete), 1 => Just(DeleteSlash), 2 => Just(Move), 2 => Just(Copy)];
    let form = prop_oneof![4 => Just(DestForm::Path), 4 => Just(DestForm::Uri), 1 => Just(DestForm::Foreign)];
    (kind, select(&PATHS[..]), select(&PATHS[..]), form, 0u64..10)
        .prop_filter("WebDAV forbids a Destination at or inside its source", |(kind, path, dest, ..)| {
            !matches!(kind, Move | Copy) || !at_or_below(dest, path)
        })
}

/// Tokens drift upwards by 2 per op with a jitter of up to 9, so a write is often stale
/// against one a few places before it, sometimes equal, and later writes still get through.
fn program() -> impl Strategy<Value = Program> {
    (prop::collection::vec(op(), 10..=30), 4usize..=6).prop_map(|(ops, batch)| Program {
        ops: ops
            .into_iter()
            .enumerate()
            .map(|(i, (kind, path, dest, form, jitter))| Op {
                kind,
                path,
                dest,
                form,
                token: 1 + 2 * i as u64 + jitter,
            })
            .collect(),
        batch,
    })
}

/// Every file the stub starts with, so DELETE, MOVE and COPY have something to change from
/// the first op on.
const SEEDED: [&str; 5] = ["/a", "/a/x", "/a/x/z", "/b/x", "/c"];

/// One answered op.
struct Answer {
    op: usize,
    batch: usize,
    resp: Resp,
}

/// A program's run: the ops, fencegate's answers, and the stub's record.
struct Run {
    ops: Vec<Op>,
    answers: Vec<Answer>,
    records: Vec<Record>,
    violations: Vec<Violation>,
    files: BTreeMap<String, bytes::Bytes>,
}

async fn send(h: &Harness, i: usize, op: &Op) -> Resp {
    let (token, id) = (op.token.to_string(), i.to_string());
    let dest = op.destination(&h.addr.to_string());
    let mut headers = vec![("fencing-token", token.as_str()), (OP_HEADER, id.as_str())];
    if let Some(dest) = &dest {
        headers.push(("destination", dest));
    }
    let body = if op.kind == Kind::Put { format!("written by op {i}") } else { String::new() };
    h.send(op.method(), &op.target(), &headers, body).await
}

/// Runs `program` through a proxy configured with `tweak`, in front of a fresh seeded stub.
async fn run(program: &Program, tweak: impl FnOnce(&mut Config)) -> Run {
    let stub = WebDavStub::start().await;
    for path in SEEDED {
        stub.seed(path, "seeded");
    }
    let url = stub.url();
    let h = Arc::new(
        Harness::start_with(|c| {
            c.backend.url = url.parse().unwrap();
            tweak(c);
        })
        .await,
    );
    let mut answers = Vec::new();
    let indexed: Vec<(usize, Op)> = program.ops.iter().cloned().enumerate().collect();
    for (batch, ops) in indexed.chunks(program.batch).enumerate() {
        let tasks: Vec<_> = ops
            .iter()
            .cloned()
            .map(|(i, op)| {
                let h = Arc::clone(&h);
                (i, tokio::spawn(async move { send(&h, i, &op).await }))
            })
            .collect();
        for (op, task) in tasks {
            answers.push(Answer { op, batch, resp: task.await.expect("the client task finishes") });
        }
    }
    Arc::into_inner(h).expect("no client task holds the harness").shutdown().await;
    Run {
        ops: program.ops.clone(),
        answers,
        records: stub.records(),
        violations: stub.violations(),
        files: stub.files(),
    }
}

/// Every file a write changed carries a token strictly above every token that changed that
/// file before it (equal is refused by default). Walks the record in order of completion.
fn check_tokens(records: &[Record]) -> Result<(), String> {
    let mut by_end: Vec<&Record> = records.iter().collect();
    by_end.sort_by_key(|r| r.end);
    let mut last: BTreeMap<&str, (u64, &Record)> = BTreeMap::new();
    for r in by_end {
        if r.changed.is_empty() {
            continue;
        }
        let Some(token) = r.token() else {
            return Err(format!("{} changed {:?} without a token", r.describe(), r.changed));
        };
        for file in &r.changed {
            if let Some((before, earlier)) = last.get(file.as_str())
                && token <= *before
            {
                return Err(format!(
                    "{file} was changed by {} after {} had changed it",
                    r.describe(),
                    earlier.describe()
                ));
            }
            last.insert(file, (token, r));
        }
    }
    Ok(())
}

/// No write arrived while another whose regions overlap its own was in flight, as the stub saw
/// it on arrival and as the sequence numbers of the record say.
fn check_no_overlap(run: &Run) -> Result<(), String> {
    if let Some(v) = run.violations.first() {
        return Err(format!("{} arrived while {} was in flight", v.arriving, v.in_flight));
    }
    for (i, a) in run.records.iter().enumerate() {
        for b in &run.records[i + 1..] {
            let overlap = a.regions().iter().any(|ra| b.regions().iter().any(|rb| ra.overlaps(rb)));
            let together = a.start < b.end && b.start < a.end;
            if overlap && together {
                return Err(format!("{} and {} were at the backend at once", a.describe(), b.describe()));
            }
        }
    }
    Ok(())
}

/// Each answer is the backend's, for the op the backend received exactly once and as sent,
/// or an acceptable refusal for an op it never received; every stale refusal is explained by a
/// write the backend received, sent no later than the refused one's batch, whose regions
/// overlap its own and whose token is at least as high.
fn check_answers(run: &Run) -> Result<(), String> {
    let batch_of: BTreeMap<String, usize> = run.answers.iter().map(|a| (a.op.to_string(), a.batch)).collect();
    for a in &run.answers {
        let op = &run.ops[a.op];
        let id = a.op.to_string();
        let received: Vec<&Record> = run.records.iter().filter(|r| r.op.as_deref() == Some(&id)).collect();
        match a.resp.fencegate_error() {
            Some(code) => {
                if !ACCEPTABLE_REFUSALS.contains(&code) {
                    return Err(format!(
                        "op {} {op:?}: fencegate answered {} {code}: {:?}",
                        a.op, a.resp.status, a.resp.body
                    ));
                }
                if let Some(r) = received.first() {
                    return Err(format!(
                        "op {} {op:?} was refused ({code}) but the backend received {}",
                        a.op,
                        r.describe()
                    ));
                }
                if (op.form == DestForm::Foreign && matches!(op.kind, Kind::Move | Kind::Copy))
                    != (code == "invalid_header")
                {
                    return Err(format!("op {} {op:?}: refused {code}", a.op));
                }
                if code == "stale_token" {
                    let own = op.regions();
                    let explained = run.records.iter().any(|r| {
                        r.token().is_some_and(|t| t >= op.token)
                            && r.op.as_ref().and_then(|id| batch_of.get(id)).is_some_and(|&b| b <= a.batch)
                            && r.regions().iter().any(|theirs| own.iter().any(|mine| mine.overlaps(theirs)))
                    });
                    if !explained {
                        return Err(format!(
                            "op {} {op:?} was refused as stale, but no write it overlaps held its token",
                            a.op
                        ));
                    }
                }
            }
            None => {
                let [r] = received[..] else {
                    return Err(format!(
                        "op {} {op:?} answered {} but the backend received it {} times",
                        a.op,
                        a.resp.status,
                        received.len()
                    ));
                };
                if a.resp.status != r.status {
                    return Err(format!(
                        "op {} {op:?}: the backend answered {}, the client got {}",
                        a.op, r.status, a.resp.status
                    ));
                }
                let sent_dest = op.destination("proxy").map(|d| webdav::destination_path(&d));
                let got_dest = r.destination.as_deref().map(webdav::destination_path);
                if (r.method.as_str(), r.path.as_str(), r.token())
                    != (op.method(), op.target().as_str(), Some(op.token))
                    || sent_dest != got_dest
                {
                    return Err(format!("op {} {op:?} reached the backend as {}", a.op, r.describe()));
                }
            }
        }
    }
    Ok(())
}

fn check_all(run: &Run) -> Result<(), String> {
    check_answers(run)?;
    check_no_overlap(run)?;
    check_tokens(&run.records)
}

/// Random programs without `FG_WEBDAV_CASES`: a couple of seconds.
const DEFAULT_CASES: u32 = 32;

#[test]
fn random_webdav_programs_keep_every_file_fenced() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let cases = std::env::var("FG_WEBDAV_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(DEFAULT_CASES);
    let config = ProptestConfig {
        cases,
        // A failing program re-runs through a proxy for every shrink step; bound the search.
        max_shrink_iters: 256,
        // Only the two test files belong to this suite; failures print their program instead.
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let mut runner = TestRunner::new(config);
    let result = runner.run(&program(), |program| {
        let run = rt.block_on(run(&program, |_| {}));
        check_all(&run).map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

fn op_at(kind: Kind, path: &'static str, dest: &'static str, token: u64) -> Op {
    Op { kind, path, dest, form: DestForm::Path, token }
}

/// docs/writes.md's example, one op at a time: a file below a collection, stale writes to the
/// collection, a DELETE above them, and a late PUT below it.
fn known_sequence() -> Program {
    use Kind::*;
    Program {
        ops: vec![
            op_at(Put, "/z", "", 1),
            op_at(Put, "/d/f", "", 1000),
            op_at(DeleteSlash, "/d", "", 5),
            op_at(Move, "/z", "/d/", 5),
            op_at(DeleteSlash, "/d", "", 2000),
            op_at(Put, "/d/f", "", 1500),
        ],
        batch: 1,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_known_sequence_changes_only_what_the_fence_allows() {
    let run = run(&known_sequence(), |_| {}).await;
    let statuses: Vec<(u16, Option<&str>)> =
        run.answers.iter().map(|a| (a.resp.status, a.resp.fencegate_error())).collect();
    assert_eq!(
        statuses,
        [
            (201, None),
            (201, None),
            (409, Some("stale_token")),
            (409, Some("stale_token")),
            (204, None),
            (409, Some("stale_token"))
        ]
    );
    // The backend saw three writes; the DELETE removed the file the first PUT of /d/f made.
    let seen: Vec<(&str, &str, Option<u64>, Vec<&str>)> = run
        .records
        .iter()
        .map(|r| (r.method.as_str(), r.path.as_str(), r.token(), r.changed.iter().map(String::as_str).collect()))
        .collect();
    assert_eq!(
        seen,
        [
            ("PUT", "/z", Some(1), vec!["/z"]),
            ("PUT", "/d/f", Some(1000), vec!["/d/f"]),
            ("DELETE", "/d/", Some(2000), vec!["/d/f"])
        ]
    );
    assert!(run.files.contains_key("/z") && !run.files.contains_key("/d/f"), "{:?}", run.files.keys());
    check_all(&run).unwrap();
}

/// With `fence.subtree_methods = []` the proxy fences DELETE /d/ on the key `/d/` alone, so the
/// stale DELETE reaches the backend and removes /d/f, and the token property says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_property_catches_a_proxy_that_fences_collections_as_single_keys() {
    let run = run(&known_sequence(), |c| c.fence.subtree_methods.clear()).await;
    assert_eq!(run.answers[2].resp.status, 204, "the stale DELETE went through");
    let err = check_tokens(&run.records).unwrap_err();
    assert!(err.starts_with("/d/f was changed by DELETE /d/ (op 2, token 5)"), "{err}");
    check_answers(&run).unwrap();
}
