//! The proxy in front of a backend, mostly in-process (`common::Harness`): the fence, paths,
//! proxying, limits, ordering, TLS, the admin API, reloads, signed tokens, the access log, and
//! WebDAV writes against nginx and against a recording stub, and writes applied late (pins)
//! against Apache through a delaying relay. One test binary: each module was
//! a binary of its own, and every binary relinked the library and the harness.

#[path = "../common/mod.rs"]
mod common;

mod access_log;
mod admin;
mod admin_changes;
mod backend_connections;
mod envoy;
mod fencing;
mod limits;
mod nginx;
mod ordering;
mod paths;
mod pins;
mod pins_attack;
mod pins_rounds;
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
