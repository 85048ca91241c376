//! A private network for the partition tests, made of network namespaces the test creates: a
//! hub holding a bridge (`br0`, 10.77.0.1/24), and one namespace per host (each fencegate
//! instance, each etcd member), joined to the bridge by a veth pair, its end `eth0` at
//! 10.77.0.N/24. The test's own threads enter the hub ([`Net::enter_hub`]), so the in-process
//! backend, the clients and every check reach the hosts over the bridge; processes start in
//! their host with `ip netns exec`. Addresses exist only inside these namespaces.
//!
//! Faults, each on one host and undone by [`Net::heal`]: drops with `nft` rules in the host's
//! own namespace (both directions or one, to some peers or to everything, by address and
//! port), and a slow link (`tc tbf`, a token bucket whose queue delays packets by seconds) on
//! both ends of its veth. Names carry the test process's pid and
//! a counter, so that runs and tests side by side never meet; dropping the [`Net`] deletes every
//! namespace, also when the test panics (the processes in them are the caller's to kill first).
//!
//! Needs root, `ip` (iproute2, with `tc`) and `nft` (nftables); without them [`Net::create`]
//! says so and returns `None` (the test skips), or fails under `FG_REQUIRE_SERVICES=1`.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

const IP: &str = "/usr/sbin/ip";
const TC: &str = "/usr/sbin/tc";
const NFT: &str = "/usr/sbin/nft";

static NETS: AtomicUsize = AtomicUsize::new(0);

/// Which way a cut drops packets, seen from the host it is made on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    Both,
    /// What the host sends.
    Out,
    /// What the host receives.
    In,
}

/// Whom a cut separates the host from.
#[derive(Debug, Clone)]
pub enum Peer {
    /// Every address of the network.
    All,
    /// These hosts' addresses, every port.
    Hosts(Vec<Ipv4Addr>),
    /// One service: its address and port.
    Service(Ipv4Addr, u16),
}

/// The namespaces of one network: the hub first.
pub struct Net {
    hub: String,
    hosts: Vec<(String, String, Ipv4Addr)>,
}

/// Runs `cmd`, panicking with its output when it fails.
fn run(cmd: &mut Command) {
    let out = cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
}

fn ip(args: &[&str]) {
    run(Command::new(IP).args(args));
}

impl Net {
    /// Creates the hub and one host per name, or says why it cannot and returns `None`.
    pub fn create(names: &[&str]) -> Option<Net> {
        let missing: Vec<&str> = [IP, TC, NFT].into_iter().filter(|p| !std::path::Path::new(p).exists()).collect();
        let root = rustix::process::geteuid().is_root();
        if !missing.is_empty() || !root {
            let why = if root {
                format!("{} not installed (apt-get install iproute2 nftables)", missing.join(", "))
            } else {
                "network namespaces need root".to_owned()
            };
            assert!(!super::skips::required(), "{}=1 but {why}", super::skips::REQUIRE);
            super::skips::skip(&why);
            return None;
        }
        let tag = format!("fgp{}x{}", std::process::id(), NETS.fetch_add(1, Ordering::SeqCst));
        let mut net = Net { hub: format!("{tag}-hub"), hosts: Vec::new() };
        ip(&["netns", "add", &net.hub]);
        ip(&["-n", &net.hub, "link", "set", "lo", "up"]);
        ip(&["-n", &net.hub, "link", "add", "br0", "type", "bridge"]);
        ip(&["-n", &net.hub, "addr", "add", "10.77.0.1/24", "dev", "br0"]);
        ip(&["-n", &net.hub, "link", "set", "br0", "up"]);
        for (i, name) in names.iter().enumerate() {
            let ns = format!("{tag}-{name}");
            let (veth, addr) = (format!("h{i}"), Ipv4Addr::new(10, 77, 0, 10 + i as u8));
            ip(&["netns", "add", &ns]);
            net.hosts.push((name.to_string(), ns.clone(), addr));
            ip(&["-n", &net.hub, "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns]);
            ip(&["-n", &net.hub, "link", "set", &veth, "master", "br0", "up"]);
            ip(&["-n", &ns, "link", "set", "lo", "up"]);
            ip(&["-n", &ns, "addr", "add", &format!("{addr}/24"), "dev", "eth0"]);
            ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        }
        Some(net)
    }

    fn host(&self, name: &str) -> (usize, &str, Ipv4Addr) {
        let i = self.hosts.iter().position(|h| h.0 == name).unwrap_or_else(|| panic!("no host {name}"));
        (i, &self.hosts[i].1, self.hosts[i].2)
    }

    /// The address of host `name`.
    pub fn addr(&self, name: &str) -> Ipv4Addr {
        self.host(name).2
    }

    /// The hub's address on the bridge, where the test's own sockets live.
    pub fn hub_addr(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, 0, 1)
    }

    /// A command that runs `program` in host `name`'s namespace (`ip netns exec` execs it, so the
    /// child's pid is the program's).
    pub fn command(&self, name: &str, program: &str) -> Command {
        let mut cmd = Command::new(IP);
        cmd.args(["netns", "exec", self.host(name).1, program]);
        cmd
    }

    /// The start of a command line that runs a program in host `name`'s namespace.
    pub fn prefix(&self, name: &str) -> Vec<String> {
        vec![IP.to_owned(), "netns".to_owned(), "exec".to_owned(), self.host(name).1.to_owned()]
    }

    /// Moves the calling thread into the hub's namespace: for the test's thread and its
    /// runtime's threads (`on_thread_start`), so that every socket they open is on the bridge.
    /// Only this thread moves; the process and other threads stay where they are.
    pub fn enter_hub(&self) -> impl Fn() + Send + Sync + 'static {
        let path = format!("/run/netns/{}", self.hub);
        move || {
            let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            // SAFETY: setns on a descriptor that stays open for the call; it changes only the
            // calling thread's network namespace and touches no memory of ours.
            let entered = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(entered, 0, "setns into {path}: {}", std::io::Error::last_os_error());
        }
    }

