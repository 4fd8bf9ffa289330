//! TLS settings read from PEM files, shared by the peer transport and the
//! client API: [`TlsFiles`] names the files (etcd's `--cert-file`,
//! `--key-file`, `--trusted-ca-file`, `--client-cert-auth` and their
//! `--peer-` twins), [`TlsConfig`] is what they hold once checked, and
//! [`ReloadableTls`] keeps the one in force and replaces it when the files
//! change (or on SIGHUP, through [`ReloadableTls::reload`]).
//!
//! rustls with its `ring` crypto provider does the work: no OpenSSL, and
//! unlike rustls' default provider (aws-lc-rs) `ring` builds with nothing
//! but a C compiler, no cmake. Every config is built with that provider
//! explicitly, so that no process-wide default has to be installed.
//!
//! A reload builds the new config completely before it replaces the old
//! one: files that are missing, half written or do not match keep the
//! previous config in force, and the error is logged. Connections that are
//! open keep the config they were made with; new handshakes use the new one.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, ServerConfig};

/// The files of one side's TLS settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// This node's certificate chain, PEM, its own certificate first.
    pub cert: PathBuf,
    /// The private key of that certificate, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA certificates, PEM, that the other end's certificate must be
    /// signed by (clients' with `client_cert_auth`; peers' always).
    pub trusted_ca: Option<PathBuf>,
    /// Whether connecting clients must present a certificate signed by
    /// `trusted_ca` (etcd's `--client-cert-auth`, `--peer-client-cert-auth`).
    pub client_cert_auth: bool,
}

/// Why TLS settings could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// A file is not the PEM it should be.
    #[error("{}: {reason}", path.display())]
    BadPem {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The private key is not the certificate's.
    #[error("the key in {} does not match the certificate in {}", key.display(), cert.display())]
    KeyMismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
    },
    /// Client certificates are to be verified, but against no CA.
    #[error("{0} needs a trusted CA file to verify certificates against")]
    NoTrustedCa(&'static str),
    /// rustls refused the settings.
    #[error("TLS settings refused: {0}")]
    Rustls(#[from] rustls::Error),
}

/// Checked TLS settings: the server side, and the client side used to dial
/// peers (present when a trusted CA is given).
pub struct TlsConfig {
    server: Arc<ServerConfig>,
    client: Option<Arc<ClientConfig>>,
    /// A short description of the certificate, for the log.
    summary: String,
}

impl fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConfig")
            .field("certificate", &self.summary)
            .field("client", &self.client.is_some())
            .finish()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| TlsError::BadPem {
            path: path.to_path_buf(),
            reason: format!("not a PEM certificate file: {error}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::BadPem {
            path: path.to_path_buf(),
            reason: "holds no certificate (no BEGIN CERTIFICATE block)".to_string(),
        });
    }
    Ok(certs)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|error| TlsError::BadPem {
        path: path.to_path_buf(),
        reason: format!("holds no usable private key: {error}"),
    })
}

fn roots(path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certificates(path)? {
        store.add(cert).map_err(|error| TlsError::BadPem {
            path: path.to_path_buf(),
            reason: format!("not a usable CA certificate: {error}"),
        })?;
    }
    Ok(Arc::new(store))
}

