//! Several `fencegate run` processes sharing one fence through a real etcd (`store.kind =
//! "etcd"`), in front of one in-memory backend: the prefix initialised as `fencegate init`
//! does, one config per instance on a loopback port picked for it (its advertised URL must be
//! known before it starts), and each instance killed, stopped and started again at will.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;

use fencegate::demo::MemBackend;

use std::sync::{Arc, Mutex};

use super::etcd::Gateway;
use super::process::{BIN, Running};
use super::wait::eventually;

/// The key prefix of the fence in etcd.
pub const PREFIX: &str = "/fg/";
/// Every instance's admin token (its admin API listens on a port of its own).
pub const ADMIN_TOKEN: &str = "an-admin-token-for-the-cluster-tests";

/// One instance: its config and, while it runs, its process.
pub struct Instance {
    pub running: Option<Running>,
    pub addr: SocketAddr,
    pub config: PathBuf,
    /// Pids stopped (SIGSTOP) the moment their log said a fail point was reached, shared by
    /// every instance of a cluster.
    pub stopped: Arc<Mutex<Vec<u32>>>,
    /// What its command line starts with before the binary's path (`ip netns exec NS` for an
    /// instance in a namespace of its own; nothing on loopback).
    pub prefix: Vec<String>,
}

impl Instance {
    /// The advertised URL, which etcd's leader key holds while it leads.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Starts it. A log line saying a fail point was reached stops it on the spot (SIGSTOP),
    /// from the thread that reads its log, and records its pid in `stopped`.
    /// `FG_CLUSTER_BIN` names another binary than this build's, so that a soak can run on a
    /// copy while the tree is rebuilt, or a test on an older build.
    pub fn start(&mut self) -> &Running {
        let bin = std::env::var("FG_CLUSTER_BIN").unwrap_or_else(|_| BIN.to_owned());
        let mut cmd = match self.prefix.split_first() {
            Some((program, args)) => {
                let mut cmd = Command::new(program);
                cmd.args(args).arg(&bin);
                cmd
            }
            None => Command::new(&bin),
        };
        cmd.arg("run").arg("--config").arg(&self.config);
        let stopped = Arc::clone(&self.stopped);
        self.running = Some(Running::spawn_with(cmd, move |line, pid| {
            if line.contains("failpoint reached") {
                // Not asserted: the process may have ended since it wrote the line.
                let _ = Command::new("kill").args(["-s", "STOP", &pid.to_string()]).status();
                stopped.lock().unwrap().push(pid);
            }
        }));
        self.running.as_ref().unwrap()
    }

    pub fn kill9(&mut self) {
        if let Some(r) = self.running.take() {
            r.kill9();
        }
    }

    pub fn proxy(&self) -> &Running {
        self.running.as_ref().expect("the instance runs")
    }
}

/// Where an instance runs: its listening address (also the URL it advertises), its admin
/// API's, and what its command line starts with.
pub struct Place {
    pub listen: SocketAddr,
    pub admin: SocketAddr,
    pub prefix: Vec<String>,
}

/// Fields drop in order: the instances before the backend, etcd and their directory.
pub struct Cluster {
    pub instances: Vec<Instance>,
    pub backend: MemBackend,
    pub gateway: Gateway,
    pub dir: tempfile::TempDir,
}

fn free_port() -> SocketAddr {
    let [port] = super::services::free_ports();
    SocketAddr::from(([127, 0, 0, 1], port))
}

impl Cluster {
    /// `n` instances configured on the prefix [`PREFIX`] of the etcd cluster at `endpoints`,
    /// with `extra` appended to each config; none started, and the prefix not initialised.
    pub async fn build(endpoints: &[String], n: usize, extra: &str) -> Cluster {
        Cluster::build_with(endpoints, n, "3s", extra).await
    }

    /// [`Cluster::build`] with `fence.quarantine` set to `quarantine`.
    pub async fn build_with(endpoints: &[String], n: usize, quarantine: &str, extra: &str) -> Cluster {
        let backend = MemBackend::start().await.unwrap();
        let places =
            (0..n).map(|_| Place { listen: free_port(), admin: "127.0.0.1:0".parse().unwrap(), prefix: Vec::new() });
        Cluster::build_placed(endpoints, places.collect(), backend, quarantine, extra)
    }

