//! TLS with rustls, the crypto provider chosen explicitly (ring): the HTTPS listener (ALPN h2
//! and http/1.1, optional client-certificate verification) and the client side of an
//! `https://` backend (its CA or the system roots, optional client certificate for mTLS).
//! PEM files are read with rustls-pki-types.

use std::path::Path;
use std::sync::Arc;

use rustls::crypto::{CryptoProvider, ring};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

fn provider() -> Arc<CryptoProvider> {
    Arc::new(ring::default_provider())
}

/// Every certificate in a PEM file (at least one).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate in this PEM file", path.display()));
    }
    Ok(certs)
}

/// The private key in a PEM file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn roots(certs: Vec<CertificateDer<'static>>) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots.add(cert).map_err(|e| e.to_string())?;
    }
    Ok(roots)
}

/// The listener's TLS configuration; with `client_ca`, only clients holding a certificate it
/// signed may connect.
pub fn server_config(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Arc<ServerConfig>, String> {
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match client_ca {
        Some(ca) => {
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots(load_certs(ca)?)?), provider())
                .build()
                .map_err(|e| format!("{}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(load_certs(cert)?, load_key(key)?)
        .map_err(|e| format!("{} and {}: {e}", cert.display(), key.display()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The backend client's TLS configuration: trust `ca` (or the system's roots), and present
/// `cert` and `key` when given.
pub fn client_config(ca: Option<&Path>, cert: Option<&Path>, key: Option<&Path>) -> Result<ClientConfig, String> {
    let trusted = match ca {
        Some(ca) => roots(load_certs(ca)?)?,
        None => {
            let mut store = RootCertStore::empty();
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = store.add(cert); // a system store may hold certificates rustls rejects
            }
            store
        }
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(trusted);
    match (cert, key) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(|e| format!("{} and {}: {e}", cert.display(), key.display())),
        (None, None) => Ok(builder.with_no_client_auth()),
        _ => Err("a client certificate needs both cert and key".into()),
    }
}
