//! deploy/kubernetes/fencegate-sidecar.yaml against the config it mounts (loaded by the real
//! loader with the container's environment), and its init step run for real with `sh`.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;

use yaml_rust2::{Yaml, YamlLoader};

use super::{BIN, load_config, read, said};

const MANIFEST: &str = "deploy/kubernetes/fencegate-sidecar.yaml";
const CONTAINER_CONFIG: &str = "deploy/container/fencegate.toml";

/// The manifest's documents.
pub struct Manifest(Vec<Yaml>);

impl Manifest {
    pub fn load() -> Manifest {
        Manifest(YamlLoader::load_from_str(&read(MANIFEST)).unwrap_or_else(|e| panic!("{MANIFEST}: {e}")))
    }

    fn all(&self, kind: &str) -> Vec<&Yaml> {
        self.0.iter().filter(|d| d["kind"].as_str() == Some(kind)).collect()
    }

    fn named(&self, kind: &str, name: &str) -> Option<&Yaml> {
        self.all(kind).into_iter().find(|d| d["metadata"]["name"].as_str() == Some(name))
    }

    fn statefulset(&self) -> &Yaml {
        let all = self.all("StatefulSet");
        assert_eq!(all.len(), 1, "{MANIFEST}: one StatefulSet expected");
        all[0]
    }

    pub fn pod(&self) -> &Yaml {
        &self.statefulset()["spec"]["template"]["spec"]
    }

    /// The pod's container (or init container) `name`.
    pub fn container(&self, name: &str) -> &Yaml {
        let pod = self.pod();
        let all = [list(&pod["containers"]), list(&pod["initContainers"])].concat();
        all.into_iter().find(|c| c["name"].as_str() == Some(name)).unwrap_or_else(|| panic!("no container {name}"))
    }
}

fn list(y: &Yaml) -> Vec<&Yaml> {
    y.as_vec().map(|v| v.iter().collect()).unwrap_or_default()
}

fn text<'a>(y: &'a Yaml, what: &str) -> &'a str {
    y.as_str().unwrap_or_else(|| panic!("{what}: not a string: {y:?}"))
}

fn strings(y: &Yaml) -> Vec<&str> {
    list(y).into_iter().map(|s| text(s, "list item")).collect()
}

/// A port given by number or by the name of one of `container`'s ports.
fn port(container: &Yaml, port: &Yaml) -> u16 {
    if let Some(n) = port.as_i64() {
        return u16::try_from(n).unwrap();
    }
    let name = text(port, "port");
    let found = list(&container["ports"]).into_iter().find(|p| p["name"].as_str() == Some(name));
    let number = found.and_then(|p| p["containerPort"].as_i64()).unwrap_or_else(|| panic!("no port named {name}"));
    u16::try_from(number).unwrap()
}

/// Bytes in a Kubernetes quantity such as "512Mi".
fn bytes(quantity: &str) -> u64 {
    let units =
        [("Ki", 1u64 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30), ("k", 1000), ("M", 1_000_000), ("G", 1_000_000_000)];
    let (digits, unit) =
        units.iter().find_map(|(suffix, n)| Some((quantity.strip_suffix(suffix)?, *n))).unwrap_or((quantity, 1));
    digits.parse::<u64>().unwrap_or_else(|_| panic!("quantity {quantity}")) * unit
}

/// The container's environment as the loader would see it, a Secret's value standing in for
/// each `secretKeyRef`.
fn environment<'a>(container: &'a Yaml) -> Vec<(&'a str, &'a str)> {
    let secret = "a-secret-token-from-the-cluster-0123456789";
    let value = |e: &'a Yaml| -> &'a str {
        e["value"].as_str().unwrap_or(if e["valueFrom"]["secretKeyRef"].is_hash() { secret } else { "" })
    };
    list(&container["env"]).into_iter().map(|e| (text(&e["name"], "env name"), value(e))).collect()
}

/// The config the fencegate container runs with.
fn config(m: &Manifest) -> fencegate::Config {
    let fencegate = m.container("fencegate");
    let cm = m.named("ConfigMap", "fencegate").expect("no ConfigMap fencegate");
    load_config(text(&cm["data"]["fencegate.toml"], "fencegate.toml"), &environment(fencegate))
}

