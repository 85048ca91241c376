//! Access lines (`log.access`), formatted off the threads that serve requests.
//!
//! A request hands its line's fields to a queue under a lock and goes on: no formatting, no
//! system call. The `fencegate-access` thread formats what the queue holds, in the log's
//! format (the same text or JSON as every other line), and writes it to the log's writer in a
//! few large writes. Formatting through `tracing` on the serving thread cost about 14,000
//! instructions a line; here the request pays for a push, and the thread for a line written
//! by hand.
//!
//! The thread wakes by itself every [`FLUSH`] while lines come, and sleeps without a deadline
//! once a wake finds none: then the next line wakes it. So a line reaches the log at most
//! `FLUSH` after its request ended (its timestamp is that end, so lines a little out of order
//! with other lines are possible), an idle process has no timer, and a busy one wakes this
//! thread 20 times a second, not once a line. A queue half full wakes it early; a full one
//! drops the line and counts it, as the log's own queue does.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use http::Method;

use crate::config::LogFormat;

/// Longest a line waits in the queue while lines come.
pub(crate) const FLUSH: Duration = Duration::from_millis(50);

/// Formatted lines are handed to the log's writer in writes of about this many bytes.
const CHUNK: usize = 32 << 10;

/// One request's access line.
#[derive(Debug)]
pub(crate) struct Line {
    /// When the request ended: the line's timestamp.
    pub(crate) at: SystemTime,
    pub(crate) method: Method,
    pub(crate) path: String,
    /// The fence keys it touches, joined by ",".
    pub(crate) keys: String,
    pub(crate) token: Option<u64>,
    /// `forwarded`, or the refusal's code.
    pub(crate) outcome: &'static str,
    pub(crate) status: u16,
    pub(crate) backend_status: Option<u16>,
    pub(crate) duration_ms: f64,
}

/// The queue between requests and the access thread.
#[derive(Debug)]
pub(super) struct Queue {
    state: Mutex<State>,
    wake: Condvar,
    capacity: usize,
    dropped: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    lines: Vec<Line>,
    /// The thread sleeps without a deadline: the next line wakes it.
    asleep: bool,
    /// The thread was woken for a queue half full, and has not taken it yet.
    urged: bool,
    closed: bool,
}

impl Queue {
    pub(super) fn new(capacity: usize) -> Queue {
        Queue { state: Mutex::default(), wake: Condvar::new(), capacity: capacity.max(1), dropped: AtomicU64::new(0) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `line`, or drops and counts it if the queue is full.
    pub(super) fn push(&self, line: Line) {
        let mut state = self.lock();
        if state.lines.len() >= self.capacity {
            drop(state);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        state.lines.push(line);
        let wake = if state.asleep {
            state.asleep = false;
            true
        } else if !state.urged && state.lines.len() >= self.capacity / 2 {
            state.urged = true;
            true
        } else {
            false
        };
        drop(state);
        if wake {
            self.wake.notify_one();
        }
    }

    /// Lines dropped because the queue was full.
    pub(super) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Tells the thread to write what is queued and end.
    pub(super) fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_one();
    }

    /// Waits for lines (see the module's doc) and swaps them into `into`, which the caller
    /// emptied; false once the queue is closed and empty.
    fn take(&self, into: &mut Vec<Line>) -> bool {
        let mut state = self.lock();
        if !state.closed && !state.urged {
            let (next, waited) = self.wake.wait_timeout(state, FLUSH).unwrap_or_else(|e| e.into_inner());
            state = next;
            if waited.timed_out() && state.lines.is_empty() && !state.closed {
                // A whole FLUSH without a line: sleep until the next one (`push` clears
                // `asleep`) or the close.
                state.asleep = true;
                state = self.wake.wait_while(state, |s| s.asleep && !s.closed).unwrap_or_else(|e| e.into_inner());
                state.asleep = false;
            }
        }
        state.urged = false;
        std::mem::swap(&mut state.lines, into);
        !(state.closed && into.is_empty())
    }
}

/// The access thread's body: formats and writes every line queued, until the queue closes.
pub(super) fn run(queue: Arc<Queue>, format: LogFormat, mut out: impl Write) {
    let mut lines = Vec::new();
    let mut buf = Vec::with_capacity(CHUNK + 1024);
    while queue.take(&mut lines) {
        for line in lines.drain(..) {
            match format {
                LogFormat::Text => text(&line, &mut buf),
                LogFormat::Json => json(&line, &mut buf),
            }
            if buf.len() >= CHUNK {
                let _ = out.write_all(&buf);
                buf.clear();
            }
        }
        if !buf.is_empty() {
            let _ = out.write_all(&buf);
            buf.clear();
        }
    }
}

/// The line as the log's text format writes an event: timestamp, level, target, message,
/// then `name=value` fields, an absent value leaving its field out. (Never coloured.)
pub(crate) fn text(line: &Line, buf: &mut Vec<u8>) {
    let _ = write!(
        buf,
        "{}  INFO fencegate::access: request method={} path={} keys={}",
        humantime::format_rfc3339_micros(line.at),
        line.method,
        line.path,
        line.keys
    );
    if let Some(token) = line.token {
        let _ = write!(buf, " token={token}");
    }
    let _ = write!(buf, " outcome={} status={}", line.outcome, line.status);
    if let Some(status) = line.backend_status {
        let _ = write!(buf, " backend_status={status}");
    }
    let _ = writeln!(buf, " duration_ms={:?}", line.duration_ms);
}

/// The line as the log's JSON format writes an event: one object, the fields at its top level.
pub(crate) fn json(line: &Line, buf: &mut Vec<u8>) {
    let _ = write!(
        buf,
        r#"{{"timestamp":"{}","level":"INFO","message":"request","method":"#,
        humantime::format_rfc3339_micros(line.at)
    );
    string(buf, line.method.as_str());
    buf.extend_from_slice(br#","path":"#);
    string(buf, &line.path);
    buf.extend_from_slice(br#","keys":"#);
    string(buf, &line.keys);
    if let Some(token) = line.token {
        let _ = write!(buf, r#","token":{token}"#);
    }
    buf.extend_from_slice(br#","outcome":"#);
    string(buf, line.outcome);
    let _ = write!(buf, r#","status":{}"#, line.status);
    if let Some(status) = line.backend_status {
        let _ = write!(buf, r#","backend_status":{status}"#);
    }
    buf.extend_from_slice(br#","duration_ms":"#);
    let _ = serde_json::to_writer(&mut *buf, &line.duration_ms);
    buf.extend_from_slice(b",\"target\":\"fencegate::access\"}\n");
}

/// `s` as a JSON string, quoted and escaped.
fn string(buf: &mut Vec<u8>, s: &str) {
    let _ = serde_json::to_writer(&mut *buf, s);
}

#[cfg(test)]
#[path = "access_tests.rs"]
mod tests;
