//! amqp_outbox: `amqp.publish()` inserts into an outbox table in the caller's transaction; a
//! background worker publishes committed rows to RabbitMQ with publisher confirms and deletes
//! each row once its delivery is proven.

use pgrx::prelude::*;

mod ack_queue;
mod api;
mod commit_wake;
mod database_statements;
mod drop_guard;
mod error;
mod gucs;
mod inbox;
mod launcher;
mod message_table;
mod monitor;
mod pg_compat;
mod scheduled_move;
mod shmem;
mod subtransaction;
mod wait_event;
mod watchdog;
mod worker;

// Plain Rust, shared with the worker's engine (crate amqp_outbox_engine).
pub(crate) use amqp_outbox_engine::headers;

pgrx::pg_module_magic!();

extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
extension_sql_file!("../sql/inbox.sql", name = "inbox", requires = ["schema"]);
extension_sql_file!(
    "../sql/subscriptions.sql",
    name = "subscriptions",
    requires = ["inbox"]
);
extension_sql_file!(
    "../sql/consume_once.sql",
    name = "consume_once",
    requires = ["subscriptions"]
);
extension_sql_file!(
    "../sql/reconcile.sql",
    name = "reconcile",
    requires = ["consume_once"]
);
extension_sql_file!(
    "../sql/receipts.sql",
    name = "receipts",
    requires = ["reconcile"]
);
extension_sql_file!(
    "../sql/monitor_pass.sql",
    name = "monitor_pass",
    requires = ["receipts"]
);
extension_sql_file!(
    "../sql/monitor_open.sql",
    name = "monitor_open",
    requires = ["monitor_pass"]
);
extension_sql_file!(
    "../sql/monitor.sql",
    name = "monitor",
    requires = ["monitor_open"]
);
extension_sql_file!(
    "../sql/monitor_summary.sql",
    name = "monitor_summary",
    requires = ["monitor"]
);
extension_sql_file!(
    "../sql/runs_as.sql",
    name = "runs_as",
    requires = ["monitor_summary"]
);
extension_sql_file!("../sql/health.sql", name = "health", requires = ["runs_as"]);
extension_sql_file!(
    "../sql/publish_later.sql",
    name = "publish_later",
    requires = ["health"]
);
extension_sql_file!(
    "../sql/trace.sql",
    name = "trace",
    requires = ["publish_later"]
);
extension_sql_file!("../sql/finish.sql", name = "finish", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    hide_rust_backtraces();
    // Shared memory and the worker exist only when loaded at server start. A backend that
    // loads the library later (CREATE EXTENSION without preloading) still gets the functions;
    // amqp.publish() then refuses with a hint, since no worker would publish.
    // SAFETY: a plain global of the postmaster, read while loading the library.
    let preloading = unsafe { pg_sys::process_shared_preload_libraries_in_progress };
    gucs::init(preloading);
    drop_guard::install();
    if preloading {
        shmem::init();
        // pg_upgrade starts the old and the new server in binary-upgrade mode (`-b`) to dump
        // and restore the schema: no worker runs then (its transactions would race the
        // restore, in which every new object must get the OID pg_upgrade assigns). The server's
        // next normal start registers them.
        // SAFETY: a plain global of the postmaster, set from its command line before the
        // preloaded libraries are loaded.
        if unsafe { pg_sys::IsBinaryUpgrade } {
            log!("amqp_outbox: binary-upgrade mode (pg_upgrade): the workers do not start");
        } else {
            // The launcher starts each database's workers (see launcher/).
            launcher::register();
        }
    }
}

fn hide_rust_backtraces() {
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        // Runs while the library is loaded, before this process starts any thread.
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
}
