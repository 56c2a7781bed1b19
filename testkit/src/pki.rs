//! Certificates for the TLS tests, made with `openssl` in a directory of their own (removed on
//! drop): two unrelated CAs, certificates for "localhost" signed by the first (one valid, one
//! that expired yesterday), and a client certificate.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Whether `openssl` can be run here.
pub fn openssl_installed() -> bool {
    Command::new("openssl")
        .arg("version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn openssl(dir: &Path, args: &[&str]) -> Result<(), String> {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|e| format!("cannot run openssl: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

const SERVER_EXT: &str = "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n\
                          extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost\n";
const CLIENT_EXT: &str = "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n\
                          extendedKeyUsage=clientAuth\n";

/// The files, by name: `ca.pem` and `other_ca.pem` (CAs); `server.pem`/`server.key` (for
/// "localhost", signed by `ca.pem`); `expired.pem`/`expired.key` (the same, expired);
/// `client.pem`/`client.key` (client authentication, signed by `ca.pem`).
pub struct Pki {
    dir: PathBuf,
}

impl Pki {
    pub fn make() -> Result<Pki, String> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "amqp_outbox_pki.{}.{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        // Dropped on any error below, which removes the directory.
        let pki = Pki { dir };
        let d = pki.dir.as_path();
        for ca in ["ca", "other_ca"] {
            let (key, pem, subject) = (
                format!("{ca}.key"),
                format!("{ca}.pem"),
                format!("/CN=amqp_outbox test {ca}"),
            );
            openssl(
                d,
                &[
                    "req",
                    "-x509",
                    "-newkey",
                    "rsa:2048",
                    "-nodes",
                    "-days",
                    "30",
                    "-keyout",
                    &key,
                    "-out",
                    &pem,
                    "-subj",
                    &subject,
                    "-addext",
                    "basicConstraints=critical,CA:TRUE",
                    "-addext",
                    "keyUsage=critical,keyCertSign,cRLSign",
                ],
            )?;
        }
        let write = |name: &str, text: &str| {
            std::fs::write(d.join(name), text).map_err(|e| format!("{name}: {e}"))
        };
        write("server.ext", SERVER_EXT)?;
        write("client.ext", CLIENT_EXT)?;
        // "-1" days: a certificate that expired yesterday.
        for (name, subject, ext, days) in [
            ("server", "/CN=localhost", "server.ext", "30"),
            ("expired", "/CN=localhost", "server.ext", "-1"),
            ("client", "/CN=amqp_outbox client", "client.ext", "30"),
        ] {
            let (key, csr, pem) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.pem"),
            );
            openssl(
                d,
                &[
                    "req", "-newkey", "rsa:2048", "-nodes", "-keyout", &key, "-out", &csr, "-subj",
                    subject,
                ],
            )?;
            openssl(
                d,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-days",
                    days,
                    "-extfile",
                    ext,
                    "-out",
                    &pem,
                ],
            )?;
        }
        // A PostgreSQL worker runs as the cluster's user, not the test's: it must be able to
        // read the certificates (the private keys stay the test's own).
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path, m: u32| {
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(m))
                    .map_err(|e| format!("{}: {e}", p.display()))
            };
            mode(d, 0o755)?;
            for pem in [
                "ca.pem",
                "other_ca.pem",
                "server.pem",
                "expired.pem",
                "client.pem",
            ] {
                mode(&d.join(pem), 0o644)?;
            }
        }
        Ok(pki)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The full path of one of the files.
    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// The lines of `rabbitmq.conf` for a TLS listener on 127.0.0.1:`port` with `server.pem`,
    /// trusting `ca.pem` for client certificates.
    pub fn listener_conf(&self, port: u16, require_client_cert: bool) -> String {
        format!(
            "listeners.ssl.1 = 127.0.0.1:{port}\n\
             ssl_options.cacertfile = {}\n\
             ssl_options.certfile = {}\n\
             ssl_options.keyfile = {}\n\
             ssl_options.verify = verify_peer\n\
             ssl_options.fail_if_no_peer_cert = {require_client_cert}\n",
            self.path("ca.pem"),
            self.path("server.pem"),
            self.path("server.key"),
        )
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
