//! The interop tests' etcd client: the library's own ([`fencegate::etcd_client::Client`], over etcd's
//! gRPC API), which `examples/etcd_lock.rs` uses too.
#![allow(unused_imports)]

pub use fencegate::etcd_client::{Client as Gateway, HeldLock, Kv};
