//! The shared fence and the lock services: several instances through a real etcd, its fault
//! rounds, its network partitions and its model check, the model check of pinned writes, the etcd client and mirror,
//! verified tokens, and tokens from a real etcd and ZooKeeper. One test binary, with the harness in `common`. Tests that need
//! etcd or ZooKeeper skip with a message where they are not installed (`FG_REQUIRE_SERVICES=1`
//! makes that a failure).
//!
//! `FG_CLUSTER_ROUNDS` sets the counted rounds of `cluster_faults`, `FG_PARTITION_ROUNDS` those
//! of `partitions` (see those modules).

#[path = "../common/mod.rs"]
mod common;

mod cluster_etcd;
mod cluster_faults;
mod cluster_model;
mod etcd_batches;
mod etcd_mirror;
mod etcd_secure;
mod interop_etcd;
mod interop_zookeeper;
mod partitions;
mod pin_model;
mod pipeline_model;
mod verify_etcd;
