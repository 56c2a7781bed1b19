//! TLS to PostgreSQL with libpq's `sslmode` meanings: `disable` (plain text), `prefer` (the
//! default: TLS when the server offers it), `require` (TLS or no connection), and `verify-ca` /
//! `verify-full` (TLS, and the server's certificate verified). As in libpq, `prefer` and
//! `require` encrypt without verifying who answers, unless CA certificates are configured
//! (`postgres_ca_file`, libpq's `sslrootcert`): then the certificate is verified as with
//! `verify-full`. Verifying follows the broker's rules (the CA file, else the system's trust
//! store; the connection's host name; `amqp_outbox_broker::tls_client_config`).
//!
//! The `postgres` client knows only `disable`, `prefer` and `require`: the two verifying modes
//! are read here and handed to it as `require`.

use crate::config::PostgresTls;
use amqp_outbox_broker::TlsOptions;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use std::sync::Arc;
use tokio_postgres_rustls::MakeRustlsConnect;

/// `url` with `sslmode=verify-ca` or `sslmode=verify-full` (written without spaces, in a URL's
/// query or as a keyword) turned into `sslmode=require`, and whether one of them was there.
pub fn verifying_mode(url: &str) -> (String, bool) {
    let mut verify = false;
    let mut out = url.to_owned();
    for mode in ["sslmode=verify-full", "sslmode=verify-ca"] {
        if out.contains(mode) {
            verify = true;
            out = out.replace(mode, "sslmode=require");
        }
    }
    (out, verify)
}

/// The connector for a connection to `host`: verifying when asked (`verify`) or when CA
/// certificates are configured, encrypting only otherwise.
pub fn connector(tls: &PostgresTls, verify: bool, host: &str) -> Result<MakeRustlsConnect, String> {
    let config = if verify || tls.ca_file.is_some() {
        let options = TlsOptions {
            ca_file: tls.ca_file.clone(),
            cert_file: tls.cert_file.clone(),
            key_file: tls.key_file.clone(),
            server_name: None,
        };
        amqp_outbox_broker::tls_client_config(&options, host)?
    } else {
        if tls.cert_file.is_some() || tls.key_file.is_some() {
            return Err(
                "a client certificate (postgres_cert_file) is shown only to a verified server: \
                 use sslmode=verify-full or set postgres_ca_file"
                    .into(),
            );
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS configuration: {e}"))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(EncryptOnly(provider)))
            .with_no_client_auth()
    };
    Ok(MakeRustlsConnect::new(config))
}

/// `prefer` and `require` without CA certificates, as libpq: any certificate is accepted, the
/// handshake's signatures are still checked (the session is encrypted to whoever holds the
/// certificate's key).
#[derive(Debug)]
struct EncryptOnly(Arc<CryptoProvider>);

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifying_modes_become_require_and_say_so() {
        assert_eq!(
            verifying_mode("postgresql://u@h/d?sslmode=verify-full"),
            ("postgresql://u@h/d?sslmode=require".into(), true)
        );
        assert_eq!(
            verifying_mode("host=h sslmode=verify-ca dbname=d"),
            ("host=h sslmode=require dbname=d".into(), true)
        );
        assert_eq!(
            verifying_mode("host=h sslmode=require"),
            ("host=h sslmode=require".into(), false)
        );
    }

    #[test]
    fn a_client_certificate_needs_a_verified_server() {
        let tls = PostgresTls {
            cert_file: Some("c.pem".into()),
            key_file: Some("k.pem".into()),
            ..PostgresTls::default()
        };
        let e = connector(&tls, false, "h").err().expect("refused");
        assert!(e.contains("verify-full"), "{e}");
        assert!(connector(&PostgresTls::default(), false, "h").is_ok());
    }
}
