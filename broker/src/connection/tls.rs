//! TLS (`amqps`) for one host: a rustls client configuration (ring provider) built from the
//! host's [`TlsOptions`] at every connection attempt (so renewed certificates are picked up on
//! reconnection), and the lapin connection over it.
//!
//! - The server's certificate is always verified: against the configured CA file only when one
//!   is set, otherwise against the system's trust store. The name verified is `server_name`,
//!   else the host. There is no option to turn either check off.
//! - A client certificate (`cert_file` + `key_file`) is sent when configured.
//! - No fallback: when TLS is configured, the stream given to lapin is TLS or the attempt
//!   fails; a plaintext connection is never tried.
//! - Errors name the cause (unknown CA, name mismatch, expired, unreadable file…) and never
//!   contain file contents (a key file's bytes must not reach a log).

use super::errors::describe_error;
use crate::config::{Endpoint, TlsOptions};
use lapin::tcp::{AMQPUriTcpExt, RustlsConnector, TLSConfig};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{AlertDescription, CertificateError, ClientConfig, RootCertStore};
use std::io;
use std::sync::Arc;

/// Everything a TLS connection attempt needs, prepared before any socket is opened.
pub(crate) struct TlsSetup {
    pub(crate) config: ClientConfig,
    /// The name the server's certificate must carry.
    pub(crate) server_name: String,
}

/// Opens a lapin connection to `ep`: plaintext `amqp` when `ep.tls` is `None`, otherwise
/// `amqps` with the host's TLS settings. `sanitize`: the broker's bytes reach lapin through
/// [`super::relay`] (a consumer's: see [`super::sanitize`]). The error is described for a log
/// line (the caller removes passwords, and bounds the whole with its connect timeout).
pub(crate) async fn connect(
    ep: &Endpoint,
    uri: AMQPUri,
    props: ConnectionProperties,
    sanitize: bool,
) -> Result<Connection, String> {
    let setup = match &ep.tls {
        None if !sanitize => {
            return Connection::connect_uri(uri, props)
                .await
                .map_err(|e| describe_error(&e));
        }
        None => None,
        Some(opts) => Some(prepare(opts, &ep.host).map_err(|e| format!("TLS setup: {e}"))?),
    };
    let server_name = setup.as_ref().map(|s| s.server_name.clone());
    let sends_client_cert = ep.tls.as_ref().is_some_and(|o| o.cert_file.is_some());
    connect_via(uri, setup, props, sanitize)
        .await
        .map_err(|e| match &server_name {
            Some(name) => describe_connect_error(&e, name, sends_client_cert),
            None => describe_error(&e),
        })
}

async fn connect_via(
    uri: AMQPUri,
    setup: Option<TlsSetup>,
    props: ConnectionProperties,
    sanitize: bool,
) -> lapin::Result<Connection> {
    let tls = setup.map(|s| (RustlsConnector::from(s.config), s.server_name));
    let runtime = lapin::runtime::default_runtime()?;
    Connection::connector(
        uri,
        runtime,
        async move |uri: AMQPUri, runtime| {
            // TCP first (the scheme only decides whether lapin's own TLS is applied: it is
            // not, ours is), then the handshake with our verifier. Any failure ends the attempt.
            let mut tcp = uri;
            tcp.scheme = AMQPScheme::AMQP;
            let plain = tcp
                .connect_with_config_async(TLSConfig::default(), &runtime)
                .await?;
            let real =
                match &tls {
                    None => plain,
                    Some((connector, server_name)) => plain
                        .into_rustls(connector, server_name)
                        .await
                        .map_err(|e| lapin::Error::from(handshake_error(e, server_name)))?,
                };
            if !sanitize {
                return Ok(real);
            }
            let rt = &runtime;
            super::relay::sanitized(real, |lo: AMQPUri| async move {
                lo.connect_with_config_async(TLSConfig::default(), rt).await
            })
            .await
            .map_err(lapin::Error::from)
        },
        props,
    )
    .await
}

/// The rustls client configuration and server name of `opts` for a connection to `host`.
/// The client configuration [`prepare`] makes, for a client other than lapin (the relay's
/// connections to PostgreSQL): the same trust rules, the same client certificate handling.
pub fn client_config(opts: &TlsOptions, host: &str) -> Result<ClientConfig, String> {
    prepare(opts, host).map(|setup| setup.config)
}