#[test]
fn the_manifest_mounts_the_container_config_and_agrees_with_it() {
    let m = Manifest::load();
    let pod = m.pod();
    let fencegate = m.container("fencegate");
    let config = config(&m);

    // The config file: the one the image carries, mounted where `--config` looks.
    let args = strings(&fencegate["args"]);
    assert_eq!(args[..2], ["run", "--config"], "{args:?}");
    let config_path = Path::new(args[2]);
    let mounts = list(&fencegate["volumeMounts"]);
    let mount = mounts
        .iter()
        .find(|v| config_path.parent() == Some(Path::new(text(&v["mountPath"], "mountPath"))))
        .unwrap_or_else(|| panic!("nothing is mounted at {}", config_path.display()));
    let volume = list(&pod["volumes"]).into_iter().find(|v| v["name"] == mount["name"]).expect("no such volume");
    let cm = m.named("ConfigMap", text(&volume["configMap"]["name"], "configMap")).expect("no such ConfigMap");
    let file = config_path.file_name().unwrap().to_str().unwrap();
    assert_eq!(text(&cm["data"][file], file), read(CONTAINER_CONFIG), "the ConfigMap differs from {CONTAINER_CONFIG}");

    // The data directory: a volume from the claim templates, mounted at store.dir.
    let data = mounts.iter().find(|v| Path::new(text(&v["mountPath"], "mountPath")) == config.store.dir);
    let data = data.unwrap_or_else(|| panic!("nothing is mounted at store.dir {}", config.store.dir.display()));
    let claims = list(&m.statefulset()["spec"]["volumeClaimTemplates"]);
    assert!(claims.iter().any(|c| c["metadata"]["name"] == data["name"]), "the data volume is not a claim template");
    assert!(list(&pod["volumes"]).iter().all(|v| v["name"] != data["name"]), "the data volume is also a pod volume");

    // Ports: every interface (clients and the kubelet come from outside the Pod), the config's.
    let admin = super::tcp(config.admin.listen.as_ref().expect("admin.listen is not set: no probes"));
    for (name, addr) in [("http", super::tcp(&config.server.listen)), ("admin", admin)] {
        assert_eq!(port(fencegate, &Yaml::String(name.into())), addr.port(), "port {name}");
        assert!(addr.ip().is_unspecified(), "{name} listens on {addr}: the kubelet and other Pods cannot reach it");
    }
    for (probe, path) in [("startupProbe", "/healthz"), ("livenessProbe", "/livez"), ("readinessProbe", "/readyz")] {
        let get = &fencegate[probe]["httpGet"];
        assert_eq!(get["path"].as_str(), Some(path), "{probe}");
        assert_eq!(port(fencegate, &get["port"]), admin.port(), "{probe} is not on the admin port");
    }
    // /livez answers 503 only once the serving runtime has had 2 s to run its task: a probe
    // that gives up sooner (the default is 1 s) would restart a healthy, busy Pod.
    let timeout = fencegate["livenessProbe"]["timeoutSeconds"].as_i64().unwrap_or(1);
    assert!(timeout > 2, "livenessProbe.timeoutSeconds {timeout} is not above /livez's 2 s");

    // The image's config keeps the admin API on loopback; the Pod asks for every interface.
    let image = load_config(&read(CONTAINER_CONFIG), &[]);
    let loopback = matches!(image.admin.listen, Some(fencegate::config::ListenAddr::Ip(a)) if a.ip().is_loopback());
    assert!(loopback, "the image's admin.listen is not loopback");
    assert!(
        environment(fencegate).contains(&("FENCEGATE_ADMIN__LISTEN", "0.0.0.0:8081")),
        "no FENCEGATE_ADMIN__LISTEN"
    );

    // preStop: the Pod leaves the endpoints before SIGTERM starts the drain, with the binary's
    // own `sleep` (the image's entrypoint), and the grace period covers both.
    let pre_stop = strings(&fencegate["lifecycle"]["preStop"]["exec"]["command"]);
    assert!(
        pre_stop.len() == 3 && pre_stop[1] == "sleep",
        "preStop: `fencegate sleep DURATION` expected: {pre_stop:?}"
    );
    assert_eq!(pre_stop[0], "/usr/local/bin/fencegate", "preStop does not run the image's binary");
    let out = Command::new(BIN).args(["sleep", "0s"]).output().unwrap();
    assert!(out.status.success(), "fencegate sleep: {}", said(&out));
    let pause = humantime::parse_duration(pre_stop[2]).unwrap_or_else(|e| panic!("preStop: {}: {e}", pre_stop[2]));

    // The backend: on loopback in the Pod, where backend.url points.
    let url = config.backend.url.authority().unwrap().as_str().parse::<SocketAddr>().expect("backend.url: IP:PORT");
    assert!(url.ip().is_loopback(), "backend.url {url} is not loopback: the backend would be reachable");
    assert!(
        strings(&m.container("backend")["args"]).contains(&url.to_string().as_str()),
        "the backend binds elsewhere"
    );

    // The Pod around them.
    let grace = pod["terminationGracePeriodSeconds"].as_i64().expect("terminationGracePeriodSeconds");
    let needed = pause + config.server.shutdown_grace;
    assert!(grace as u64 > needed.as_secs(), "killed before preStop and server.shutdown_grace ({needed:?}) are over");
    assert_eq!(pod["enableServiceLinks"].as_bool(), Some(false), "enableServiceLinks");
    assert_eq!(pod["automountServiceAccountToken"].as_bool(), Some(false), "automountServiceAccountToken");
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    assert_ne!(pod["securityContext"]["runAsUser"].as_i64().unwrap_or(0), 0);
    for c in [list(&pod["containers"]), list(&pod["initContainers"])].concat() {
        for (bound, resource) in [("requests", "cpu"), ("requests", "memory"), ("limits", "cpu"), ("limits", "memory")]
        {
            assert!(c["resources"][bound][resource].as_str().is_some(), "{:?}: no {bound}.{resource}", c["name"]);
        }
        assert_eq!(c["securityContext"]["allowPrivilegeEscalation"].as_bool(), Some(false), "{:?}", c["name"]);
        assert_eq!(c["securityContext"]["readOnlyRootFilesystem"].as_bool(), Some(true), "{:?}", c["name"]);
    }
    let limit = bytes(text(&fencegate["resources"]["limits"]["memory"], "memory limit"));
    assert!(limit > config.store.max_table_bytes, "the memory limit is below store.max_table_bytes");
    assert_eq!(m.container("init-data-dir")["image"], fencegate["image"], "init and run from different images");
}