impl TlsConfig {
    /// Reads and checks `files`. `alpn` are the protocols the server side
    /// offers (`h2` for gRPC; none for peers). `what` names the settings in
    /// errors (`--client-cert-auth`, `--peer-client-cert-auth`).
    pub fn load(
        files: &TlsFiles,
        alpn: &[&[u8]],
        what: &'static str,
    ) -> Result<TlsConfig, TlsError> {
        let provider = provider();
        let certs = certificates(&files.cert)?;
        let key = private_key(&files.key)?;
        // Checked here so that the error names both files; rustls would
        // only say that the keys are inconsistent.
        let certified =
            CertifiedKey::from_der(certs.clone(), key.clone_key(), &provider).map_err(|error| {
                match error {
                    rustls::Error::InconsistentKeys(_) => TlsError::KeyMismatch {
                        cert: files.cert.clone(),
                        key: files.key.clone(),
                    },
                    other => TlsError::BadPem {
                        path: files.key.clone(),
                        reason: format!("the key cannot be used: {other}"),
                    },
                }
            })?;
        certified.keys_match().map_err(|_| TlsError::KeyMismatch {
            cert: files.cert.clone(),
            key: files.key.clone(),
        })?;
        let roots = files.trusted_ca.as_deref().map(roots).transpose()?;
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = if files.client_cert_auth {
            let roots = roots.clone().ok_or(TlsError::NoTrustedCa(what))?;
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .map_err(|error| TlsError::BadPem {
                    path: files.trusted_ca.clone().unwrap_or_default(),
                    reason: format!("cannot verify clients with these CAs: {error}"),
                })?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let mut server = builder.with_single_cert(certs.clone(), key.clone_key())?;
        server.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let client = match roots {
            Some(roots) => Some(Arc::new(
                ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()?
                    .with_root_certificates(roots)
                    .with_client_auth_cert(certs.clone(), key)?,
            )),
            None => None,
        };
        let summary = certs
            .first()
            .and_then(common_name)
            .map_or_else(|| "no common name".to_string(), |cn| format!("CN={cn}"));
        Ok(TlsConfig {
            server: Arc::new(server),
            client,
            summary,
        })
    }

    /// The server side: for accepting connections.
    pub fn server(&self) -> Arc<ServerConfig> {
        self.server.clone()
    }

    /// The client side: for dialing peers, presenting this certificate and
    /// verifying theirs against the trusted CA (`None` without one).
    pub fn client(&self) -> Option<Arc<ClientConfig>> {
        self.client.clone()
    }
}

/// The settings of a client that dials a TLS port: the server's certificate
/// is verified against `trusted_ca`, and `identity` (certificate and key
/// files) is presented if given.
pub fn client_config(
    trusted_ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, TlsError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(trusted_ca)?);
    let mut config = match identity {
        Some((cert, key)) => {
            builder.with_client_auth_cert(certificates(cert)?, private_key(key)?)?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// When a file was last changed, and its size: what a reload watch looks at.
type Stamp = Option<(SystemTime, u64)>;

fn stamp(path: &Path) -> Stamp {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// TLS settings that can be replaced while connections use them.
pub struct ReloadableTls {
    name: &'static str,
    files: TlsFiles,
    alpn: Vec<Vec<u8>>,
    current: RwLock<Arc<TlsConfig>>,
    stamps: Mutex<Vec<Stamp>>,
}

impl fmt::Debug for ReloadableTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReloadableTls")
            .field("name", &self.name)
            .field("files", &self.files)
            .finish()
    }
}

impl ReloadableTls {
    /// Loads `files` (see [`TlsConfig::load`]); `name` says which side they
    /// are for in the log and in errors ("client", "peer").
    pub fn load(
        name: &'static str,
        files: TlsFiles,
        alpn: &[&[u8]],
    ) -> Result<Arc<ReloadableTls>, TlsError> {
        let what = if name == "peer" {
            "--peer-client-cert-auth"
        } else {
            "--client-cert-auth"
        };
        let stamps = Self::stamps_of(&files);
        let config = TlsConfig::load(&files, alpn, what)?;
        tracing::info!(side = name, certificate = %config.summary, "TLS certificates loaded");
        Ok(Arc::new(ReloadableTls {
            name,
            files,
            alpn: alpn.iter().map(|p| p.to_vec()).collect(),
            current: RwLock::new(Arc::new(config)),
            stamps: Mutex::new(stamps),
        }))
    }

    fn stamps_of(files: &TlsFiles) -> Vec<Stamp> {
        let mut paths = vec![files.cert.as_path(), files.key.as_path()];
        paths.extend(files.trusted_ca.as_deref());
        paths.into_iter().map(stamp).collect()
    }

    /// The settings in force now.
    pub fn current(&self) -> Arc<TlsConfig> {
        // A poisoned lock only means a reader panicked; the Arc is whole.
        self.current.read().map_or_else(
            |poisoned| poisoned.into_inner().clone(),
            |guard| guard.clone(),
        )
    }

    /// The files these settings come from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Reads the files again. On success the new settings are used by every
    /// handshake from now on; on failure the previous ones stay in force.
    /// Either way the outcome is logged.
    pub fn reload(&self) -> Result<(), TlsError> {
        let what = if self.name == "peer" {
            "--peer-client-cert-auth"
        } else {
            "--client-cert-auth"
        };
        let stamps = Self::stamps_of(&self.files);
        if let Ok(mut known) = self.stamps.lock() {
            *known = stamps;
        }
        let alpn: Vec<&[u8]> = self.alpn.iter().map(|p| p.as_slice()).collect();
        match TlsConfig::load(&self.files, &alpn, what) {
            Ok(config) => {
                tracing::info!(side = self.name, certificate = %config.summary, "TLS certificates reloaded; new connections use them");
                let config = Arc::new(config);
                match self.current.write() {
                    Ok(mut guard) => *guard = config,
                    Err(poisoned) => *poisoned.into_inner() = config,
                }
                Ok(())
            }
            Err(error) => {
                tracing::warn!(side = self.name, %error, "cannot reload the TLS certificates; keeping the previous ones");
                Err(error)
            }
        }
    }

    /// Reloads if any of the files changed since the last load.
    pub fn reload_if_changed(&self) {
        let now = Self::stamps_of(&self.files);
        let changed = self.stamps.lock().map_or(true, |known| *known != now);
        if changed {
            let _ = self.reload();
        }
    }
}

/// Watches the files of `configs` and reloads one whenever its files
/// change, every `interval`, until the task is aborted.
pub fn spawn_reload_watch(
    configs: Vec<Arc<ReloadableTls>>,
    interval: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            for config in &configs {
                // Reading a few small files; not worth a blocking thread.
                config.reload_if_changed();
            }
        }
    })
}

