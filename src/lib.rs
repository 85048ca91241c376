//! fencegate: a reverse proxy that makes a dumb HTTP backend safe against stale lock holders.
//!
//! Every fenced write carries the fencing token its client got from the lock service.
//! fencegate remembers, per resource, the highest token it has accepted (`max_seen`), makes
//! every advance durable before forwarding, forwards one resource's writes in token order,
//! and refuses anything not above `max_seen` — so a zombie lock holder's write never lands.
//!
//! The modules follow one request: [`app`] opens the store and runs everything; `listener`
//! accepts connections; `request` classifies each request, then fences, forwards and answers
//! it; [`fence`] holds keys, tokens and turns; `upstream` talks to the backend; [`store`]
//! makes `max_seen` durable. `admin` and [`config`] sit beside them, and [`demo`] runs the
//! zombie race against an in-memory backend.
//!
//! The binary is a thin shell around [`run`]: tests bind port 0 and run the same server
//! in-process.
// Allowed in one module only: the writer thread's scheduling calls (src/store/scheduling.rs).
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod admin;
pub mod app;
pub mod config;
pub mod demo;
pub mod etcd_client;
pub mod fence;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod listener;
pub mod logging;
pub mod refusal;
pub mod request;
mod state;
pub mod store;
pub mod tls;
pub mod upstream;

pub use app::Error;
pub use app::{Proxy, run};
pub use config::Config;
pub use config::reload::Reload;
