//! Raw HTTP/1.1 over loopback TCP, for what a client library would fix or hide: request
//! targets and header layouts as written, half-sent requests, readers that stall, several
//! requests on one connection, and when the server closes it.

use std::net::SocketAddr;
use std::time::Duration;

use http::HeaderMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::Resp;
use super::wait::DEADLINE;

/// Writes `head` (request line and headers, without the blank line) plus `body` on a fresh
/// connection, with `Content-Length` and `Connection: close` added, and reads the whole
/// response.
pub async fn raw_request(addr: SocketAddr, head: &str, body: &str) -> Resp {
    try_raw_request(addr, head, body).await.expect("a complete response")
}

/// Like [`raw_request`], but `None` when the connection fails or ends without a response
/// (the proxy was killed).
pub async fn try_raw_request(addr: SocketAddr, head: &str, body: &str) -> Option<Resp> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let request = format!("{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut raw = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut raw)).await.ok()?.ok()?;
    parse_response(&raw)
}

/// A fenced PUT of `v` with `token`; 0 when no response came back (the proxy died).
pub async fn put(addr: SocketAddr, path: &str, token: u64) -> u16 {
    put_response(addr, path, token).await.map_or(0, |r| r.status)
}

/// A fenced PUT of `v` with `token`; `None` when no response came back (the proxy died).
pub async fn put_response(addr: SocketAddr, path: &str, token: u64) -> Option<Resp> {
    let head = format!("PUT {path} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}");
    try_raw_request(addr, &head, "v").await
}

/// An address on which nothing listens (bound, then released).
pub async fn dead_address() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

/// One client connection, written and read exactly as the test says. Every read gives up
/// (panics) after [`DEADLINE`] unless it says otherwise.
pub struct RawConn {
    stream: TcpStream,
    /// Read from the socket but not yet handed out.
    pending: Vec<u8>,
}

impl RawConn {
    pub async fn open(addr: SocketAddr) -> RawConn {
        let stream = TcpStream::connect(addr).await.unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
        RawConn { stream, pending: Vec::new() }
    }

    /// Like [`RawConn::open`], but `None` when nothing listens (a killed proxy).
    pub async fn try_open(addr: SocketAddr) -> Option<RawConn> {
        Some(RawConn { stream: TcpStream::connect(addr).await.ok()?, pending: Vec::new() })
    }

    /// Like [`RawConn::send`], but `false` when the connection broke.
    pub async fn try_send(&mut self, bytes: impl AsRef<[u8]>) -> bool {
        self.stream.write_all(bytes.as_ref()).await.is_ok()
    }

    /// The next complete response, or `None` when the connection breaks or ends before one
    /// (a proxy killed, stopped for good, or cutting a write off). No deadline of its own.
    pub async fn try_read_response(&mut self) -> Option<Resp> {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            if let Some(len) = response_len(&self.pending, false) {
                let raw: Vec<u8> = self.pending.drain(..len).collect();
                return parse_response(&raw);
            }
            let n = self.stream.read(&mut buf).await.ok()?;
            if n == 0 {
                let len = response_len(&self.pending, true)?;
                let raw: Vec<u8> = self.pending.drain(..len).collect();
                return parse_response(&raw);
            }
            self.pending.extend_from_slice(&buf[..n]);
        }
    }

    /// Writes `bytes` as they are.
    pub async fn send(&mut self, bytes: impl AsRef<[u8]>) {
        self.stream.write_all(bytes.as_ref()).await.expect("write to the server");
    }

    /// Whatever has arrived, up to `buf.len()` bytes; 0 once the server closed the connection.
    pub async fn read_some(&mut self, buf: &mut [u8]) -> usize {
        self.read_some_within(DEADLINE, buf).await.unwrap_or_else(|| panic!("nothing to read within {DEADLINE:?}"))
    }

    /// Like [`RawConn::read_some`], but `None` when nothing arrives within `window`.
    pub async fn read_some_within(&mut self, window: Duration, buf: &mut [u8]) -> Option<usize> {
        if !self.pending.is_empty() {
            let n = self.pending.len().min(buf.len());
            buf[..n].copy_from_slice(&self.pending[..n]);
            self.pending.drain(..n);
            return Some(n);
        }
        match tokio::time::timeout(window, self.stream.read(buf)).await {
            Ok(read) => Some(read.expect("read from the server")),
            Err(_) => None,
        }
    }

    /// Everything up to the end of the connection, which the server must close within
    /// `limit`.
    pub async fn read_to_end_within(&mut self, limit: Duration) -> Vec<u8> {
        let mut all = std::mem::take(&mut self.pending);
        tokio::time::timeout(limit, self.stream.read_to_end(&mut all))
            .await
            .unwrap_or_else(|_| panic!("the server did not close the connection within {limit:?}"))
            .expect("read from the server");
        all
    }

    /// Everything up to the end of the connection, which the server must close within
    /// [`DEADLINE`].
    pub async fn read_to_end(&mut self) -> Vec<u8> {
        self.read_to_end_within(DEADLINE).await
    }

    /// The next complete response (framed by `Content-Length`, chunked, or by the end of the
    /// connection); what follows it stays for the next read.
    pub async fn read_response(&mut self) -> Resp {
        let read = async {
            let mut buf = vec![0u8; 64 << 10];
            loop {
                if let Some(len) = response_len(&self.pending, false) {
                    return self.pending.drain(..len).collect::<Vec<u8>>();
                }
                let n = self.stream.read(&mut buf).await.expect("read from the server");
                if n == 0 {
                    let len = response_len(&self.pending, true).unwrap_or_else(|| {
                        panic!("the connection ended inside a response: {:?}", String::from_utf8_lossy(&self.pending))
                    });
                    return self.pending.drain(..len).collect();
                }
                self.pending.extend_from_slice(&buf[..n]);
            }
        };
        let raw =
            tokio::time::timeout(DEADLINE, read).await.unwrap_or_else(|_| panic!("no response within {DEADLINE:?}"));
        parse_response(&raw).expect("a well-formed response")
    }
}

