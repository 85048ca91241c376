//! Access lines (`log.access`), formatted off the threads that serve requests.
//!
//! A request hands its line's fields to a queue under a lock and goes on: it formats nothing.
//! The `fencegate-access` thread formats what the queue holds in the layout each line asks for
//! ([`super::layout`]) and writes it to stderr in writes of whole lines, at
//! most [`CHUNK`] bytes each unless one line is longer. Each write holds stderr's lock until
//! it is done, so no line of the log's own thread lands inside it, and a pipe takes a write of
//! that size whole, so no other process's bytes do either (a longer line, or stderr a file or
//! a socket, has only the lock). When stderr blocks, this thread blocks, its queue fills, and
//! further lines are dropped and counted, one by one; lines a write fails to take (a broken
//! pipe, a full disk) are dropped and counted too.
//!
//! The thread wakes by itself every [`FLUSH`] while lines come, and sleeps without a deadline
//! once a wake finds none: then the next line wakes it (a futex wake on the serving thread,
//! once per idle spell) and is written at once. Lines after it reach the log within about
//! `FLUSH`, plus the time to write the lines before them (each is stamped when its response
//! was ready, so it can follow lines logged after that); an idle process has no timer, and a
//! busy one wakes this thread 20 times a second, not once a line. A queue half full wakes it
//! early.

use std::io::Write;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use http::{HeaderValue, Method, Version};

#[cfg(test)]
use super::layout::{LATEST, json, text, timestamp};
use crate::config::{AccessFormat, LogFormat};

/// How long the thread gathers lines between two writes while lines come.
const FLUSH: Duration = Duration::from_millis(50);

/// Lines are written to stderr in writes of at most this many bytes, unless one line is longer:
/// a pipe takes a write of up to `PIPE_BUF` (4,096 bytes on Linux) whole.
const CHUNK: usize = 4096;

/// One request's access line.
#[derive(Debug)]
pub(crate) struct Line {
    /// When the response's head was ready (its body, if any, still to be relayed): the
    /// line's timestamp.
    pub(crate) at: SystemTime,
    /// Its layout (`log.access_format` when the request started).
    pub(crate) layout: AccessFormat,
    pub(crate) method: Method,
    pub(crate) path: String,
    /// The fence keys it touches, joined by ",".
    pub(crate) keys: String,
    pub(crate) token: Option<u64>,
    /// `forwarded`, or the refusal's code.
    pub(crate) outcome: &'static str,
    /// What the client got, where fencegate knows it: an exchange Envoy carried on unchecked
    /// (`passed`) reports no answer to fencegate.
    pub(crate) status: Option<u16>,
    pub(crate) backend_status: Option<u16>,
    /// From the request's start to its response head, in whole microseconds.
    pub(crate) duration_us: u64,
    /// What only the combined layouts show: `None` in the others.
    pub(crate) combined: Option<Box<Combined>>,
}

/// The fields of nginx's `combined` format that the others lack.
#[derive(Debug)]
pub(crate) struct Combined {
    /// The client's address; `None` for a peer on a Unix socket.
    pub(crate) client: Option<IpAddr>,
    /// The query, after the path in the request line.
    pub(crate) query: Option<String>,
    pub(crate) version: Version,
    /// The response body's length as its head declares it, if it does.
    pub(crate) body_bytes: Option<u64>,
    pub(crate) referer: Option<HeaderValue>,
    pub(crate) user_agent: Option<HeaderValue>,
}

/// The queue between requests and the access thread.
#[derive(Debug)]
pub(super) struct Queue {
    state: Mutex<State>,
    /// Wakes the thread: a line after an idle spell, a queue half full, the close.
    wake: Condvar,
    /// Tells the closer that the thread has ended, however it ended.
    ended: Condvar,
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
    /// The thread has ended.
    finished: bool,
}

