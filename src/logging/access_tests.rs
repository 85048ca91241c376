use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::prelude::*;

use super::*;

/// A writer whose bytes a test reads back.
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Shared {
    fn lines(&self) -> Vec<String> {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap().lines().map(str::to_owned).collect()
    }
}

const AT: Duration = Duration::from_micros(1_764_694_800_123_456);

/// The time tracing-subscriber stamps an event with, fixed at `AT`.
struct Fixed;

impl FormatTime for Fixed {
    fn format_time(&self, w: &mut Writer<'_>) -> std::fmt::Result {
        write!(w, "{}", humantime::format_rfc3339_micros(SystemTime::UNIX_EPOCH + AT))
    }
}

fn line(path: &str, token: Option<u64>, backend_status: Option<u16>) -> Line {
    Line {
        at: SystemTime::UNIX_EPOCH + AT,
        method: Method::PUT,
        path: path.to_owned(),
        keys: "/a,/b/".to_owned(),
        token,
        outcome: "forwarded",
        status: 201,
        backend_status,
        duration_ms: 0.5798580000000001,
    }
}

/// The line as `tracing` writes the event `crate::logging::access` falls back to.
fn through_tracing(line: &Line, format: LogFormat) -> String {
    let out = Shared::default();
    let writer = {
        let out = out.clone();
        move || out.clone()
    };
    let layer = match format {
        LogFormat::Text => fmt_layer(writer).boxed(),
        LogFormat::Json => fmt_layer(writer).json().flatten_event(true).boxed(),
    };
    let subscriber = tracing_subscriber::registry().with(layer);
    tracing::subscriber::with_default(subscriber, || {
        let Line { method, path, keys, token, outcome, status, backend_status, duration_ms, .. } = line;
        tracing::info!(target: "fencegate::access", method = %method, path = %path, keys = %keys, token,
            outcome = %outcome, status, backend_status, duration_ms, "request");
    });
    out.lines().concat()
}

fn fmt_layer<W>(
    writer: W,
) -> tracing_subscriber::fmt::Layer<
    tracing_subscriber::Registry,
    tracing_subscriber::fmt::format::DefaultFields,
    tracing_subscriber::fmt::format::Format<tracing_subscriber::fmt::format::Full, Fixed>,
    W,
>
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + 'static,
{
    tracing_subscriber::fmt::layer().with_ansi(false).with_timer(Fixed).with_writer(writer)
}

#[test]
fn lines_read_as_the_logs_own_text_and_json_lines() {
    for l in [line("/a", Some(7), Some(201)), line(r#"/q"x\y"#, None, None), line("/é", Some(u64::MAX), None)] {
        for format in [LogFormat::Text, LogFormat::Json] {
            let mut buf = Vec::new();
            match format {
                LogFormat::Text => text(&l, &mut buf),
                LogFormat::Json => json(&l, &mut buf),
            }
            let ours = String::from_utf8(buf).unwrap();
            assert_eq!(ours.trim_end_matches('\n'), through_tracing(&l, format), "{format:?}");
            assert!(ours.ends_with('\n') && ours.matches('\n').count() == 1, "one line: {ours}");
        }
    }
}

/// Polls `done` until it holds; fails after a generous while.
fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn the_thread_writes_every_line_sleeps_when_none_come_and_drains_on_close() {
    let queue = Arc::new(Queue::new(1024));
    let out = Shared::default();
    let thread = std::thread::spawn({
        let (queue, out) = (Arc::clone(&queue), out.clone());
        move || run(queue, LogFormat::Text, out)
    });
    for i in 0..3 {
        queue.push(line(&format!("/{i}"), Some(i), None));
    }
    until("three lines are written", || out.lines().len() == 3);
    until("the thread sleeps with no deadline", || queue.lock().asleep);
    queue.push(line("/woken", Some(9), None));
    until("the line that woke it is written", || out.lines().len() == 4);
    queue.push(line("/last", Some(10), None));
    queue.close();
    thread.join().unwrap();
    let lines = out.lines();
    assert_eq!(lines.len(), 5, "{lines:#?}");
    for (i, path) in ["/0", "/1", "/2", "/woken", "/last"].iter().enumerate() {
        assert!(lines[i].contains(&format!(" path={path} ")), "{}", lines[i]);
    }
    assert_eq!(queue.dropped(), 0);
}

#[test]
fn a_full_queue_drops_and_counts_and_a_half_full_one_urges_the_thread() {
    let queue = Queue::new(4);
    queue.push(line("/1", None, None));
    assert!(!queue.lock().urged);
    queue.push(line("/2", None, None));
    assert!(queue.lock().urged, "half full");
    queue.push(line("/3", None, None));
    queue.push(line("/4", None, None));
    queue.push(line("/5", None, None));
    assert_eq!((queue.lock().lines.len(), queue.dropped()), (4, 1));
    let mut taken = Vec::new();
    assert!(queue.take(&mut taken), "urged: taken at once");
    assert_eq!(taken.len(), 4);
    assert!(!queue.lock().urged);
    queue.close();
    taken.clear();
    assert!(!queue.take(&mut taken), "closed and empty");
}
