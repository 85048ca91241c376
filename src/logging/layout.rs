//! How an access line reads (`log.access_format`): in the layout of the log's other lines
//! (text, never coloured, or JSON), or in nginx's and Apache's `combined` format, alone or
//! followed by the fence's outcome, the token and the duration (`combined_fencegate`).
//!
//! Durations are counted in whole microseconds and printed as milliseconds with exactly three
//! decimals (`duration_ms=0.157`), in every layout: no float rounding shows.

use std::io::Write;
use std::time::{Duration, SystemTime};

use super::access::Line;
use crate::config::{AccessFormat, LogFormat};

/// The latest timestamp a line can show: 9999-12-31T23:59:59.999999Z.
pub(super) const LATEST: Duration = Duration::from_micros(253_402_300_799_999_999);

/// Month names as `$time_local` writes them.
const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];

/// Appends `line` to `buf` in the layout it asks for, `log` standing for the log's format.
pub(super) fn write(line: &Line, log: LogFormat, buf: &mut Vec<u8>) {
    match (line.layout, log) {
        (AccessFormat::Log, LogFormat::Text) => text(line, buf),
        (AccessFormat::Log, LogFormat::Json) => json(line, buf),
        (AccessFormat::Combined, _) => {
            combined(line, buf);
            buf.push(b'\n');
        }
        (AccessFormat::CombinedFencegate, _) => {
            combined(line, buf);
            let _ = write!(buf, " outcome={} token=", line.outcome);
            match line.token {
                Some(token) => {
                    let _ = write!(buf, "{token}");
                }
                None => buf.push(b'-'),
            }
            let _ = writeln!(buf, " duration_ms={}", Millis(line.duration_us));
        }
    }
}

/// Microseconds shown as milliseconds with three decimals.
pub(super) struct Millis(pub(super) u64);

impl std::fmt::Display for Millis {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{:03}", self.0 / 1000, self.0 % 1000)
    }
}

/// `at` as the log stamps its lines (RFC 3339, microseconds, UTC), within the years it can
/// show: a clock set before 1970 shows 1970.
pub(super) fn timestamp(at: SystemTime) -> humantime::Rfc3339Timestamp {
    humantime::format_rfc3339_micros(within_years(at))
}

fn within_years(at: SystemTime) -> SystemTime {
    let since = at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().min(LATEST);
    SystemTime::UNIX_EPOCH + since
}

/// The line as the log's text format writes an event, uncoloured: timestamp, level, target,
/// message, then `name=value` fields, an absent value leaving its field out.
pub(super) fn text(line: &Line, buf: &mut Vec<u8>) {
    let _ = write!(
        buf,
        "{}  INFO fencegate::access: request method={} path={} keys={}",
        timestamp(line.at),
        line.method,
        line.path,
        line.keys
    );
    if let Some(token) = line.token {
        let _ = write!(buf, " token={token}");
    }
    let _ = write!(buf, " outcome={}", line.outcome);
    if let Some(status) = line.status {
        let _ = write!(buf, " status={status}");
    }
    if let Some(status) = line.backend_status {
        let _ = write!(buf, " backend_status={status}");
    }
    let _ = writeln!(buf, " duration_ms={}", Millis(line.duration_us));
}