impl Queue {
    pub(super) fn new(capacity: usize) -> Queue {
        Queue {
            state: Mutex::default(),
            wake: Condvar::new(),
            ended: Condvar::new(),
            capacity: capacity.max(1),
            dropped: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `line`, or drops and counts it if the queue is full or closed.
    pub(super) fn push(&self, line: Line) {
        let mut state = self.lock();
        if state.lines.len() >= self.capacity || state.closed {
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

    /// Lines dropped: the queue was full or closed, or stderr refused them.
    pub(super) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Tells the thread to write what is queued and end.
    pub(super) fn close(&self) {
        self.lock().closed = true;
        self.wake.notify_one();
    }

    /// Closes the queue and waits at most `within` for the thread to write what it holds and
    /// end: joined if it did, left to the process's exit if not (a stderr that blocks). Whether
    /// it ended.
    pub(super) fn stop(&self, thread: std::thread::JoinHandle<()>, within: Duration) -> bool {
        self.close();
        let ended = self.wait_ended(within);
        if ended {
            let _ = thread.join();
        }
        ended
    }

    /// Waits at most `within` for the thread to end; whether it did.
    fn wait_ended(&self, within: Duration) -> bool {
        let state = self.lock();
        let (state, _) =
            self.ended.wait_timeout_while(state, within, |s| !s.finished).unwrap_or_else(|e| e.into_inner());
        state.finished
    }

    /// Waits for lines until `due` (see the module's doc) and swaps them into `into`, which
    /// the caller emptied; false once the queue is closed and empty.
    fn take(&self, into: &mut Vec<Line>, due: Instant) -> bool {
        let mut state = self.lock();
        if !state.closed && !state.urged {
            let wait = due.saturating_duration_since(Instant::now());
            let (next, _) =
                self.wake.wait_timeout_while(state, wait, |s| !s.closed && !s.urged).unwrap_or_else(|e| e.into_inner());
            state = next;
            if state.lines.is_empty() && !state.closed {
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
pub(super) fn run(queue: Arc<Queue>, format: LogFormat, out: impl Sink) {
    /// Marks the thread ended, however it ends.
    struct Ended<'a>(&'a Queue);
    impl Drop for Ended<'_> {
        fn drop(&mut self) {
            self.0.lock().finished = true;
            self.0.ended.notify_all();
        }
    }
    let _ended = Ended(&queue);
    let mut out = Chunks { out, buf: Vec::with_capacity(CHUNK), torn: false, dropped: &queue.dropped };
    let (mut lines, mut line) = (Vec::new(), Vec::with_capacity(512));
    let mut due = Instant::now() + FLUSH;
    while queue.take(&mut lines, due) {
        due = Instant::now() + FLUSH;
        for l in lines.drain(..) {
            line.clear();
            super::layout::write(&l, format, &mut line);
            out.push(&line);
        }
        out.write();
    }
}

/// Where the thread's writes go.
pub(super) trait Sink {
    /// Runs `write` with the destination held for it alone.
    fn locked(&mut self, write: &mut dyn FnMut(&mut dyn Write));
}

/// Stderr, locked for each write's whole retry loop, so that no other line of this process
/// lands inside it even when it goes out in parts.
impl Sink for std::io::Stderr {
    fn locked(&mut self, write: &mut dyn FnMut(&mut dyn Write)) {
        write(&mut self.lock());
    }
}

/// Whole lines gathered into writes of at most `CHUNK` bytes (or one longer line).
struct Chunks<'a, S> {
    out: S,
    buf: Vec<u8>,
    /// A failed write left a line unfinished: the next write starts on a new line.
    torn: bool,
    dropped: &'a AtomicU64,
}

impl<S: Sink> Chunks<'_, S> {
    fn push(&mut self, line: &[u8]) {
        // Room for the new line a torn write leaves to the next.
        if !self.buf.is_empty() && self.buf.len() + line.len() + usize::from(self.torn) > CHUNK {
            self.write();
        }
        self.buf.extend_from_slice(line);
    }

    /// Writes what is gathered; what stderr refuses is counted as dropped, line by line.
    fn write(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        let was_torn = std::mem::take(&mut self.torn);
        if was_torn {
            self.buf.insert(0, b'\n');
        }
        let mut written = 0;
        let buf = &self.buf;
        self.out.locked(&mut |out| {
            let mut backoff = Duration::from_millis(1);
            while written < buf.len() {
                match out.write(&buf[written..]) {
                    Ok(0) => break,
                    Ok(n) => written += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    // A stderr left non-blocking by whoever started the process: wait as a
                    // blocking one would, checking less often the longer it stays full.
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(backoff);
                        backoff = (backoff * 2).min(FLUSH);
                    }
                    Err(_) => break,
                }
            }
        });
        // The new line put in front for a torn line is not a line of its own.
        let lost = self.buf[written.max(usize::from(was_torn))..].iter().filter(|&&b| b == b'\n').count();
        self.dropped.fetch_add(lost as u64, Ordering::Relaxed);
        // Every line ends in a new line: the output is mid-line if the last byte out was not one.
        self.torn = if written == 0 { was_torn } else { self.buf[written - 1] != b'\n' };
        self.buf.clear();
    }
}

/// Logs `line` through `tracing`, for a subscriber other than the one `init` installs.
pub(super) fn through_tracing(line: Line) {
    let Line { method, path, keys, token, outcome, status, backend_status, duration_us, .. } = line;
    // Whole microseconds over 1000: the nearest double to a three-decimal number, which a
    // subscriber prints with no more decimals than that.
    let duration_ms = duration_us as f64 / 1000.0;
    tracing::info!(target: "fencegate::access", method = %method, path = %path, keys = %keys, token,
        outcome = %outcome, status, backend_status, duration_ms, "request");
}

#[cfg(test)]
#[path = "access_tests.rs"]
mod tests;