#[test]
fn services_and_the_network_policy_keep_the_backend_and_the_admin_port_private() {
    let m = Manifest::load();
    let config = config(&m);
    let fencegate = m.container("fencegate");
    let labels = &m.statefulset()["spec"]["template"]["metadata"]["labels"];
    let selects_pod = |selector: &Yaml| {
        let selector = selector.as_hash().expect("a selector");
        !selector.is_empty() && selector.iter().all(|(k, v)| &labels[text(k, "label")] == v)
    };
    let http = super::tcp(&config.server.listen).port();
    let admin = super::tcp(config.admin.listen.as_ref().unwrap()).port();

    let service = m.named("Service", text(&m.statefulset()["spec"]["serviceName"], "serviceName"));
    let service = service.expect("no Service named by the StatefulSet's serviceName");
    assert_eq!(service["spec"]["clusterIP"].as_str(), Some("None"), "the StatefulSet's Service is not headless");
    for s in m.all("Service").into_iter().filter(|s| selects_pod(&s["spec"]["selector"])) {
        for p in list(&s["spec"]["ports"]) {
            let target = if p["targetPort"].is_badvalue() { &p["port"] } else { &p["targetPort"] };
            assert_eq!(port(fencegate, target), http, "Service {:?} exposes port {:?}", s["metadata"]["name"], target);
        }
    }

    let policies: Vec<&Yaml> =
        m.all("NetworkPolicy").into_iter().filter(|p| selects_pod(&p["spec"]["podSelector"]["matchLabels"])).collect();
    assert_eq!(policies.len(), 1, "one NetworkPolicy for the Pods expected");
    let spec = &policies[0]["spec"];
    assert!(strings(&spec["policyTypes"]).contains(&"Ingress"), "policyTypes: no Ingress");
    let mut peers_by_port = std::collections::BTreeMap::new();
    for rule in list(&spec["ingress"]) {
        let peers = list(&rule["from"]);
        assert!(!peers.is_empty(), "an ingress rule without `from` admits everyone");
        for peer in &peers {
            let selectors = ["podSelector", "namespaceSelector"].map(|s| &peer[s]);
            assert!(selectors.iter().any(|s| s.is_hash()), "a peer with no selector: {peer:?}");
            assert!(
                selectors.iter().all(|s| s.is_badvalue() || s["matchLabels"].as_hash().is_some_and(|l| !l.is_empty())),
                "a selector that matches everything: {peer:?}"
            );
        }
        let ports = list(&rule["ports"]);
        assert!(!ports.is_empty(), "an ingress rule without `ports` opens every port, the backend's too");
        for p in ports {
            peers_by_port.entry(port(fencegate, &p["port"])).or_insert_with(Vec::new).push(format!("{peers:?}"));
        }
    }
    let open: BTreeSet<u16> = peers_by_port.keys().copied().collect();
    assert_eq!(open, BTreeSet::from([http, admin]), "the NetworkPolicy opens other ports than fencegate's two");
    assert_ne!(peers_by_port[&http], peers_by_port[&admin], "the clients may reach the admin port");
}

