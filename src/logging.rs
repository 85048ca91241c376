//! Logs to stderr, as text or JSON lines, at a level a reload can change.

use std::sync::OnceLock;

use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::prelude::*;
use tracing_subscriber::{Registry, fmt, reload};

use crate::config::LogFormat;

/// The level filter of the installed subscriber; unset when the library runs without one (tests).
static LEVEL: OnceLock<reload::Handle<LevelFilter, Registry>> = OnceLock::new();

/// Installs the process-wide subscriber. Call once, before anything logs.
pub fn init(level: &str, format: LogFormat) {
    let (filter, handle) = reload::Layer::new(parse(level));
    let (json, text) = match format {
        LogFormat::Json => (Some(fmt::layer().json().with_writer(std::io::stderr)), None),
        // Colour codes only for a terminal: logs are also parsed by tools and tests.
        LogFormat::Text => {
            let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
            (None, Some(fmt::layer().with_ansi(ansi).with_writer(std::io::stderr)))
        }
    };
    if tracing_subscriber::registry().with(filter).with(json).with(text).try_init().is_ok() {
        let _ = LEVEL.set(handle);
    }
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
