//! `[etcd]`: the members, TLS to them (`[etcd.tls]`) and the user fencegate authenticates as,
//! whose password is read here from `password_file` (never written in the config), so that
//! `check` and start-up refuse one that cannot be read. [`EtcdConfig::client_options`] is what
//! an etcd client is made from.

use std::path::PathBuf;
use std::time::Duration;

use http::Uri;
use serde::Serialize;

use super::raw::RawEtcd;
use super::validate::{duration, invalid};
use super::{ConfigError, ser_duration};
use crate::etcd_client::{ClientOptions, Credentials, Password, TlsOptions};

/// `[etcd]`
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EtcdConfig {
    /// Client URLs of the cluster's members, all `http://HOST:PORT` or all
    /// `https://HOST:PORT`; empty: no etcd.
    pub endpoints: Vec<String>,
    /// How long one request to etcd may take before the next member is tried.
    #[serde(serialize_with = "ser_duration")]
    pub request_timeout: Duration,
    /// The user fencegate authenticates as; unset: no authentication.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// The file the user's password was read from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
    /// The password (never printed).
    #[serde(skip)]
    pub password: Option<Password>,
    /// TLS to `https://` members; unset: the system's roots, no client certificate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls: Option<EtcdTls>,
}

/// `[etcd.tls]`
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct EtcdTls {
    /// CA (PEM) that signed the members' certificates; the system's roots when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM), for members started with `--client-cert-auth`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert_file: Option<PathBuf>,
    /// Its private key (PEM).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_file: Option<PathBuf>,
    /// The name the members' certificates must hold, instead of each endpoint's host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
}

impl EtcdConfig {
    /// The options of a client of this cluster, for `etcd::Client::from_options`.
    pub fn client_options(&self) -> ClientOptions {
        let tls = self.tls.as_ref().map(|t| TlsOptions {
            ca_file: t.ca_file.clone(),
            cert_file: t.cert_file.clone(),
            key_file: t.key_file.clone(),
            server_name: t.server_name.clone(),
        });
        let credentials = match (&self.username, &self.password) {
            (Some(username), Some(password)) => {
                Some(Credentials { username: username.clone(), password: password.clone() })
            }
            _ => None,
        };
        ClientOptions { endpoints: self.endpoints.clone(), request_timeout: self.request_timeout, tls, credentials }
    }
}

/// Validates `[etcd]`, reading the password file and loading the TLS files.
pub(super) fn etcd(raw: RawEtcd) -> Result<EtcdConfig, ConfigError> {
    let mut https = None;
    for (index, url) in raw.endpoints.iter().enumerate() {
        let key = format!("etcd.endpoints[{index}]");
        let uri: Uri = url.parse().map_err(|e| invalid(&key, format!("{url:?}: {e}")))?;
        let this = match (uri.scheme_str(), uri.authority(), uri.path()) {
            (Some(scheme @ ("http" | "https")), Some(_), "" | "/") => scheme == "https",
            _ => return Err(invalid(&key, format!("{url:?}: expected http://HOST:PORT or https://HOST:PORT"))),
        };
        if *https.get_or_insert(this) != this {
            return Err(invalid(&key, format!("{url:?}: all endpoints must be http:// or all https://, not both")));
        }
    }
    let https = https.unwrap_or(false);
    if raw.password.is_some() {
        return Err(invalid(
            "etcd.password",
            "is never written in the config: put the password in a file of its own and name it in etcd.password_file",
        ));
    }
    let password = match (&raw.username, &raw.password_file) {
        (Some(user), _) if user.is_empty() => return Err(invalid("etcd.username", "must not be empty")),
        (Some(_), Some(file)) => Some(read_password(file)?),
        (Some(_), None) => return Err(invalid("etcd.password_file", "etcd.username needs its password, in a file")),
        (None, Some(_)) => {
            return Err(invalid("etcd.username", "etcd.password_file needs the user it is the password of"));
        }
        (None, None) => None,
    };
    let tls = match raw.tls {
        Some(_) if !https => return Err(invalid("etcd.tls", "only applies to https:// etcd.endpoints")),
        Some(t) => {
            let tls = EtcdTls {
                ca_file: t.ca_file,
                cert_file: t.cert_file,
                key_file: t.key_file,
                server_name: t.server_name,
            };
            check_tls(&tls)?;
            Some(tls)
        }
        None => None,
    };
    Ok(EtcdConfig {
        endpoints: raw.endpoints,
        request_timeout: duration("etcd.request_timeout", &raw.request_timeout)?,
        username: raw.username,
        password_file: raw.password_file,
        password,
        tls,
    })
}