pub(crate) fn prepare(opts: &TlsOptions, host: &str) -> Result<TlsSetup, String> {
    let server_name = match opts.server_name.as_deref().map(str::trim) {
        Some(name) if !name.is_empty() => name.to_string(),
        _ => host.to_string(),
    };
    ServerName::try_from(server_name.clone())
        .map_err(|e| format!("\"{server_name}\" is not a valid TLS server name: {e}"))?;

    let roots = match &opts.ca_file {
        Some(path) => {
            let mut roots = RootCertStore::empty();
            for cert in read_certs(path, "CA file")? {
                roots
                    .add(cert)
                    .map_err(|e| format!("CA file {path}: unusable certificate: {e}"))?;
            }
            roots
        }
        None => system_roots()?,
    };

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS configuration: {e}"))?
        .with_root_certificates(roots);
    let config = match (&opts.cert_file, &opts.key_file) {
        (None, None) => builder.with_no_client_auth(),
        (Some(cert_file), Some(key_file)) => {
            let certs = read_certs(cert_file, "client certificate file")?;
            let key = read_key(key_file)?;
            builder.with_client_auth_cert(certs, key).map_err(|e| {
                format!("client certificate {cert_file} and key {key_file} are not usable: {e}")
            })?
        }
        (Some(_), None) => {
            return Err("a client certificate file is set without a key file".into());
        }
        (None, Some(_)) => {
            return Err("a client key file is set without a certificate file".into());
        }
    };
    Ok(TlsSetup {
        config,
        server_name,
    })
}

fn read_file(path: &str, what: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {what} {path}: {e}"))
}

/// Every certificate of a PEM file; an error when it has none.
fn read_certs(path: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read_file(path, what)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{what} {path}: invalid PEM: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{what} {path} contains no PEM certificate"));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1). The error never quotes the file.
fn read_key(path: &str) -> Result<PrivateKeyDer<'static>, String> {
    let pem = read_file(path, "client key file")?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => {
            format!("client key file {path} contains no PEM private key")
        }
        _ => format!("client key file {path}: invalid PEM private key"),
    })
}

fn system_roots() -> Result<RootCertStore, String> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    roots.add_parsable_certificates(found.certs);
    if roots.is_empty() {
        let why = found
            .errors
            .first()
            .map(|e| format!(" ({e})"))
            .unwrap_or_default();
        return Err(format!(
            "no CA certificate found in the system's trust store{why}; set the CA file"
        ));
    }
    Ok(roots)
}

/// A failed handshake as an I/O error whose text names the cause.
fn handshake_error(e: io::Error, server_name: &str) -> io::Error {
    let text = match explain(&e, server_name) {
        Some(why) => format!("TLS handshake failed: {why} ({e})"),
        None => format!("TLS handshake failed: {e}"),
    };
    io::Error::new(e.kind(), text)
}

/// A connection error; TLS errors that surface after the handshake (with TLS 1.3 the server
/// refuses a client certificate only then) are explained too.
fn describe_connect_error(e: &lapin::Error, server_name: &str, sends_client_cert: bool) -> String {
    let text = describe_error(e);
    if let lapin::ErrorKind::IOError(io) = e.kind() {
        if !text.contains("TLS handshake failed") {
            if let Some(why) = explain(io, server_name) {
                return format!("TLS error: {why} ({text})");
            }
            // The server's "certificate required" alert races with its closing the socket:
            // the client may see only the reset. Name the likely cause rather than a bare reset.
            if !sends_client_cert && closed_by_peer(io.kind()) {
                return format!(
                    "TLS error: the server closed the connection right after the handshake; \
                     if it requires a client certificate, set the client certificate and key \
                     files ({text})"
                );
            }
        }
    }
    text
}

fn closed_by_peer(kind: io::ErrorKind) -> bool {
    matches!(
        kind,
        io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::BrokenPipe
    )
}

/// What a rustls error inside `e` means, in words an administrator can act on.
pub(crate) fn explain(e: &io::Error, server_name: &str) -> Option<String> {
    let tls = e.get_ref()?.downcast_ref::<rustls::Error>()?;
    Some(explain_rustls(tls, server_name))
}