    /// One instance at each of `places`, in front of `backend`; otherwise as
    /// [`Cluster::build_with`].
    pub fn build_placed(
        endpoints: &[String],
        places: Vec<Place>,
        backend: MemBackend,
        quarantine: &str,
        extra: &str,
    ) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let stopped = Arc::new(Mutex::new(Vec::new()));
        let listed: Vec<String> = endpoints.iter().map(|e| format!("\"{e}\"")).collect();
        let mut instances = Vec::new();
        for (i, Place { listen: addr, admin, prefix }) in places.into_iter().enumerate() {
            let config = dir.path().join(format!("fencegate-{i}.toml"));
            let text = format!(
                "[server]\nlisten = \"{addr}\"\n[backend]\nurl = \"{}\"\n[store]\nkind = \"etcd\"\nprefix = \"{PREFIX}\"\n\
                 advertise = \"http://{addr}\"\nlease_ttl = \"3s\"\nlease_margin = \"1s\"\n[etcd]\nendpoints = [{}]\n\
                 request_timeout = \"500ms\"\n[fence]\nquarantine = \"{quarantine}\"\n\
                 [admin]\nlisten = \"{admin}\"\ntoken = \"{ADMIN_TOKEN}\"\n{extra}\n",
                backend.url(),
                listed.join(", ")
            );
            std::fs::write(&config, text).unwrap();
            instances.push(Instance { running: None, addr, config, stopped: Arc::clone(&stopped), prefix });
        }
        let gateway = Gateway::new(endpoints, std::time::Duration::from_secs(2));
        Cluster { instances, backend, gateway, dir }
    }

    /// An etcd store on the prefix as instance 0's config makes it, opened in this process on
    /// `client` (not campaigning yet), with a lease of 30 s.
    pub async fn open_store(
        &self,
        client: fencegate::etcd_client::Client,
    ) -> Result<fencegate::store::EtcdStore, fencegate::store::StoreError> {
        self.open_store_with(client, |_| {}).await
    }

    /// [`Cluster::open_store`], with its options changed by `change` first.
    pub async fn open_store_with(
        &self,
        client: fencegate::etcd_client::Client,
        change: impl FnOnce(&mut fencegate::store::EtcdOptions),
    ) -> Result<fencegate::store::EtcdStore, fencegate::store::StoreError> {
        let config = fencegate::Config::load(&self.instances[0].config, None).unwrap();
        let mut options = fencegate::store::EtcdOptions {
            prefix: PREFIX.into(),
            advertise: "http://127.0.0.1:9".into(),
            lease_ttl: std::time::Duration::from_secs(30),
            lease_margin: std::time::Duration::from_secs(1),
            max_resources: 1000,
            max_table_bytes: 1 << 20,
            keying: fencegate::fence::keys::keying(&config.paths, &config.fence.scopes),
            rules: config.fence_record(),
            max_txn_ops: fencegate::store::etcd::DEFAULT_MAX_TXN_OPS,
            batches_in_flight: fencegate::store::etcd::DEFAULT_BATCHES_IN_FLIGHT,
            on_commit: None,
        };
        change(&mut options);
        fencegate::store::EtcdStore::open(client, options).await
    }

    /// Initialises the prefix, as `fencegate init --config` does.
    pub async fn init(&self) {
        let config = fencegate::Config::load(&self.instances[0].config, None).unwrap();
        fencegate::app::init_etcd(&config, 0).await.unwrap();
    }

    /// Built, initialised, and every instance started.
    pub async fn start(endpoints: &[String], n: usize, extra: &str) -> Cluster {
        let mut c = Cluster::build(endpoints, n, extra).await;
        c.init().await;
        for i in &mut c.instances {
            i.start();
        }
        c
    }

    /// The URL in etcd's leader key, if an instance leads.
    pub async fn leader_url(&self) -> Option<String> {
        let key = format!("{PREFIX}leader");
        let (kvs, _) = self.gateway.range(key.as_bytes(), None).await.ok()?;
        kvs.first().map(|kv| String::from_utf8_lossy(&kv.value).into_owned())
    }

    /// Waits until a running instance leads: etcd's leader key names it and its metrics say it
    /// fences writes now (`fencegate_store_role{role="writer"}`); returns its index.
    pub async fn wait_leader(&self) -> usize {
        let mut found = None;
        eventually("an instance leads the fence", async || {
            let Some(url) = self.leader_url().await else { return false };
            let Some(i) = self.instances.iter().position(|i| i.url() == url && i.running.is_some()) else {
                return false;
            };
            if self.is_writer(i).await {
                found = Some(i);
                return true;
            }
            false
        })
        .await;
        found.unwrap()
    }

    /// Whether instance `i` says it fences writes now.
    pub async fn is_writer(&self, i: usize) -> bool {
        let Some(running) = self.instances[i].running.as_ref() else { return false };
        let admin = running.admin_addr().await;
        // Briefly: a stopped instance does not answer.
        let scrape = super::try_raw_request(admin, "GET /metrics HTTP/1.1\r\nHost: x", "");
        let Ok(Some(r)) = tokio::time::timeout(std::time::Duration::from_secs(1), scrape).await else {
            return false;
        };
        String::from_utf8_lossy(&r.body).contains("fencegate_store_role{role=\"writer\"} 1")
    }

    /// Sets a fail point's actions on instance `i` (`off` disarms it); whether it was set.
    pub async fn failpoint(&self, i: usize, name: &str, actions: &str) -> bool {
        let Some(running) = self.instances[i].running.as_ref() else { return false };
        let admin = running.admin_addr().await;
        let head = format!(
            "PUT /failpoints/{name} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: {}",
            actions.len()
        );
        super::try_raw_request(admin, &head, actions).await.is_some_and(|r| r.status == 200)
    }

    /// `max_seen` of `key` as etcd holds it (read again while etcd does not answer).
    pub async fn max_seen_in_etcd(&self, key: &str) -> Option<u64> {
        let name = format!("{PREFIX}k/{key}");
        let mut found = None;
        eventually("etcd answers a read", async || match self.gateway.range(name.as_bytes(), None).await {
            Ok((kvs, _)) => {
                found = Some(kvs.first().map(|kv| std::str::from_utf8(&kv.value).unwrap().parse().unwrap()));
                true
            }
            Err(_) => false,
        })
        .await;
        found.flatten()
    }

    /// Whether etcd holds `key` in flight: a flight record names it (read again while etcd
    /// does not answer).
    pub async fn in_flight_in_etcd(&self, key: &str) -> bool {
        let mut found = false;
        eventually("etcd answers a read", async || match self.flight_records().await {
            Some(records) => {
                found = newest_flight(&records, key).is_some();
                true
            }
            None => false,
        })
        .await;
        found
    }

    /// The token of the write in flight on `key` that etcd's newest flight record naming it
    /// holds, if any.
    pub async fn in_flight_token(&self, key: &str) -> Option<u64> {
        newest_flight(&self.flight_records().await?, key)
    }

    /// Every flight record under the prefix, oldest first, as `(kind, token, name)` entries.
    async fn flight_records(&self) -> Option<Vec<Vec<(String, u64, String)>>> {
        let from = format!("{PREFIX}w/");
        let end = fencegate::etcd_client::prefix_end(from.as_bytes());
        let (kvs, _) = self.gateway.range(from.as_bytes(), Some(&end)).await.ok()?;
        Some(kvs.iter().map(|kv| serde_json::from_slice(&kv.value).expect("a flight record")).collect())
    }

    /// Tokens the backend applied to `path`, in the order it applied them.
    pub fn applied_tokens(&self, path: &str) -> Vec<u64> {
        self.backend.applied().iter().filter(|r| r.path == path).filter_map(|r| r.token()).collect()
    }
}

/// The token of `key`'s entry in the newest of `records` that names it.
fn newest_flight(records: &[Vec<(String, u64, String)>], key: &str) -> Option<u64> {
    records
        .iter()
        .rev()
        .find_map(|entries| entries.iter().find(|(kind, _, name)| kind == "k" && name == key).map(|e| e.1))
}