#[test]
fn every_secret_and_config_map_the_pod_uses_is_in_the_manifest_or_made_by_the_documented_commands() {
    let m = Manifest::load();
    let documented = [read(MANIFEST), read("docs/deployment.md")];
    let containers = [list(&m.pod()["containers"]), list(&m.pod()["initContainers"])].concat();
    for env in containers.iter().flat_map(|c| list(&c["env"])) {
        for (reference, kind, command) in [
            ("secretKeyRef", "Secret", "kubectl create secret generic"),
            ("configMapKeyRef", "ConfigMap", "kubectl create configmap"),
        ] {
            let r = &env["valueFrom"][reference];
            let (Some(name), Some(key)) = (r["name"].as_str(), r["key"].as_str()) else { continue };
            if let Some(object) = m.named(kind, name) {
                assert!(!object["data"][key].is_badvalue(), "{kind} {name} has no key {key}");
                continue;
            }
            // Not in the manifest: both the manifest's comments and the docs say how to make it.
            let made = format!("{command} {name} ");
            for doc in &documented {
                let line = doc.lines().find(|l| l.contains(&made) && l.contains(&format!("--from-literal={key}=")));
                assert!(line.is_some(), "{kind} {name} (key {key}) is neither in the manifest nor made by `{made}...`");
            }
        }
    }
}

#[test]
fn the_init_step_initialises_only_an_empty_volume_an_operator_said_to_expect() {
    let m = Manifest::load();
    let config = config(&m);
    let init = m.container("init-data-dir");
    assert_eq!(strings(&init["command"]), ["/bin/sh", "-c"]);
    let script = text(&init["args"][0], "the script");
    let env = environment(init);
    let data_dir = env.iter().find(|(k, _)| *k == "DATA_DIR").expect("no DATA_DIR").1;
    assert_eq!(Path::new(data_dir), config.store.dir, "DATA_DIR is not store.dir");
    let mounted = list(&init["volumeMounts"]).into_iter().any(|v| v["mountPath"].as_str() == Some(data_dir));
    assert!(mounted, "the init step does not mount the data volume at {data_dir}");
    for var in ["INIT_FLOOR", "INIT_UNTIL"] {
        let e = list(&init["env"]).into_iter().find(|e| e["name"].as_str() == Some(var)).expect(var);
        let r = &e["valueFrom"]["configMapKeyRef"];
        assert_eq!(r["optional"].as_bool(), Some(true), "{var}: the Pod must start without the ConfigMap");
        let name = text(&r["name"], "name");
        assert!(m.named("ConfigMap", name).is_none(), "{name} is in the manifest: every apply would re-create it");
    }

    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let (soon, past) = ((now + 3600).to_string(), (now - 1).to_string());
    let run = |dir: &Path, floor: Option<&str>, until: Option<&str>| {
        let bin_dir = Path::new(BIN).parent().unwrap();
        let mut cmd = Command::new("/bin/sh");
        cmd.args(["-c", script]).env_clear().env("PATH", format!("{}:/usr/bin:/bin", bin_dir.display()));
        cmd.env("DATA_DIR", dir);
        if let Some(floor) = floor {
            cmd.env("INIT_FLOOR", floor);
        }
        if let Some(until) = until {
            cmd.env("INIT_UNTIL", until);
        }
        let out = cmd.output().unwrap();
        (out.status.success(), said(&out))
    };
    let names = |dir: &Path| -> Vec<String> {
        let mut n: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        n.sort();
        n
    };
    let inspect = |dir: &Path| said(&Command::new(BIN).arg("inspect").arg("--dir").arg(dir).output().unwrap());
    let volume = || {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("lost+found")).unwrap();
        dir
    };

    // An empty volume nobody said to expect: refused, with what to do, and left empty.
    let v = volume();
    let (ok, out) = run(v.path(), None, None);
    assert!(!ok && out.contains("kubectl create configmap"), "{out}");
    assert_eq!(names(v.path()), ["lost+found"]);
    // Nor after the deadline, nor with a deadline that is not a number.
    for until in [past.as_str(), "tomorrow"] {
        let (ok, out) = run(v.path(), Some("0"), Some(until));
        assert!(!ok, "initialised with until={until}: {out}");
        assert_eq!(names(v.path()), ["lost+found"]);
    }
    // Expected: initialised with the floor given (a lost volume's, here).
    let (ok, out) = run(v.path(), Some("48213"), Some(&soon));
    assert!(ok, "{out}");
    assert!(inspect(v.path()).contains("floor 48213 at /"), "{}", inspect(v.path()));
    // Once it holds state, the step leaves it alone, even while the ConfigMap is there.
    let before = names(v.path());
    let (ok, out) = run(v.path(), Some("0"), Some(&soon));
    assert!(ok && out.contains("not empty"), "{out}");
    assert_eq!(names(v.path()), before);
    assert!(inspect(v.path()).contains("floor 48213 at /"), "re-initialised: {}", inspect(v.path()));
    // A volume that is not mounted is not initialised in the container's own file system.
    let (ok, out) = run(&v.path().join("absent"), Some("0"), Some(&soon));
    assert!(!ok && !v.path().join("absent").exists(), "{out}");
}