pub(crate) fn explain_rustls(e: &rustls::Error, server_name: &str) -> String {
    use rustls::Error as E;
    match e {
        E::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer => "the server's certificate is not signed by a \
                 trusted CA (unknown issuer): check the CA file"
                .to_string(),
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                format!(
                    "the server's certificate is not valid for the name \"{server_name}\" \
                     (name mismatch): connect by a name the certificate carries, or set the \
                     expected server name"
                )
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                "the server's certificate has expired".to_string()
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "the server's certificate is not valid yet (check the clocks)".to_string()
            }
            CertificateError::Revoked => "the server's certificate is revoked".to_string(),
            CertificateError::BadSignature => {
                "the server's certificate has a bad signature".to_string()
            }
            _ => "the server's certificate was refused".to_string(),
        },
        E::AlertReceived(alert) => match alert {
            AlertDescription::CertificateRequired => "the server requires a client certificate: \
                 set the client certificate and key files"
                .to_string(),
            AlertDescription::UnknownCA
            | AlertDescription::BadCertificate
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateRevoked
            | AlertDescription::AccessDenied => {
                format!("the server refused the client certificate (alert {alert:?})")
            }
            AlertDescription::HandshakeFailure => "the server refused the handshake (no common \
                 protocol version or cipher, or it requires a client certificate)"
                .to_string(),
            _ => format!("the server ended the handshake (alert {alert:?})"),
        },
        E::InvalidMessage(_) | E::InappropriateMessage { .. } => {
            "the server did not answer with TLS (is this a plaintext AMQP port?)".to_string()
        }
        E::NoCertificatesPresented => "the server presented no certificate".to_string(),
        _ => "TLS error".to_string(),
    }
}

