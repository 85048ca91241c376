//! An open-loop load generator for `benches/load.sh`: requests at a fixed rate, whatever the
//! server's latency, each one's latency measured from the moment it was due to be sent, so a
//! server that stalls is charged for every request the stall held up (no coordinated
//! omission). wrk's closed loop sends the next request only when the last answer is in, which
//! hides a stall behind the requests it never sent.
//!
//! Request `i` is due at `start + i / rate`. One thread does everything, as wrk does: an
//! `epoll` loop (mio) over the connections and a `timerfd` armed, to the nanosecond, for the
//! next request due (epoll's own timeout counts in milliseconds). Each time it wakes it takes
//! every request now due and hands each to a free connection, oldest first; a request due
//! while all connections are busy waits for one, and its latency includes the wait. Nothing
//! is sent ahead of schedule. Requests are written and responses read as raw HTTP/1.1, with
//! no allocation per request; what it costs is mostly the system time of one wake-up a
//! request, which a paced schedule cannot share between requests (docs/benchmarks.md).
//!
//! ```text
//! open_loop URL RATE SECONDS CONNS [put|get]
//! ```
//!
//! `put` sends `PUT URL/put/r{i mod 1000}` with 100 bytes and `Fencing-Token: base + i`
//! (the base from the clock, so tokens climb across runs), as `benches/load.sh`'s wrk script
//! does; `get` sends `GET URL`. It prints one line: `sent ok non2xx errors rate_achieved p50_us
//! p90_us p99_us max_us queued_us_p50 pacer_late_us_p50`. Latencies are of the 2xx answers
//! only (a fast refusal would pull them down); `errors` counts failed exchanges and requests
//! never written (still waiting when the run ended); `queued` is how long requests waited, from
//! their due time, until they were written (the loop's lateness and any wait for a free
//! connection); `pacer_late` is how late the loop itself saw each request due (its wake-up,
//! charged to every target alike).

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use mio::net::TcpStream;
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use rustix::fd::{AsRawFd, OwnedFd};
use rustix::time::{ClockId, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags, Timespec};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const TIMER: Token = Token(usize::MAX);

/// How long after the last request's due time answers still in flight are waited for.
const LAST_ANSWER_WAIT_NS: u64 = 10_000_000_000;