/// The line as the log's JSON format writes an event: one object, the fields at its top level.
pub(super) fn json(line: &Line, buf: &mut Vec<u8>) {
    let _ = write!(buf, r#"{{"timestamp":"{}","level":"INFO","message":"request","method":"#, timestamp(line.at));
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
    if let Some(status) = line.status {
        let _ = write!(buf, r#","status":{status}"#);
    }
    if let Some(status) = line.backend_status {
        let _ = write!(buf, r#","backend_status":{status}"#);
    }
    let _ = write!(buf, r#","duration_ms":{}"#, Millis(line.duration_us));
    buf.extend_from_slice(b",\"target\":\"fencegate::access\"}\n");
}

/// `s` as a JSON string, quoted and escaped.
fn string(buf: &mut Vec<u8>, s: &str) {
    let _ = serde_json::to_writer(&mut *buf, s);
}

/// The line in nginx's `combined` format, without a new line: `$remote_addr - $remote_user
/// [$time_local] "$request" $status $body_bytes_sent "$http_referer" "$http_user_agent"`. A
/// peer on a Unix socket shows as `unix`; there is no remote user; the time is UTC; bytes are
/// `-` when the response's head did not say how long its body is.
fn combined(line: &Line, buf: &mut Vec<u8>) {
    let fields = line.combined.as_deref();
    match fields.map(|c| c.client) {
        Some(Some(ip)) => {
            let _ = write!(buf, "{ip}");
        }
        Some(None) => buf.extend_from_slice(b"unix"),
        None => buf.push(b'-'),
    }
    buf.extend_from_slice(b" - - [");
    time_local(line.at, buf);
    buf.extend_from_slice(b"] \"");
    escaped(buf, line.method.as_str().as_bytes());
    buf.push(b' ');
    escaped(buf, line.path.as_bytes());
    if let Some(query) = fields.and_then(|c| c.query.as_deref()) {
        buf.push(b'?');
        escaped(buf, query.as_bytes());
    }
    if let Some(c) = fields {
        let _ = write!(buf, " {:?}", c.version);
    }
    match line.status {
        Some(status) => {
            let _ = write!(buf, "\" {status} ");
        }
        None => buf.extend_from_slice(b"\" - "),
    }
    match fields.and_then(|c| c.body_bytes) {
        Some(n) => {
            let _ = write!(buf, "{n}");
        }
        None => buf.push(b'-'),
    }
    for header in [fields.and_then(|c| c.referer.as_ref()), fields.and_then(|c| c.user_agent.as_ref())] {
        buf.extend_from_slice(b" \"");
        match header {
            Some(value) => escaped(buf, value.as_bytes()),
            None => buf.push(b'-'),
        }
        buf.push(b'"');
    }
}

/// `at` as nginx's `$time_local` in UTC: `04/Dec/2026:12:33:51 +0000`.
fn time_local(at: SystemTime, buf: &mut Vec<u8>) {
    // "YYYY-MM-DDTHH:MM:SSZ", rearranged.
    let iso = humantime::format_rfc3339_seconds(within_years(at)).to_string();
    let month = iso.get(5..7).and_then(|m| m.parse::<usize>().ok()).and_then(|m| MONTHS.get(m.wrapping_sub(1)));
    match (iso.get(0..4), month, iso.get(8..10), iso.get(11..19)) {
        (Some(year), Some(month), Some(day), Some(time)) => {
            let _ = write!(buf, "{day}/{month}/{year}:{time} +0000");
        }
        _ => buf.extend_from_slice(iso.as_bytes()),
    }
}

/// `bytes` as nginx's default log escaping writes them: `"`, `\` and bytes that are not
/// printable ASCII as `\xHH`, so that a quoted field always ends at its closing quote.
fn escaped(buf: &mut Vec<u8>, bytes: &[u8]) {
    for &b in bytes {
        if b == b'"' || b == b'\\' || !(0x20..0x7f).contains(&b) {
            let _ = write!(buf, "\\x{b:02X}");
        } else {
            buf.push(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_show_three_decimals_and_nothing_else() {
        let shown = |us| Millis(us).to_string();
        assert_eq!([shown(157), shown(0), shown(1000), shown(1_234_567)], ["0.157", "0.000", "1.000", "1234.567"]);
    }

    #[test]
    fn time_local_reads_as_nginx_writes_it() {
        let mut buf = Vec::new();
        time_local(SystemTime::UNIX_EPOCH + Duration::from_secs(1_764_694_800), &mut buf);
        assert_eq!(String::from_utf8(buf).unwrap(), "02/Dec/2025:17:00:00 +0000");
    }

    #[test]
    fn quotes_backslashes_and_unprintable_bytes_are_escaped_as_nginx_does() {
        let mut buf = Vec::new();
        escaped(&mut buf, "a \"b\" \\ \t é".as_bytes());
        assert_eq!(String::from_utf8(buf).unwrap(), r"a \x22b\x22 \x5C \x09 \xC3\xA9");
    }
}
