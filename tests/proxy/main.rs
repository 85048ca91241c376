//! The proxy in front of a backend, mostly in-process (`common::Harness`): the fence, paths,
//! proxying, limits, ordering, TLS, the admin API, reloads, signed tokens, the access log, and
//! WebDAV writes against nginx and against a recording stub. One test binary: each module was
//! a binary of its own, and every binary relinked the library and the harness.

#[path = "../common/mod.rs"]
mod common;

mod access_log;
mod admin;
mod admin_changes;
mod backend_connections;
mod fencing;
mod limits;
mod nginx;
mod ordering;
mod paths;
mod proxying;
mod redirects;
mod reload;
mod s3;
mod s3_model;
mod s3_pins;
mod s3_streams;
mod supervision;
mod tls;
mod unix_sockets;
mod verify_hmac;
mod webdav;
mod webdav_model;
