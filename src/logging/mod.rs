//! Logs to stderr, as text or JSON lines, at a level a reload can change.
//!
//! Lines are handed to a thread of their own through a bounded queue (`log.buffer_lines`):
//! writing to stderr blocks when whatever reads it falls behind (a full pipe, a stalled
//! journal), and a thread that serves requests must never wait for that. When the queue is
//! full a line is dropped and counted ([`dropped_lines`], `/metrics`). Access lines are
//! formatted on a thread of their own too ([`access`]), in the layout each asks for
//! ([`layout`]).

pub(crate) mod access;
mod layout;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tracing_appender::non_blocking::{ErrorCounter, NonBlockingBuilder, WorkerGuard};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::prelude::*;
use tracing_subscriber::{Registry, fmt, reload};

use crate::config::LogFormat;

/// The level filter of the installed subscriber; unset when the library runs without one (tests).
static LEVEL: OnceLock<reload::Handle<LevelFilter, Registry>> = OnceLock::new();

/// Counts the lines the installed subscriber dropped.
static DROPPED: OnceLock<ErrorCounter> = OnceLock::new();

/// The installed subscriber's queue of access lines.
static ACCESS: OnceLock<Arc<access::Queue>> = OnceLock::new();

/// Keeps the log's writer threads; dropping it writes out the lines still queued, access lines
/// first, waiting for each at most about a second if stderr blocks.
#[derive(Debug)]
#[must_use = "lines still queued are lost unless this lives until the process ends"]
pub struct Flush {
    access: Option<std::thread::JoinHandle<()>>,
    _writer: Option<WorkerGuard>,
}

/// Longest an exit waits for the access thread to write out its queue: a stderr that blocks
/// must not hold the process up for ever (the log's own queue is given about as long).
const EXIT_WAIT: Duration = Duration::from_secs(1);

impl Drop for Flush {
    fn drop(&mut self) {
        if let (Some(thread), Some(queue)) = (self.access.take(), ACCESS.get()) {
            queue.stop(thread, EXIT_WAIT);
        }
    }
}

/// Installs the process-wide subscriber, queueing at most `buffer_lines` lines for stderr, and
/// as many access lines.
/// Call once, before anything logs, and keep what it returns until the end.
pub fn init(level: &str, format: LogFormat, buffer_lines: usize) -> Flush {
    let (filter, handle) = reload::Layer::new(parse(level));
    let (writer, guard) = NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(buffer_lines)
        .thread_name("fencegate-stderr")
        .finish(std::io::stderr());
    let dropped = writer.error_counter();
    let (json, text) = match format {
        // Fields at the top level, beside time, level and message, for log tools to index.
        LogFormat::Json => (Some(fmt::layer().json().flatten_event(true).with_writer(writer)), None),
        // Colour codes only for a terminal: logs are also parsed by tools and tests.
        LogFormat::Text => {
            let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
            (None, Some(fmt::layer().with_ansi(ansi).with_writer(writer)))
        }
    };
    if tracing_subscriber::registry().with(filter).with(json).with(text).try_init().is_ok() {
        let _ = LEVEL.set(handle);
        let _ = DROPPED.set(dropped);
        let queue = Arc::new(access::Queue::new(buffer_lines));
        let thread = std::thread::Builder::new().name("fencegate-access".into()).spawn({
            let queue = Arc::clone(&queue);
            move || access::run(queue, format, std::io::stderr())
        });
        // Without its thread, access lines go through `tracing` on the serving thread.
        let access = match thread {
            Ok(thread) => {
                let _ = ACCESS.set(queue);
                Some(thread)
            }
            Err(e) => {
                tracing::warn!(error = %e, "no access-line thread: access lines are formatted by the serving threads");
                None
            }
        };
        return Flush { access, _writer: Some(guard) };
    }
    Flush { access: None, _writer: None }
}

/// Lines dropped since the process started: a queue to stderr was full (or, for access lines,
/// closed), or stderr refused access lines.
pub fn dropped_lines() -> u64 {
    DROPPED.get().map_or(0, |d| d.dropped_lines() as u64) + ACCESS.get().map_or(0, |q| q.dropped())
}

/// Whether an access line would be written: the log's level lets `info` through for it.
pub(crate) fn access_enabled() -> bool {
    tracing::enabled!(target: "fencegate::access", tracing::Level::INFO)
}

/// Writes an access line: through the access thread under the subscriber [`init`] installed,
/// through `tracing` under any other (a program embedding the library).
pub(crate) fn access(line: access::Line) {
    if let Some(queue) = ACCESS.get() {
        queue.push(line);
        return;
    }
    access::through_tracing(line);
}

/// Changes the level from `old` to `new`, calling `announce` while the more verbose of the
/// two is in force: a reload that quiets the log is still reported in it.
pub fn change_level(old: &str, new: &str, announce: impl FnOnce()) {
    let (old, new) = (parse(old), parse(new));
    set(old.max(new));
    announce();
    set(new);
}

/// Sets the level of the installed subscriber, if there is one.
fn set(level: LevelFilter) {
    if let Some(handle) = LEVEL.get()
        && let Err(e) = handle.modify(|current| *current = level)
    {
        tracing::warn!(error = %e, "cannot change the log level");
    }
}

fn parse(level: &str) -> LevelFilter {
    level.parse().unwrap_or(LevelFilter::INFO)
}