    /// Drops what host `name` exchanges with `peer`, in direction `way`, until [`Net::heal`].
    pub fn cut(&self, name: &str, peer: &Peer, way: Way) {
        let matches: Vec<(String, String)> = match peer {
            Peer::All => vec![("ip daddr 10.77.0.0/24".into(), "ip saddr 10.77.0.0/24".into())],
            Peer::Hosts(addrs) => addrs.iter().map(|a| (format!("ip daddr {a}"), format!("ip saddr {a}"))).collect(),
            Peer::Service(a, port) => {
                vec![(format!("ip daddr {a} tcp dport {port}"), format!("ip saddr {a} tcp sport {port}"))]
            }
        };
        let mut rules = String::from(
            "table inet fgcut {\n chain out { type filter hook output priority 0; }\n chain in { type filter hook input priority 0; }\n}\n",
        );
        for (out, inn) in matches {
            if way != Way::In {
                rules.push_str(&format!("add rule inet fgcut out {out} drop\n"));
            }
            if way != Way::Out {
                rules.push_str(&format!("add rule inet fgcut in {inn} drop\n"));
            }
        }
        self.nft(name, &rules);
    }

    fn nft(&self, name: &str, rules: &str) {
        use std::io::Write;
        let mut child = self
            .command(name, NFT)
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(rules.as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "nft -f on {name}: {}\n{rules}", String::from_utf8_lossy(&out.stderr));
    }

    /// Makes host `name`'s link slow, both ways, until [`Net::heal`]: a token bucket (`tc tbf`)
    /// of `kbit` kbit/s on both ends of its veth, whose queue holds a packet up to `queue_ms`
    /// before dropping it. What a packet waits depends on the traffic ahead of it; the caller
    /// measures it. (Not `netem delay`: kernels without `sch_netem` are common in VMs, this
    /// one among them.)
    pub fn slow(&self, name: &str, kbit: u64, queue_ms: u64) {
        let (i, ns, _) = self.host(name);
        let (rate, latency) = (format!("{kbit}kbit"), format!("{queue_ms}ms"));
        let tbf = ["root", "tbf", "rate", &rate, "burst", "1600", "latency", &latency];
        run(Command::new(IP).args(["netns", "exec", ns, TC, "qdisc", "replace", "dev", "eth0"]).args(tbf));
        let veth = format!("h{i}");
        run(Command::new(IP).args(["netns", "exec", &self.hub, TC, "qdisc", "replace", "dev", &veth]).args(tbf));
    }

    /// Undoes every cut and slow link of host `name`.
    pub fn heal(&self, name: &str) {
        let (i, ns, _) = self.host(name);
        // Each may have nothing to undo: not asserted.
        let quiet = |cmd: &mut Command| {
            let _ = cmd.stdout(Stdio::null()).stderr(Stdio::null()).status();
        };
        quiet(Command::new(IP).args(["netns", "exec", ns, NFT, "delete", "table", "inet", "fgcut"]));
        quiet(Command::new(IP).args(["netns", "exec", ns, TC, "qdisc", "del", "dev", "eth0", "root"]));
        quiet(Command::new(IP).args(["netns", "exec", &self.hub, TC, "qdisc", "del", "dev", &format!("h{i}"), "root"]));
    }

    /// Undoes every fault on every host.
    pub fn heal_all(&self) {
        for (name, _, _) in &self.hosts {
            self.heal(name);
        }
    }
}

impl Drop for Net {
    /// Deletes every namespace (their veths go with them). Not asserted: a drop during a panic
    /// must not panic again.
    fn drop(&mut self) {
        for ns in self.hosts.iter().map(|h| &h.1).chain([&self.hub]) {
            let _ = Command::new(IP).args(["netns", "del", ns]).stdout(Stdio::null()).stderr(Stdio::null()).status();
        }
    }
}
