//! The log of a `fencegate` process, captured line by line from its stderr.

use std::io::{BufRead, BufReader, Read};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use super::wait::poll_until;

/// Every line a process has logged so far.
#[derive(Debug, Clone, Default)]
pub struct Log {
    lines: Arc<Mutex<Vec<String>>>,
    ended: Arc<AtomicBool>,
}

impl Log {
    /// Reads `stream` on a thread of its own until it ends (so the process never blocks on a
    /// full pipe), keeping every line; `on_line` sees each line as it is read.
    pub fn capture(stream: impl Read + Send + 'static, mut on_line: impl FnMut(&str) + Send + 'static) -> Log {
        let log = Log::default();
        let (lines, ended) = (Arc::clone(&log.lines), Arc::clone(&log.ended));
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                on_line(&line);
                lines.lock().unwrap().push(line);
            }
            ended.store(true, Ordering::SeqCst);
        });
        log
    }

    /// The lines that contain `needle`.
    pub fn lines(&self, needle: &str) -> Vec<String> {
        self.lines.lock().unwrap().iter().filter(|l| l.contains(needle)).cloned().collect()
    }

    pub fn contains(&self, needle: &str) -> bool {
        self.lines.lock().unwrap().iter().any(|l| l.contains(needle))
    }

    /// Whether the stream has ended: the process closed it, by exiting or being killed.
    pub fn ended(&self) -> bool {
        self.ended.load(Ordering::SeqCst)
    }

    /// All lines, one per line.
    pub fn text(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// Waits until `needle` has appeared in `count` lines in all; panics at once if the log
    /// ends first.
    pub async fn wait_for(&self, needle: &str, count: usize) {
        let what = format!("{count} log lines with {needle:?}");
        poll_until(&what, || {
            // Ended first: once it has, every line is in and `found` is final.
            let ended = self.ended();
            let found = self.lines(needle).len();
            assert!(found >= count || !ended, "the log ended with {found} of {what}");
            found >= count
        })
        .await
    }

    /// Waits (at most a few seconds) for the last lines of a process that is gone.
    pub fn wait_for_end(&self) {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while !self.ended() && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}