/// The server name to verify a peer at `addr` ("host:port") by: the host,
/// an IP address or a DNS name its certificate must carry.
pub fn server_name(addr: &str) -> Option<ServerName<'static>> {
    let host = match addr.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => host,
        _ => addr,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string()).ok()
}

/// The common name (CN) of a certificate's subject, if it has one that is
/// a string.
pub fn common_name(cert: &CertificateDer<'_>) -> Option<String> {
    use x509_cert::der::asn1::{PrintableStringRef, Utf8StringRef};
    use x509_cert::der::{Decode, Tagged};
    let cert = x509_cert::Certificate::from_der(cert.as_ref()).ok()?;
    let cn = x509_cert::der::oid::db::rfc4519::CN;
    for rdn in cert.tbs_certificate.subject.0.iter() {
        for attribute in rdn.0.iter() {
            if attribute.oid != cn {
                continue;
            }
            let value = &attribute.value;
            let text = match value.tag() {
                x509_cert::der::Tag::Utf8String => Utf8StringRef::try_from(value)
                    .ok()
                    .map(|s| s.as_str().to_string()),
                x509_cert::der::Tag::PrintableString => PrintableStringRef::try_from(value)
                    .ok()
                    .map(|s| s.as_str().to_string()),
                _ => None,
            };
            if text.is_some() {
                return text;
            }
        }
    }
    None
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) struct Issued {
        pub cert_pem: String,
        pub key_pem: String,
    }

    pub(crate) fn ca() -> (rcgen::Issuer<'static, rcgen::KeyPair>, String) {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "test CA");
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        (rcgen::Issuer::new(params, key), cert.pem())
    }

    pub(crate) fn issue(issuer: &rcgen::Issuer<'static, rcgen::KeyPair>, cn: &str) -> Issued {
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
                .unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, issuer).unwrap();
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    pub(crate) fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    pub(crate) fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ferry-tls-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn bad_files_are_typed_errors_naming_the_file() {
        let dir = temp_dir("errors");
        let (issuer, ca_pem) = ca();
        let a = issue(&issuer, "a");
        let b = issue(&issuer, "b");
        let files = TlsFiles {
            cert: write(&dir, "a.crt", &a.cert_pem),
            key: write(&dir, "b.key", &b.key_pem),
            trusted_ca: Some(write(&dir, "ca.crt", &ca_pem)),
            client_cert_auth: true,
        };
        let error = TlsConfig::load(&files, &[], "--client-cert-auth").unwrap_err();
        assert!(matches!(error, TlsError::KeyMismatch { .. }), "{error}");
        assert!(error.to_string().contains("b.key"), "{error}");

        let missing = TlsFiles {
            cert: dir.join("nope.crt"),
            ..files.clone()
        };
        let error = TlsConfig::load(&missing, &[], "--client-cert-auth").unwrap_err();
        assert!(matches!(error, TlsError::Read { .. }), "{error}");
        assert!(error.to_string().contains("nope.crt"), "{error}");

        let garbage = TlsFiles {
            cert: write(&dir, "garbage.crt", "hello"),
            ..files.clone()
        };
        let error = TlsConfig::load(&garbage, &[], "--client-cert-auth").unwrap_err();
        assert!(matches!(error, TlsError::BadPem { .. }), "{error}");

        let good = TlsFiles {
            key: write(&dir, "a.key", &a.key_pem),
            ..files.clone()
        };
        let no_ca = TlsFiles {
            trusted_ca: None,
            ..good.clone()
        };
        let error = TlsConfig::load(&no_ca, &[], "--client-cert-auth").unwrap_err();
        assert!(matches!(error, TlsError::NoTrustedCa(_)), "{error}");

        let config = TlsConfig::load(&good, &[b"h2"], "--client-cert-auth").unwrap();
        assert!(config.client().is_some());
        assert_eq!(config.summary, "CN=a");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failed_reload_keeps_the_previous_settings() {
        let dir = temp_dir("reload");
        let (issuer, ca_pem) = ca();
        let a = issue(&issuer, "first");
        let files = TlsFiles {
            cert: write(&dir, "n.crt", &a.cert_pem),
            key: write(&dir, "n.key", &a.key_pem),
            trusted_ca: Some(write(&dir, "ca.crt", &ca_pem)),
            client_cert_auth: false,
        };
        let tls = ReloadableTls::load("client", files, &[]).unwrap();
        // Half a rotation: the new certificate without its key.
        let b = issue(&issuer, "second");
        write(&dir, "n.crt", &b.cert_pem);
        assert!(tls.reload().is_err());
        assert_eq!(tls.current().summary, "CN=first");
        write(&dir, "n.key", &b.key_pem);
        tls.reload().unwrap();
        assert_eq!(tls.current().summary, "CN=second");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn server_names_come_from_peer_addresses() {
        assert!(matches!(
            server_name("127.0.0.1:2380"),
            Some(ServerName::IpAddress(_))
        ));
        assert!(matches!(
            server_name("[::1]:2380"),
            Some(ServerName::IpAddress(_))
        ));
        assert!(matches!(
            server_name("node-1.example:2380"),
            Some(ServerName::DnsName(_))
        ));
    }
}
