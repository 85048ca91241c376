//! The process's own figures for `/metrics`, read from `/proc/self` when scraped: CPU time,
//! resident memory, and descriptors open and allowed. On a system without `/proc` they stay 0.

use std::fs;

/// What one scrape read.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(crate) struct Process {
    /// User plus system CPU time, in seconds.
    pub(crate) cpu_seconds: f64,
    /// Resident set size, in bytes.
    pub(crate) resident_bytes: u64,
    /// Descriptors open now.
    pub(crate) open_fds: u64,
    /// The soft limit on open descriptors.
    pub(crate) max_fds: u64,
}

impl Process {
    /// Reads the figures of the calling process; each one that cannot be read stays 0.
    pub(crate) fn read() -> Process {
        let mut p = Process::default();
        // Field 2 is "(comm)", which may hold spaces: count from the closing parenthesis.
        if let Ok(stat) = fs::read_to_string("/proc/self/stat")
            && let Some((_, rest)) = stat.rsplit_once(')')
        {
            // After the state (field 3), utime and stime are fields 14 and 15.
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
            let per_second = rustix::param::clock_ticks_per_second().max(1);
            p.cpu_seconds = (ticks(11) + ticks(12)) as f64 / per_second as f64;
        }
        if let Ok(statm) = fs::read_to_string("/proc/self/statm") {
            let pages = statm.split_whitespace().nth(1).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
            p.resident_bytes = pages * rustix::param::page_size() as u64;
        }
        p.open_fds = fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64);
        if let Ok(limits) = fs::read_to_string("/proc/self/limits") {
            let line = limits.lines().find(|l| l.starts_with("Max open files"));
            let soft = line.and_then(|l| l["Max open files".len()..].split_whitespace().next());
            p.max_fds = soft.and_then(|s| s.parse().ok()).unwrap_or(0);
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_figures_of_this_process_are_read() {
        let p = Process::read();
        let _held = fs::File::open("/proc/self/stat").unwrap();
        assert!(Process::read().open_fds >= 1);
        assert!(p.resident_bytes > 1 << 20, "{p:?}");
        assert!(p.max_fds >= p.open_fds && p.max_fds > 0, "{p:?}");
        let busy: u64 = (0..20_000_000u64).fold(0, |a, b| a.wrapping_add(b * b));
        assert!(busy > 0 && Process::read().cpu_seconds > 0.0);
    }
}