/// Nanoseconds on the monotonic clock, the clock the timer is armed against.
fn now_ns() -> u64 {
    let t = rustix::time::clock_gettime(ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// One connection: its stream, the request in flight on it (index, due time) and what has
/// been read of the response.
struct Conn {
    stream: Option<TcpStream>,
    in_flight: Option<(u64, u64)>,
    unwritten: Vec<u8>,
    read: Vec<u8>,
}

struct Run {
    addr: SocketAddr,
    authority: String,
    path: String,
    put: bool,
    token_base: u64,
    poll: Poll,
    conns: Vec<Conn>,
    free: Vec<usize>,
    request: Vec<u8>,
    latency: Vec<u64>,
    queued: Vec<u64>,
    ok: u64,
    non2xx: u64,
    errors: u64,
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        eprintln!("usage: open_loop URL RATE SECONDS CONNS [put|get]");
        std::process::exit(2);
    }
    let url: hyper::Uri = args[1].parse()?;
    let rate: f64 = args[2].parse()?;
    let seconds: f64 = args[3].parse()?;
    let conns: usize = args[4].parse()?;
    let put = args.get(5).is_none_or(|w| w == "put");
    let authority = url.authority().ok_or("the URL needs host:port")?.to_string();
    let addr: SocketAddr = authority.parse()?;
    let base_path = url.path().trim_end_matches('/').to_owned();
    let path = if put || !base_path.is_empty() { base_path } else { "/".to_owned() };
    let total = (rate * seconds) as u64;
    let token_base = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs() * 1_000_000;

    let poll = Poll::new()?;
    let timer =
        rustix::time::timerfd_create(TimerfdClockId::Monotonic, TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC)?;
    poll.registry().register(&mut SourceFd(&timer.as_raw_fd()), TIMER, Interest::READABLE)?;
    let mut run = Run {
        addr,
        authority,
        path,
        put,
        token_base,
        poll,
        conns: Vec::with_capacity(conns),
        free: Vec::with_capacity(conns),
        request: Vec::with_capacity(512),
        latency: Vec::with_capacity(total as usize),
        queued: Vec::with_capacity(total as usize),
        ok: 0,
        non2xx: 0,
        errors: 0,
    };
    for c in 0..conns {
        let stream = run.connect(c)?;
        run.conns.push(Conn { stream: Some(stream), in_flight: None, unwritten: Vec::new(), read: Vec::new() });
        run.free.push(c);
    }
    run.free.reverse();

    let start = now_ns() + 50_000_000;
    let interval = 1e9 / rate;
    let due = |i: u64| start + (i as f64 * interval) as u64;
    let mut late = Vec::with_capacity(total as usize);
    let mut waiting: VecDeque<(u64, u64)> = VecDeque::new();
    let mut next = 0u64;
    let mut armed = None;
    let mut events = Events::with_capacity(conns + 1);
    // A server that never answers: what is still in flight this long after the last request
    // was due counts as errors.
    let deadline = due(total) + LAST_ANSWER_WAIT_NS;
    loop {
        let in_flight = run.conns.len() - run.free.len();
        if next < total && armed != Some(next) {
            arm(&timer, due(next))?;
            armed = Some(next);
        }
        if next == total && waiting.is_empty() && in_flight == 0 {
            break;
        }
        if next == total && armed != Some(total) {
            arm(&timer, deadline)?;
            armed = Some(total);
        }
        if next == total && now_ns() >= deadline {
            run.errors += (in_flight + waiting.len()) as u64;
            break;
        }
        if let Err(e) = run.poll.poll(&mut events, None) {
            if e.kind() == ErrorKind::Interrupted {
                continue;
            }
            return Err(e.into());
        }
        for event in &events {
            if event.token() == TIMER {
                let mut expirations = [0u8; 8];
                let _ = rustix::io::read(&timer, &mut expirations);
                continue;
            }
            let c = event.token().0;
            if event.is_writable() {
                run.flush(c);
            }
            if event.is_readable() || event.is_read_closed() || event.is_error() {
                run.receive(c);
                // A close that came with the last response: its edge is spent, so the
                // connection is dropped here, not found dead by the next request.
                if event.is_read_closed() && run.conns[c].in_flight.is_none() {
                    run.close(c);
                }
            }
        }
        let now = now_ns();
        while next < total && due(next) <= now {
            late.push((now - due(next)) / 1000);
            waiting.push_back((next, due(next)));
            next += 1;
        }
        while !waiting.is_empty() {
            let Some(c) = run.free.pop() else { break };
            if let Some((i, due)) = waiting.pop_front() {
                run.send(c, i, due);
            }
        }
    }
    let elapsed = now_ns().saturating_sub(start) as f64 / 1e9;
    let sent = run.queued.len();
    run.latency.sort_unstable();
    run.queued.sort_unstable();
    late.sort_unstable();
    let q =
        |v: &[u64], p: f64| v.get(((v.len() as f64 * p) as usize).min(v.len().saturating_sub(1))).copied().unwrap_or(0);
    println!(
        "{} {} {} {} {:.0} {} {} {} {} {} {}",
        sent,
        run.ok,
        run.non2xx,
        run.errors,
        sent as f64 / elapsed,
        q(&run.latency, 0.50),
        q(&run.latency, 0.90),
        q(&run.latency, 0.99),
        run.latency.last().copied().unwrap_or(0),
        q(&run.queued, 0.50),
        q(&late, 0.50),
    );
    Ok(())
}

/// Arms the timer to fire at `at` on the monotonic clock (a time already past fires at once).
fn arm(timer: &OwnedFd, at: u64) -> Result<(), BoxError> {
    let value = Timespec { tv_sec: (at / 1_000_000_000) as i64, tv_nsec: (at % 1_000_000_000) as i64 };
    let zero = Timespec { tv_sec: 0, tv_nsec: 0 };
    rustix::time::timerfd_settime(
        timer,
        TimerfdTimerFlags::ABSTIME,
        &Itimerspec { it_interval: zero, it_value: value },
    )?;
    Ok(())
}

impl Run {
    /// Connects connection `c`. Blocking: on loopback a connect takes microseconds, and the
    /// wait is charged to the requests behind it (in `queued` and `pacer_late`).
    fn connect(&self, c: usize) -> Result<TcpStream, BoxError> {
        let std = std::net::TcpStream::connect(self.addr)?;
        std.set_nodelay(true)?;
        std.set_nonblocking(true)?;
        let mut stream = TcpStream::from_std(std);
        self.poll.registry().register(&mut stream, Token(c), Interest::READABLE | Interest::WRITABLE)?;
        Ok(stream)
    }

    /// Writes request `i` on connection `c`, reconnecting first if the server closed it.
    fn send(&mut self, c: usize, i: u64, due: u64) {
        if self.conns[c].stream.is_none() {
            match self.connect(c) {
                Ok(stream) => self.conns[c].stream = Some(stream),
                Err(_) => {
                    self.errors += 1;
                    self.queued.push((now_ns().saturating_sub(due)) / 1000);
                    self.free.push(c);
                    return;
                }
            }
        }
        self.request.clear();
        if self.put {
            let _ = write!(
                self.request,
                "PUT {}/put/r{} HTTP/1.1\r\nHost: {}\r\nFencing-Token: {}\r\nContent-Length: 100\r\n\r\n",
                self.path,
                i % 1000,
                self.authority,
                self.token_base + i
            );
            self.request.extend_from_slice(&[b'v'; 100]);
        } else {
            let _ = write!(self.request, "GET {} HTTP/1.1\r\nHost: {}\r\n\r\n", self.path, self.authority);
        }
        self.queued.push((now_ns().saturating_sub(due)) / 1000);
        let conn = &mut self.conns[c];
        conn.in_flight = Some((i, due));
        conn.unwritten.clear();
        conn.unwritten.extend_from_slice(&self.request);
        self.flush(c);
    }

    /// Writes what the socket takes of connection `c`'s request; the rest waits for the next
    /// writable event.
    fn flush(&mut self, c: usize) {
        let conn = &mut self.conns[c];
        let Some(stream) = conn.stream.as_mut() else { return };
        while !conn.unwritten.is_empty() {
            match stream.write(&conn.unwritten) {
                Ok(n) => {
                    conn.unwritten.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return self.fail(c),
            }
        }
    }

    /// Reads what connection `c` has; a complete response frees the connection.
    fn receive(&mut self, c: usize) {
        let mut buf = [0u8; 16 * 1024];
        loop {
            let conn = &mut self.conns[c];
            let Some(stream) = conn.stream.as_mut() else { return };
            match stream.read(&mut buf) {
                Ok(0) => return self.fail(c),
                Ok(n) => conn.read.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return self.fail(c),
            }
            match parse(&conn.read) {
                Parsed::Partial => continue,
                Parsed::Invalid => return self.fail(c),
                // An interim answer (100 Continue, 103): the final one follows.
                Parsed::Interim { length } => {
                    conn.read.drain(..length);
                    continue;
                }
                Parsed::Complete { status, length, mut close } => {
                    conn.read.drain(..length);
                    // Answered before the whole request was written: what is left of it
                    // must not reach the server as the start of the next one.
                    close |= !conn.unwritten.is_empty();
                    if let Some((_, due)) = conn.in_flight.take() {
                        if (200..300).contains(&status) {
                            self.ok += 1;
                            self.latency.push((now_ns().saturating_sub(due)) / 1000);
                        } else {
                            self.non2xx += 1;
                        }
                        self.free.push(c);
                    }
                    if close {
                        self.close(c);
                    }
                    // Nothing more comes until the next request: the read stops here, and
                    // the next response's bytes raise a new edge.
                    if conn_idle(&self.conns[c]) {
                        return;
                    }
                }
            }
        }
    }

    /// The connection failed: the request in flight on it is an error, and the next request
    /// on it reconnects.
    fn fail(&mut self, c: usize) {
        if self.conns[c].in_flight.take().is_some() {
            self.errors += 1;
            self.free.push(c);
        }
        self.close(c);
    }

    fn close(&mut self, c: usize) {
        let conn = &mut self.conns[c];
        if let Some(mut stream) = conn.stream.take() {
            let _ = self.poll.registry().deregister(&mut stream);
        }
        conn.read.clear();
        conn.unwritten.clear();
    }
}

fn conn_idle(conn: &Conn) -> bool {
    conn.in_flight.is_none() && conn.read.is_empty()
}

/// What the bytes read so far hold of one response.
enum Parsed {
    Partial,
    Invalid,
    /// An interim (1xx) response of this many bytes, before the final one.
    Interim {
        length: usize,
    },
    /// A whole response: its status, its length in bytes, and whether the server closes.
    Complete {
        status: u16,
        length: usize,
        close: bool,
    },
}

fn find(haystack: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    haystack.get(from..)?.windows(needle.len()).position(|w| w == needle).map(|p| p + from)
}

/// Parses one HTTP/1.1 response: the status line, the headers that frame the body
/// (`Content-Length`, chunked `Transfer-Encoding`) and `Connection: close`.
fn parse(buf: &[u8]) -> Parsed {
    let Some(head_end) = find(buf, b"\r\n\r\n", 0) else {
        return if buf.len() > 64 * 1024 { Parsed::Invalid } else { Parsed::Partial };
    };
    let mut lines = buf[..head_end].split(|&b| b == b'\n');
    let status = match lines.next().and_then(|l| l.get(9..12)).and_then(|s| std::str::from_utf8(s).ok()) {
        Some(s) => match s.parse::<u16>() {
            Ok(status) => status,
            Err(_) => return Parsed::Invalid,
        },
        None => return Parsed::Invalid,
    };
    let (mut content_length, mut chunked, mut close) = (None, false, false);
    for line in lines {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|&b| b == b':') else { continue };
        let (name, value) = (&line[..colon], line[colon + 1..].trim_ascii());
        if name.eq_ignore_ascii_case(b"content-length") {
            content_length = std::str::from_utf8(value).ok().and_then(|v| v.parse::<usize>().ok());
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            chunked = value.to_ascii_lowercase().windows(7).any(|w| w == b"chunked");
        } else if name.eq_ignore_ascii_case(b"connection") {
            close = value.to_ascii_lowercase().windows(5).any(|w| w == b"close");
        }
    }
    let body = head_end + 4;
    if (100..200).contains(&status) && status != 101 {
        return Parsed::Interim { length: body };
    }
    // Switching protocols: this generator speaks only HTTP/1.1, so the connection is done.
    if status == 101 {
        return Parsed::Complete { status, length: body, close: true };
    }
    if status == 204 || status == 304 {
        return Parsed::Complete { status, length: body, close };
    }
    if chunked {
        let mut at = body;
        loop {
            let Some(line_end) = find(buf, b"\r\n", at) else { return Parsed::Partial };
            let size_field = buf[at..line_end].split(|&b| b == b';').next().unwrap_or_default();
            let Some(size) =
                std::str::from_utf8(size_field).ok().and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
            else {
                return Parsed::Invalid;
            };
            at = line_end + 2;
            if size == 0 {
                // Trailers, if any, end with an empty line.
                if buf.get(at..at + 2) == Some(b"\r\n") {
                    return Parsed::Complete { status, length: at + 2, close };
                }
                return match find(buf, b"\r\n\r\n", at) {
                    Some(end) => Parsed::Complete { status, length: end + 4, close },
                    None => Parsed::Partial,
                };
            }
            let Some(next) = at.checked_add(size).and_then(|n| n.checked_add(2)) else { return Parsed::Invalid };
            at = next;
            if at > buf.len() {
                return Parsed::Partial;
            }
        }
    }
    match content_length.map(|n| body.checked_add(n)) {
        Some(None) => Parsed::Invalid,
        Some(Some(end)) if buf.len() >= end => Parsed::Complete { status, length: end, close },
        Some(Some(_)) => Parsed::Partial,
        // No framing: the body runs to the close, which this generator does not wait for.
        None => Parsed::Complete { status, length: buf.len(), close: true },
    }
}
