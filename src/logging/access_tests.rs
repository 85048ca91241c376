use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

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

/// The test writers hold nothing else to lock.
macro_rules! sink {
    ($($writer:ty),*) => {$(
        impl Sink for $writer {
            fn locked(&mut self, write: &mut dyn FnMut(&mut dyn Write)) {
                write(self);
            }
        }
    )*};
}
sink!(Shared, Refusing, Stalled);

impl Shared {
    fn lines(&self) -> Vec<String> {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap().lines().map(str::to_owned).collect()
    }
}

const AT: Duration = Duration::from_micros(1_764_694_800_123_456);

fn line(path: &str, token: Option<u64>, backend_status: Option<u16>) -> Line {
    Line {
        at: SystemTime::UNIX_EPOCH + AT,
        method: Method::PUT,
        path: path.to_owned(),
        keys: "/a,/b/".to_owned(),
        token,
        outcome: "forwarded",
        status: Some(201),
        backend_status,
        duration_us: 579,
        layout: AccessFormat::Log,
        combined: None,
    }
}

/// The line as `tracing` writes it (`through_tracing`) under the log's own text or JSON layer.
fn from_tracing(line: Line, format: LogFormat) -> String {
    let out = Shared::default();
    let writer = {
        let out = out.clone();
        move || out.clone()
    };
    let layer = tracing_subscriber::fmt::layer().with_ansi(false).with_writer(writer);
    let layer = match format {
        LogFormat::Text => layer.boxed(),
        LogFormat::Json => layer.json().flatten_event(true).boxed(),
    };
    tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || through_tracing(line));
    out.lines().concat()
}

/// A line's timestamp and the rest of it.
fn split_time(line: &str, format: LogFormat) -> (&str, String) {
    let at = match format {
        LogFormat::Text => 0,
        LogFormat::Json => r#"{"timestamp":""#.len(),
    };
    let time = &line[at..at + 27];
    (time, format!("{}{}", &line[..at], &line[at + 27..]))
}

