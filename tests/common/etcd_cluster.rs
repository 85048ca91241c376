//! A three-member etcd cluster on loopback for the cluster's fault tests, its data on tmpfs:
//! members killed, stopped and started again one by one, and asked which of them leads.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::etcd_server::etcd_healthy;
use super::raw::try_raw_request;
use super::services::{Process, free_ports, installed};

const ETCD: &str = "/usr/bin/etcd";
const ETCDCTL: &str = "/usr/bin/etcdctl";

/// A three-member etcd cluster on loopback, its data on tmpfs (`/dev/shm`) where there is one:
/// members killed, stopped and restarted one by one.
pub struct EtcdCluster {
    members: Vec<Option<Process>>,
    /// Each member's client address.
    pub endpoints: Vec<SocketAddr>,
    peers: Vec<SocketAddr>,
    /// What each member's command line starts with before etcd's path (`ip netns exec NS`
    /// for a member in a namespace; nothing on loopback).
    prefixes: Vec<Vec<String>>,
    data: Vec<PathBuf>,
    starts: usize,
    dir: tempfile::TempDir,
}

fn member_command(i: usize, cluster: &EtcdCluster, state: &str) -> Command {
    let client_url = format!("http://{}", cluster.endpoints[i]);
    let peer_url = format!("http://{}", cluster.peers[i]);
    let initial: Vec<String> = cluster.peers.iter().enumerate().map(|(j, p)| format!("m{j}=http://{p}")).collect();
    let data = &cluster.data[i];
    let mut cmd = match cluster.prefixes[i].split_first() {
        Some((program, args)) => {
            let mut cmd = Command::new(program);
            cmd.args(args).arg(ETCD);
            cmd
        }
        None => Command::new(ETCD),
    };
    cmd.arg("--name")
        .arg(format!("m{i}"))
        .arg("--data-dir")
        .arg(data)
        .args(["--listen-client-urls", &client_url, "--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &initial.join(","), "--initial-cluster-state", state])
        .args([
            "--initial-cluster-token",
            "fencegate-test",
            "--election-timeout",
            "1000",
            "--heartbeat-interval",
            "100",
        ]);
    cmd
}

impl EtcdCluster {
    /// The client URLs, for `[etcd] endpoints`.
    pub fn urls(&self) -> Vec<String> {
        self.endpoints.iter().map(|e| format!("http://{e}")).collect()
    }

    /// The pid of member `i`, while it runs.
    pub fn pid(&mut self, i: usize) -> Option<u32> {
        let member = self.members[i].as_mut()?;
        match member.child.try_wait() {
            Ok(None) => Some(member.child.id()),
            _ => None,
        }
    }

    /// Waits until every member answers healthy (a leader, serving requests).
    pub async fn wait_healthy(&mut self) {
        for i in 0..self.members.len() {
            let endpoint = self.endpoints[i];
            if let Some(member) = self.members[i].as_mut() {
                assert!(
                    member.wait_ready(async || etcd_healthy(endpoint).await).await,
                    "etcd member {i} did not come back"
                );
            }
        }
    }

    /// The member etcd's members name their leader, if they agree on one that runs.
    pub async fn leader(&self) -> Option<usize> {
        for (i, e) in self.endpoints.iter().enumerate() {
            if self.members[i].is_none() {
                continue;
            }
            let body = r#"{}"#;
            let head = format!(
                "POST /v3/maintenance/status HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\nContent-Length: {}",
                body.len()
            );
            // Briefly: a stopped member does not answer.
            let asked = tokio::time::timeout(std::time::Duration::from_secs(1), try_raw_request(*e, &head, body));
            let Ok(Some(r)) = asked.await else { continue };
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&r.body) else { continue };
            let (Some(leader), Some(me)) = (v["leader"].as_str(), v["header"]["member_id"].as_str()) else { continue };
            if leader == me {
                return Some(i);
            }
        }
        None
    }

    /// Kills member `i` (SIGKILL).
    pub fn kill(&mut self, i: usize) {
        self.members[i] = None;
    }

    /// Starts member `i` again on its ports and data.
    pub fn restart(&mut self, i: usize) {
        self.starts += 1;
        let log = self.dir.path().join(format!("etcd-m{i}-{}.log", self.starts));
        let cmd = member_command(i, self, "existing");
        self.members[i] = Some(Process::spawn("etcd member", cmd, log));
    }
}

/// Starts a three-member etcd cluster, or returns `None` (the test skips) where etcd is not
/// installed. Resolves once every member is healthy.
pub async fn start_etcd_cluster() -> Option<EtcdCluster> {
    let ports: [u16; 6] = free_ports();
    let at = |p: &u16| -> SocketAddr { format!("127.0.0.1:{p}").parse().unwrap() };
    let endpoints: Vec<SocketAddr> = ports[..3].iter().map(at).collect();
    let peers: Vec<SocketAddr> = ports[3..].iter().map(at).collect();
    start_placed(endpoints, peers, vec![Vec::new(); 3]).await
}

/// A three-member etcd cluster whose member `i` listens for clients on `endpoints[i]` and for
/// its peers on `peers[i]`, its command line starting with `prefixes[i]` (`ip netns exec NS`,
/// for a member in a namespace of its own); `None` where etcd is not installed.
pub async fn start_placed(
    endpoints: Vec<SocketAddr>,
    peers: Vec<SocketAddr>,
    prefixes: Vec<Vec<String>>,
) -> Option<EtcdCluster> {
    if !installed("etcd", "etcd-server etcd-client", &[ETCD, ETCDCTL]) {
        return None;
    }
    let shm = Path::new("/dev/shm");
    let dir = if shm.is_dir() { tempfile::tempdir_in(shm).unwrap() } else { tempfile::tempdir().unwrap() };
    let data: Vec<PathBuf> = (0..3).map(|i| dir.path().join(format!("m{i}"))).collect();
    let mut cluster = EtcdCluster { members: Vec::new(), endpoints, peers, prefixes, data, starts: 0, dir };
    for i in 0..3 {
        let cmd = member_command(i, &cluster, "new");
        let log = cluster.dir.path().join(format!("etcd-m{i}.log"));
        cluster.members.push(Some(Process::spawn("etcd member", cmd, log)));
    }
    for i in 0..3 {
        let endpoint = cluster.endpoints[i];
        let member = cluster.members[i].as_mut().unwrap();
        assert!(member.wait_ready(async || etcd_healthy(endpoint).await).await, "etcd member {i} did not start");
    }
    Some(cluster)
}