/// The length of the first response in `raw` once it is complete. Without `Content-Length`
/// or chunked framing, a body runs to the end of the connection: complete only `at_eof`.
pub(super) fn response_len(raw: &[u8], at_eof: bool) -> Option<usize> {
    let head_end = raw.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&raw[..head_end]).ok()?.to_ascii_lowercase();
    let status: u16 = head.split(' ').nth(1)?.parse().ok()?;
    let header = |name: &str| {
        head.split("\r\n").find_map(|l| l.split_once(':').filter(|(k, _)| k.trim() == name).map(|(_, v)| v.trim()))
    };
    if (100..200).contains(&status) || status == 204 || status == 304 {
        Some(head_end)
    } else if header("transfer-encoding").is_some_and(|v| v.ends_with("chunked")) {
        Some(head_end + chunked_len(&raw[head_end..])?)
    } else if let Some(len) = header("content-length") {
        let end = head_end + len.parse::<usize>().ok()?;
        (raw.len() >= end).then_some(end)
    } else {
        at_eof.then_some(raw.len())
    }
}

/// The length of a complete chunked body (no trailers) at the start of `b`.
pub(super) fn chunked_len(b: &[u8]) -> Option<usize> {
    let mut at = 0;
    loop {
        let line_end = at + b[at..].windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(std::str::from_utf8(&b[at..line_end]).ok()?.trim(), 16).ok()?;
        at = line_end + 2 + size + 2;
        if b.len() < at {
            return None;
        }
        if size == 0 {
            return Some(at);
        }
    }
}

/// Parses one whole response: status line, headers, and the body (de-chunked).
pub fn parse_response(raw: &[u8]) -> Option<Resp> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).unwrap();
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let mut headers = HeaderMap::new();
    for line in lines {
        let (k, v) = line.split_once(':').unwrap();
        headers.append(http::HeaderName::from_bytes(k.trim().as_bytes()).unwrap(), v.trim().parse().unwrap());
    }
    let mut body = raw[split + 4..].to_vec();
    if headers.get("transfer-encoding").is_some_and(|v| v == "chunked") {
        body = dechunk(&body)?;
    }
    Some(Resp { status, headers, body: body.into() })
}

fn dechunk(mut b: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = b.windows(2).position(|w| w == b"\r\n")?;
        let size = usize::from_str_radix(std::str::from_utf8(&b[..line_end]).ok()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(b.get(line_end + 2..line_end + 2 + size)?);
        b = b.get(line_end + 2 + size + 2..)?;
    }
}

/// Sends fenced PUTs with token 5 to `path_of(n)` for n = 0, 1, … until the same write is refused
/// twice in a row with `503 store_full` (the first refused batch also carried the previous
/// write's answer record, which its retry does not; equal path lengths make every advance
/// record the same size, so from then on none fits). Returns the acknowledged paths and the
/// refused one. Every refusal must carry `Retry-After`; panics if `most` writes all fit.
pub async fn fill_until_store_full(
    addr: SocketAddr,
    path_of: impl Fn(usize) -> String,
    most: usize,
) -> (Vec<String>, String) {
    let mut acked = Vec::new();
    let mut refused: Option<String> = None;
    loop {
        let path = path_of(acked.len());
        let r = put_response(addr, &path, 5).await.unwrap();
        if r.status == 200 {
            acked.push(path);
            assert!(acked.len() < most, "no refusal within {most} writes: the store never ran out of room");
            continue;
        }
        r.assert_refused(503, "store_full");
        assert!(r.headers.contains_key("retry-after"), "{:?}", r.headers);
        if refused.as_ref() == Some(&path) {
            return (acked, path);
        }
        refused = Some(path);
    }
}
