//! Certificates made at test time with rcgen, as PEM files in a temporary directory: a CA, a
//! server certificate it signed for `localhost` and `127.0.0.1`, two client certificates it
//! signed, one with the Common Name `fencegate` and one with no Common Name, and a second CA that
//! signed nothing of these, to be the wrong one.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use rcgen::{BasicConstraints, CertificateParams, DistinguishedName, DnType, IsCa, Issuer, KeyPair, SanType};

pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    pub fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca = |name: &str| {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, format!("test CA {name}"));
            let cert = params.self_signed(&key).unwrap();
            std::fs::write(dir.path().join(format!("{name}.pem")), cert.pem()).unwrap();
            Issuer::new(params, key)
        };
        let issuer = ca("ca");
        ca("other-ca");
        for (name, common_name) in [("server", Some("etcd")), ("client", Some("fencegate")), ("client-no-cn", None)] {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
            params.subject_alt_names.push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
            // rcgen's default subject has a Common Name of its own.
            params.distinguished_name = DistinguishedName::new();
            params.distinguished_name.push(DnType::OrganizationName, "fencegate tests");
            if let Some(common_name) = common_name {
                params.distinguished_name.push(DnType::CommonName, common_name);
            }
            let cert = params.signed_by(&key, &issuer).unwrap();
            std::fs::write(dir.path().join(format!("{name}.pem")), cert.pem()).unwrap();
            std::fs::write(dir.path().join(format!("{name}-key.pem")), key.serialize_pem()).unwrap();
        }
        Pki { dir }
    }

    /// `ca.pem`, `other-ca.pem`, `server.pem`, `server-key.pem`, `client.pem`,
    /// `client-key.pem`, `client-no-cn.pem`, `client-no-cn-key.pem`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}
