//! amqp_outbox: `amqp.publish()` inserts into an outbox table in the caller's transaction; a
//! background worker publishes committed rows to RabbitMQ with publisher confirms and deletes
//! each row once its delivery is proven.

use pgrx::prelude::*;

mod ack_queue;
mod api;
mod commit_wake;
mod drop_guard;
mod error;
mod gucs;
mod headers;
mod inbox;
mod shmem;
mod worker;

pgrx::pg_module_magic!();

extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
extension_sql_file!("../sql/inbox.sql", name = "inbox", requires = ["schema"]);
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
        register_workers();
    }
}

/// An outbox worker and a subscription worker for each database `amqp_outbox.database` lists;
/// its position is their shared-memory slot.
fn register_workers() {
    for (slot, name) in gucs::database_names().iter().enumerate() {
        if slot >= shmem::MAX_DATABASES {
            warning!(
                "amqp_outbox: amqp_outbox.database lists more than {} databases; \"{name}\" and the ones after it are not served",
                shmem::MAX_DATABASES
            );
            break;
        }
        worker::register(slot, name);
        inbox::register(slot, name);
    }
}

/// pgrx puts a Rust backtrace into the DETAIL of an error raised through Rust code whenever
/// `std::backtrace` is enabled, which `RUST_BACKTRACE` in the server's environment does: clients
/// would see our stack frames. Unless a developer asks for them with `RUST_LIB_BACKTRACE`, they
/// are turned off for this process (and, set in the postmaster, for every backend it starts).
fn hide_rust_backtraces() {
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        // Runs while the library is loaded, before this process starts any thread.
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
}
