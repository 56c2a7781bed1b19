//! amqp_outbox: `amqp.publish()` inserts into an outbox table in the caller's transaction; a
//! background worker publishes committed rows to RabbitMQ with publisher confirms and deletes
//! each row once its delivery is proven.

use pgrx::prelude::*;

mod api;
mod commit_wake;
mod error;
mod gucs;
mod headers;
mod shmem;
mod worker;

pgrx::pg_module_magic!();

extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
extension_sql_file!("../sql/finish.sql", name = "finish", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    // Shared memory and the worker exist only when loaded at server start. A backend that
    // loads the library later (CREATE EXTENSION without preloading) still gets the functions;
    // amqp.publish() then refuses with a hint, since no worker would publish.
    // SAFETY: a plain global of the postmaster, read while loading the library.
    let preloading = unsafe { pg_sys::process_shared_preload_libraries_in_progress };
    gucs::init(preloading);
    if preloading {
        shmem::init();
        worker::register();
    }
}