/// The scheme of a host's connections.
pub(crate) fn scheme_of(ep: &Endpoint) -> AMQPScheme {
    if ep.tls.is_some() {
        AMQPScheme::AMQPS
    } else {
        AMQPScheme::AMQP
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn tmp(name: &str, content: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ao_tls_unit_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, content).unwrap();
        p
    }

    fn opts() -> TlsOptions {
        TlsOptions::default()
    }

    fn err(o: &TlsOptions, host: &str) -> String {
        match prepare(o, host) {
            Ok(_) => panic!("prepare succeeded"),
            Err(e) => e,
        }
    }

    #[test]
    fn server_name_defaults_to_host_and_can_be_overridden() {
        let ca = tmp("ca_for_names.pem", TEST_CA.as_bytes());
        let mut o = opts();
        o.ca_file = Some(ca.display().to_string());
        assert_eq!(prepare(&o, "127.0.0.1").unwrap().server_name, "127.0.0.1");
        assert_eq!(prepare(&o, "rabbit.lan").unwrap().server_name, "rabbit.lan");
        o.server_name = Some("  ".into());
        assert_eq!(prepare(&o, "rabbit.lan").unwrap().server_name, "rabbit.lan");
        o.server_name = Some("broker.example".into());
        assert_eq!(
            prepare(&o, "10.0.0.1").unwrap().server_name,
            "broker.example"
        );
        o.server_name = Some("not a name!".into());
        assert!(err(&o, "h").contains("not a valid TLS server name"));
    }

    #[test]
    fn missing_or_unusable_files_are_clear_errors() {
        let mut o = opts();
        o.ca_file = Some("/nonexistent/ao/ca.pem".into());
        let e = err(&o, "localhost");
        assert!(
            e.contains("cannot read CA file /nonexistent/ao/ca.pem"),
            "{e}"
        );

        let empty = tmp("empty.pem", b"hello, no certificate here\n");
        o.ca_file = Some(empty.display().to_string());
        let e = err(&o, "localhost");
        assert!(e.contains("contains no PEM certificate"), "{e}");

        let bad = tmp(
            "bad.pem",
            b"-----BEGIN CERTIFICATE-----\nnot base64 !!\n-----END CERTIFICATE-----\n",
        );
        o.ca_file = Some(bad.display().to_string());
        let e = err(&o, "localhost");
        assert!(e.contains("invalid PEM") || e.contains("unusable"), "{e}");

        let ca = tmp("ca.pem", TEST_CA.as_bytes());
        o.ca_file = Some(ca.display().to_string());
        assert!(prepare(&o, "localhost").is_ok());

        o.cert_file = Some(ca.display().to_string());
        let e = err(&o, "localhost");
        assert!(e.contains("without a key file"), "{e}");
        o.cert_file = None;
        o.key_file = Some("/nonexistent/ao/key.pem".into());
        let e = err(&o, "localhost");
        assert!(e.contains("without a certificate file"), "{e}");

        o.cert_file = Some(ca.display().to_string());
        let e = err(&o, "localhost");
        assert!(
            e.contains("cannot read client key file /nonexistent/ao/key.pem"),
            "{e}"
        );

        // A "key" file that is not a key: named, never quoted.
        let secret = tmp("notakey.pem", b"super-secret-bytes\n");
        o.key_file = Some(secret.display().to_string());
        let e = err(&o, "localhost");
        assert!(e.contains("contains no PEM private key"), "{e}");
        assert!(!e.contains("super-secret"), "{e}");

        o.cert_file = Some("/nonexistent/ao/cert.pem".into());
        let e = err(&o, "localhost");
        assert!(
            e.contains("cannot read client certificate file /nonexistent/ao/cert.pem"),
            "{e}"
        );
    }

    #[test]
    fn system_trust_store_is_used_without_a_ca_file() {
        // Either the machine has CA certificates, or the error says there are none.
        match prepare(&opts(), "localhost") {
            Ok(s) => assert_eq!(s.server_name, "localhost"),
            Err(e) => assert!(e.contains("system's trust store"), "{e}"),
        }
    }

    #[test]
    fn rustls_errors_are_explained() {
        use rustls::Error as E;
        let unknown = explain_rustls(&E::InvalidCertificate(CertificateError::UnknownIssuer), "h");
        assert!(unknown.contains("unknown issuer"), "{unknown}");
        let name = explain_rustls(
            &E::InvalidCertificate(CertificateError::NotValidForName),
            "127.0.0.1",
        );
        assert!(name.contains("name mismatch") && name.contains("127.0.0.1"));
        let expired = explain_rustls(&E::InvalidCertificate(CertificateError::Expired), "h");
        assert!(expired.contains("expired"));
        let required = explain_rustls(
            &E::AlertReceived(AlertDescription::CertificateRequired),
            "h",
        );
        assert!(required.contains("requires a client certificate"));
        let io = io::Error::new(
            io::ErrorKind::InvalidData,
            E::InvalidCertificate(CertificateError::UnknownIssuer),
        );
        let wrapped = handshake_error(io, "h").to_string();
        assert!(wrapped.starts_with("TLS handshake failed: "), "{wrapped}");
        assert!(wrapped.contains("unknown issuer"), "{wrapped}");
        assert!(explain(&io::Error::other("plain"), "h").is_none());
    }

    #[test]
    fn scheme_follows_tls() {
        let mut ep = Endpoint {
            host: "h".into(),
            port: 5671,
            vhost: "/".into(),
            username: "u".into(),
            password: "p".into(),
            tls: None,
        };
        assert_eq!(scheme_of(&ep), AMQPScheme::AMQP);
        ep.tls = Some(opts());
        assert_eq!(scheme_of(&ep), AMQPScheme::AMQPS);
    }

    #[test]
    fn a_reset_after_the_handshake_names_the_missing_client_certificate() {
        let reset: lapin::Error =
            io::Error::new(io::ErrorKind::ConnectionReset, "Connection reset by peer").into();
        let without_cert = describe_connect_error(&reset, "h", false);
        assert!(without_cert.contains("TLS error"), "{without_cert}");
        assert!(
            without_cert.contains("client certificate"),
            "{without_cert}"
        );
        assert!(
            without_cert.contains("Connection reset by peer"),
            "{without_cert}"
        );
        let with_cert = describe_connect_error(&reset, "h", true);
        assert!(!with_cert.contains("client certificate"), "{with_cert}");
        let refused: lapin::Error =
            io::Error::new(io::ErrorKind::ConnectionRefused, "refused").into();
        assert!(!describe_connect_error(&refused, "h", false).contains("TLS"));
    }

    /// A self-signed CA certificate (no key needed: only parsed here).
    const TEST_CA: &str = include_str!("../../tests/data/unit_ca.pem");
}