#[test]
fn lines_read_as_the_logs_own_text_and_json_lines() {
    // An exchange Envoy carried on unchecked: no status, and the field left out as tracing does.
    let passed = || Line { status: None, outcome: "passed", ..line("/p", None, None) };
    let cases =
        [line("/a", Some(7), Some(201)), line(r#"/q"x\y"#, None, None), line("/é", Some(u64::MAX), None), passed()];
    for l in cases {
        for format in [LogFormat::Text, LogFormat::Json] {
            let mut buf = Vec::new();
            match format {
                LogFormat::Text => text(&l, &mut buf),
                LogFormat::Json => json(&l, &mut buf),
            }
            let ours = String::from_utf8(buf).unwrap();
            assert!(ours.ends_with('\n') && ours.matches('\n').count() == 1, "one line: {ours}");
            let again = Line { status: l.status, outcome: l.outcome, ..line(&l.path, l.token, l.backend_status) };
            let theirs = from_tracing(again, format);
            let ((our_time, ours), (their_time, theirs)) = (split_time(&ours, format), split_time(&theirs, format));
            assert_eq!(ours.trim_end_matches('\n'), theirs, "{format:?}");
            assert_eq!(our_time, "2025-12-02T17:00:00.123456Z");
            assert!(their_time.ends_with('Z') && humantime::parse_rfc3339(their_time).is_ok(), "{their_time}");
        }
    }
}

#[test]
fn a_clock_outside_the_years_a_timestamp_shows_is_shown_at_their_edge() {
    let before = SystemTime::UNIX_EPOCH - Duration::from_secs(1);
    assert_eq!(timestamp(before).to_string(), "1970-01-01T00:00:00.000000Z");
    let after = SystemTime::UNIX_EPOCH + LATEST + Duration::from_secs(86_400 * 365);
    assert_eq!(timestamp(after).to_string(), "9999-12-31T23:59:59.999999Z");
    for at in [before, after] {
        let (mut t, mut j) = (Vec::new(), Vec::new());
        text(&Line { at, ..line("/a", None, None) }, &mut t);
        json(&Line { at, ..line("/a", None, None) }, &mut j);
        let (t, j) = (String::from_utf8(t).unwrap(), String::from_utf8(j).unwrap());
        assert!(t.starts_with(&timestamp(at).to_string()) && j.contains(&timestamp(at).to_string()), "{t}{j}");
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

/// A queue of `capacity` lines, its thread running and writing to what it returns.
fn started(capacity: usize, format: LogFormat) -> (Arc<Queue>, Shared, std::thread::JoinHandle<()>) {
    let (queue, out) = (Arc::new(Queue::new(capacity)), Shared::default());
    let thread = std::thread::spawn({
        let (queue, out) = (Arc::clone(&queue), out.clone());
        move || run(queue, format, out)
    });
    (queue, out, thread)
}

#[test]
fn the_thread_writes_every_line_sleeps_when_none_come_and_drains_on_close() {
    let (queue, out, thread) = started(1024, LogFormat::Text);
    for i in 0..3 {
        queue.push(line(&format!("/{i}"), Some(i), None));
    }
    until("three lines are written", || out.lines().len() == 3);
    until("the thread sleeps with no deadline", || queue.lock().asleep);
    queue.push(line("/woken", Some(9), None));
    until("the line that woke it is written", || out.lines().len() == 4);
    // More than one write's worth, then a close with them queued.
    let many = 2 * CHUNK / 150;
    for i in 0..many {
        queue.push(line(&format!("/many/{i}"), Some(i as u64), None));
    }
    queue.close();
    thread.join().unwrap();
    let lines = out.lines();
    assert_eq!(lines.len(), 4 + many, "every line, each whole");
    for (i, path) in ["/0", "/1", "/2", "/woken"].iter().enumerate() {
        assert!(lines[i].contains(&format!(" path={path} ")), "{}", lines[i]);
    }
    for (i, l) in lines[4..].iter().enumerate() {
        assert!(l.contains(&format!(" path=/many/{i} ")) && l.ends_with(" duration_ms=0.579"), "{l}");
    }
    assert_eq!(queue.dropped(), 0);
}

#[test]
fn a_close_wakes_a_sleeping_thread_and_later_lines_are_dropped_and_counted() {
    let (queue, out, thread) = started(16, LogFormat::Json);
    until("the thread sleeps with no deadline", || queue.lock().asleep);
    queue.close();
    thread.join().unwrap();
    queue.push(line("/late", None, None));
    assert_eq!((out.lines().len(), queue.dropped()), (0, 1));
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
    let never = Instant::now() + Duration::from_secs(3600);
    assert!(queue.take(&mut taken, never), "urged: taken at once");
    assert_eq!(taken.len(), 4);
    assert!(!queue.lock().urged);
    queue.close();
    taken.clear();
    assert!(!queue.take(&mut taken, never), "closed and empty");
}

/// A stderr that takes `left` more bytes, then fails with `then`, once if `once`.
struct Refusing {
    out: Shared,
    left: usize,
    then: std::io::ErrorKind,
    once: bool,
    writes: Vec<usize>,
}

impl Refusing {
    fn new(left: usize, then: std::io::ErrorKind, once: bool) -> Refusing {
        Refusing { out: Shared::default(), left, then, once, writes: Vec::new() }
    }
}

impl Write for Refusing {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            if self.once {
                self.left = usize::MAX;
            }
            return Err(self.then.into());
        }
        let n = buf.len().min(self.left);
        self.left -= n;
        self.writes.push(n);
        self.out.write(&buf[..n])
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn chunks<S: Sink>(out: S, dropped: &AtomicU64) -> Chunks<'_, S> {
    Chunks { out, buf: Vec::new(), torn: false, dropped }
}

#[test]
fn lines_stderr_refuses_are_counted_and_the_next_write_starts_on_a_new_line() {
    let dropped = AtomicU64::new(0);
    let mut c = chunks(Refusing::new(10, std::io::ErrorKind::BrokenPipe, false), &dropped);
    c.push(b"0123456789abcdef\n");
    c.push(b"second\n");
    c.write();
    assert_eq!(dropped.load(Ordering::Relaxed), 2, "the torn line and the one after it");
    c.out.left = usize::MAX; // stderr takes bytes again
    c.push(b"third\n");
    c.write();
    assert_eq!(c.out.out.lines(), ["0123456789", "third"]);
    assert_eq!(dropped.load(Ordering::Relaxed), 2);
}

#[test]
fn a_torn_line_then_a_write_refused_whole_counts_each_line_once_and_ends_the_torn_line_later() {
    let dropped = AtomicU64::new(0);
    let mut c = chunks(Refusing::new(4, std::io::ErrorKind::BrokenPipe, false), &dropped);
    c.push(b"first\n");
    c.write(); // "firs" out: one line lost, the output mid-line
    c.push(b"second\n");
    c.write(); // nothing out
    assert_eq!(dropped.load(Ordering::Relaxed), 2);
    c.out.left = usize::MAX;
    c.push(b"third\n");
    c.write();
    assert_eq!(c.out.out.lines(), ["firs", "third"]);
    assert_eq!(dropped.load(Ordering::Relaxed), 2);
}

#[test]
fn a_write_after_a_torn_line_stays_within_a_chunk() {
    let dropped = AtomicU64::new(0);
    let mut c = chunks(Refusing::new(3, std::io::ErrorKind::BrokenPipe, false), &dropped);
    c.push(b"torn\n");
    c.write();
    c.out.left = usize::MAX;
    let line = [b'z'; CHUNK / 2 - 1].iter().chain(b"\n").copied().collect::<Vec<u8>>();
    c.push(&line);
    c.push(&line);
    c.write();
    assert!(c.out.writes[1..].iter().all(|&n| n <= CHUNK), "{:?}", c.out.writes);
    assert_eq!(c.out.out.lines().len(), 3);
}

#[test]
fn a_stderr_that_would_block_is_waited_for_and_gets_every_line_whole() {
    let dropped = AtomicU64::new(0);
    let mut c = chunks(Refusing::new(5, std::io::ErrorKind::WouldBlock, true), &dropped);
    c.push(b"first line\n");
    c.push(b"second line\n");
    c.write();
    assert_eq!(c.out.out.lines(), ["first line", "second line"]);
    assert_eq!(dropped.load(Ordering::Relaxed), 0);
}

#[test]
fn writes_hold_whole_lines_and_at_most_a_chunk_unless_one_line_is_longer() {
    let dropped = AtomicU64::new(0);
    let mut c = chunks(Refusing::new(usize::MAX, std::io::ErrorKind::Other, false), &dropped);
    let short = [b'x'; 99].iter().chain(b"\n").copied().collect::<Vec<u8>>();
    let long = [b'y'; 2 * CHUNK].iter().chain(b"\n").copied().collect::<Vec<u8>>();
    for _ in 0..100 {
        c.push(&short);
    }
    c.push(&long);
    c.push(&short);
    c.write();
    let sizes = &c.out.writes;
    assert_eq!(sizes.iter().sum::<usize>(), 101 * 100 + long.len());
    assert!(sizes.contains(&long.len()), "the long line alone: {sizes:?}");
    assert!(
        sizes.iter().all(|&n| n <= CHUNK || n == long.len()) && sizes.iter().all(|&n| n % 100 == 0 || n == long.len())
    );
    assert_eq!(c.out.out.lines().len(), 102);
}

/// A stderr whose writes block until `release`.
#[derive(Clone, Default)]
struct Stalled(Arc<(Mutex<(bool, bool)>, std::sync::Condvar)>);

impl Stalled {
    fn entered(&self) -> bool {
        self.0.0.lock().unwrap().0
    }
    fn release(&self) {
        self.0.0.lock().unwrap().1 = true;
        self.0.1.notify_all();
    }
}

impl Write for Stalled {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut state = self.0.0.lock().unwrap();
        state.0 = true;
        drop(self.0.1.wait_while(state, |s| !s.1).unwrap());
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_stop_leaves_a_thread_stuck_on_stderr_behind_and_joins_one_that_ends() {
    let queue = Arc::new(Queue::new(16));
    let stderr = Stalled::default();
    let thread = std::thread::spawn({
        let (queue, stderr) = (Arc::clone(&queue), stderr.clone());
        move || run(queue, LogFormat::Text, stderr)
    });
    queue.push(line("/a", None, None));
    until("the thread is stuck in its write", || stderr.entered());
    assert!(!queue.stop(thread, Duration::from_millis(100)), "the thread cannot end while its write blocks");
    stderr.release();
    assert!(queue.wait_ended(Duration::from_secs(10)), "released, it ends");

    let (queue, out, thread) = started(16, LogFormat::Text);
    queue.push(line("/b", None, None));
    assert!(queue.stop(thread, Duration::from_secs(10)));
    assert_eq!(out.lines().len(), 1);
}