/// The password in `file`, without the line break that ends it.
fn read_password(file: &std::path::Path) -> Result<Password, ConfigError> {
    let key = "etcd.password_file";
    let text = std::fs::read_to_string(file).map_err(|e| invalid(key, format!("{}: {e}", file.display())))?;
    let password = text.trim_end_matches(['\n', '\r']);
    if password.is_empty() {
        return Err(invalid(key, format!("{}: the file is empty", file.display())));
    }
    Ok(Password::new(password))
}

/// Loads the files now, so that `check` and start-up fail on one that does not parse.
fn check_tls(tls: &EtcdTls) -> Result<(), ConfigError> {
    match (&tls.cert_file, &tls.key_file) {
        (Some(_), None) => return Err(invalid("etcd.tls.key_file", "etcd.tls.cert_file needs its private key")),
        (None, Some(_)) => return Err(invalid("etcd.tls.cert_file", "etcd.tls.key_file needs its certificate")),
        _ => {}
    }
    if let Some(name) = &tls.server_name {
        rustls_pki_types::ServerName::try_from(name.as_str())
            .map_err(|_| invalid("etcd.tls.server_name", format!("{name:?} is not a DNS name or an IP address")))?;
    }
    crate::tls::client_config(tls.ca_file.as_deref(), tls.cert_file.as_deref(), tls.key_file.as_deref())
        .map_err(|e| invalid("etcd.tls", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::Config;
    use crate::etcd_client::{Credentials, Password, TlsOptions};

    const MINIMAL: &str = "[backend]\nurl = \"http://127.0.0.1:9000\"\n";

    /// A CA certificate, and a certificate and key it did not sign (enough to parse), as PEM.
    fn pem_files(dir: &Path) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["client".to_string()]).unwrap().self_signed(&key).unwrap();
        std::fs::write(dir.join("ca.pem"), cert.pem()).unwrap();
        std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
        std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
        std::fs::write(dir.join("password"), "s3cret pass\n").unwrap();
        std::fs::write(dir.join("empty"), "\n").unwrap();
    }

    fn load(extra: &str) -> Result<Config, String> {
        Config::from_toml_str(&format!("{MINIMAL}{extra}")).map_err(|e| e.to_string())
    }

    #[test]
    fn tls_and_credentials_become_the_client_options() {
        let dir = tempfile::tempdir().unwrap();
        pem_files(dir.path());
        let d = dir.path().display();
        let c = load(&format!(
            "[etcd]\nendpoints = [\"https://10.0.0.1:2379\", \"https://10.0.0.2:2379/\"]\nusername = \"fencegate\"\n\
             password_file = \"{d}/password\"\n[etcd.tls]\nca_file = \"{d}/ca.pem\"\ncert_file = \"{d}/cert.pem\"\n\
             key_file = \"{d}/key.pem\"\nserver_name = \"etcd.internal\"\n"
        ))
        .unwrap();
        let options = c.etcd.client_options();
        assert_eq!(options.endpoints.len(), 2);
        let tls = TlsOptions {
            ca_file: Some(dir.path().join("ca.pem")),
            cert_file: Some(dir.path().join("cert.pem")),
            key_file: Some(dir.path().join("key.pem")),
            server_name: Some("etcd.internal".into()),
        };
        assert_eq!(options.tls, Some(tls));
        // The line break that ends the file is not part of the password; a space inside is.
        let credentials = Credentials { username: "fencegate".into(), password: Password::new("s3cret pass") };
        assert_eq!(options.credentials, Some(credentials));
        // The password is never shown.
        assert!(!format!("{c:?}").contains("s3cret"), "Debug shows it");
        assert!(!c.to_toml().contains("s3cret"), "check shows it");
        assert!(c.to_toml().contains("password_file"));

        // https:// alone: the system's roots, no client certificate, no credentials.
        let plain = load("[etcd]\nendpoints = [\"https://10.0.0.1:2379\"]\n").unwrap().etcd.client_options();
        assert_eq!((plain.tls, plain.credentials), (None, None));
    }

    #[test]
    fn bad_etcd_settings_name_their_key() {
        let dir = tempfile::tempdir().unwrap();
        pem_files(dir.path());
        let d = dir.path().display();
        const HTTPS: &str = "[etcd]\nendpoints = [\"https://127.0.0.1:2379\"]\n";
        let user = |file: &str| format!("{HTTPS}username = \"u\"\npassword_file = \"{d}/{file}\"\n");
        for (extra, says) in [
            (
                "[etcd]\nendpoints = [\"https://127.0.0.1:2379\", \"http://127.0.0.1:2380\"]\n".to_owned(),
                "etcd.endpoints[1]: \"http://127.0.0.1:2380\": all endpoints must be http:// or all https://",
            ),
            ("[etcd]\nendpoints = [\"https://127.0.0.1:2379/v3\"]\n".into(), "etcd.endpoints[0]"),
            (
                format!("[etcd]\nendpoints = [\"http://127.0.0.1:2379\"]\n[etcd.tls]\nca_file = \"{d}/ca.pem\"\n"),
                "etcd.tls: only applies to https://",
            ),
            (format!("{HTTPS}password = \"pw\"\n"), "etcd.password: is never written in the config"),
            (format!("{HTTPS}username = \"u\"\n"), "etcd.password_file: etcd.username needs its password"),
            (format!("{HTTPS}password_file = \"{d}/password\"\n"), "etcd.username: etcd.password_file needs"),
            (format!("{HTTPS}username = \"\"\npassword_file = \"{d}/password\"\n"), "etcd.username: must not be empty"),
            (user("missing"), "etcd.password_file:"),
            (user("empty"), "the file is empty"),
            (format!("{HTTPS}[etcd.tls]\ncert_file = \"{d}/cert.pem\"\n"), "etcd.tls.key_file"),
            (format!("{HTTPS}[etcd.tls]\nkey_file = \"{d}/key.pem\"\n"), "etcd.tls.cert_file"),
            (format!("{HTTPS}[etcd.tls]\nserver_name = \"not a name\"\n"), "etcd.tls.server_name"),
            (format!("{HTTPS}[etcd.tls]\nca_file = \"{d}/missing.pem\"\n"), "etcd.tls: "),
            (format!("{HTTPS}[etcd.tls]\nca_file = \"{d}/key.pem\"\n"), "no certificate"),
            (format!("{HTTPS}[etcd.tls]\ncafile = \"{d}/ca.pem\"\n"), "cafile"),
        ] {
            let err = load(&extra).unwrap_err();
            assert!(err.contains(says), "{extra}: {err}");
        }
    }

    #[test]
    fn a_changed_password_needs_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        pem_files(dir.path());
        let text = format!(
            "[etcd]\nendpoints = [\"http://127.0.0.1:2379\"]\nusername = \"u\"\npassword_file = \"{}\"\n",
            dir.path().join("password").display()
        );
        let old = load(&text).unwrap();
        std::fs::write(dir.path().join("password"), "another\n").unwrap();
        let (merged, report) = crate::config::reload::merge(&old, load(&text).unwrap());
        assert_eq!(report.kept, ["etcd.password: (changed)"]);
        assert_eq!(merged.etcd.password, Some(Password::new("s3cret pass")), "the running one is kept");
    }
}
