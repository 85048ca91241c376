//! fencegate: a reverse proxy that makes a dumb HTTP backend safe against stale lock holders.
//!
//! Every fenced write carries the fencing token its client got from the lock service.
//! fencegate remembers, per resource, the highest token it has accepted (`max_seen`), makes
//! every advance durable before forwarding, forwards one resource's writes in token order,
//! and refuses anything not above `max_seen` — so a zombie lock holder's write never lands.
//!
//! The binary is a thin shell around [`run`]: tests bind port 0 and run the same server
//! in-process.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod admin;
pub mod config;
pub mod demo;
pub mod error;
pub mod fence;
#[doc(hidden)]
pub mod fuzzing;
mod handler;
pub mod live;
pub mod logging;
pub mod memstore;
pub mod metrics;
pub mod path;
mod pool;
pub mod proxy;
pub mod refusals;
pub mod server;
pub mod store;
pub mod tls;
pub mod token;

pub use config::Config;
pub use error::Error;
pub use live::Reload;
pub use server::{Proxy, run};
