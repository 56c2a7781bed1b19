//! The plain-SQL install for hosted PostgreSQL (sql/hosted/) in a private cluster that does not
//! load the library: what the tests of it and of the relay start from.

use std::path::Path;

use postgres::{Client, NoTls};

use crate::pg::{PgCluster, PgConfig};

/// The database the script is installed into.
pub const DB: &str = "hosted";
/// The role that ran it: CREATE on the database, CREATEROLE and pg_monitor, what a hosted
/// service's administrator has.
pub const OWNER: &str = "hosted_owner";

/// The committed script of the extension's current version, psql's meta-commands left out.
pub fn script() -> String {
    // The extension's version, from its Cargo.toml (this crate has its own).
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).expect("Cargo.toml");
    let version = manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("the extension's version in Cargo.toml");
    script_file(&format!("amqp_outbox_hosted--{version}.sql"))
}

/// A committed script of sql/hosted/ (an install of some version, an update), psql's
/// meta-commands left out.
pub fn script_file(name: &str) -> String {
    let path = root().join("sql/hosted").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    text.lines()
        .filter(|l| !l.starts_with('\\'))
        .collect::<Vec<_>>()
        .join("\n")
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lives in the repository")
}

/// A cluster without the library and the database [`DB`] where [`OWNER`] ran the script in one
/// transaction.
pub fn installed() -> PgCluster {
    installed_from(&script())
}

/// A cluster without the library and the database [`DB`] where [`OWNER`] ran `script` in one
/// transaction.
pub fn installed_from(script: &str) -> PgCluster {
    let cluster = PgCluster::new(PgConfig::new().without_preload());
    let mut admin = cluster.client_db("postgres");
    // One statement each: a multi-statement string runs as one transaction block, and CREATE
    // DATABASE refuses to.
    for statement in [
        format!("CREATE ROLE {OWNER} LOGIN CREATEROLE"),
        format!("CREATE DATABASE {DB}"),
        format!("GRANT CREATE ON DATABASE {DB} TO {OWNER}"),
        format!("GRANT pg_monitor TO {OWNER}"),
    ] {
        admin.batch_execute(&statement).expect("roles and database");
    }
    owner_client(&cluster)
        .batch_execute(&format!("BEGIN; {script}\nCOMMIT;"))
        .unwrap_or_else(|e| panic!("the plain-SQL install failed: {e}"));
    cluster
}

/// A connection to [`DB`] as [`OWNER`] (as a relay connects).
pub fn owner_client(cluster: &PgCluster) -> Client {
    let url = cluster
        .connection_string(DB)
        .replace("user=postgres", &format!("user={OWNER}"));
    Client::connect(&url, NoTls).expect("connect as the owner")
}
