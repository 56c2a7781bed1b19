//! The defaults of the system and host tags: this database's name and the server's host name,
//! taken once per worker process (a renamed database gets new workers).

use pgrx::pg_sys;
use std::sync::OnceLock;

static SYSTEM_ID: OnceLock<String> = OnceLock::new();
static HOST_ID: OnceLock<String> = OnceLock::new();

/// `amqp_outbox.system_id`'s default: the database's name. Call inside a transaction (the
/// first call reads the catalog).
pub fn system_id() -> &'static str {
    SYSTEM_ID.get_or_init(|| {
        // SAFETY: on the worker's main thread inside a transaction; get_database_name returns
        // a palloc'd copy of the name, or NULL when the database is gone.
        unsafe {
            let name = pg_sys::get_database_name(pg_sys::MyDatabaseId);
            if name.is_null() {
                return String::new();
            }
            std::ffi::CStr::from_ptr(name)
                .to_string_lossy()
                .into_owned()
        }
    })
}

/// `amqp_outbox.host_id`'s default: the host name.
pub fn host_id() -> &'static str {
    HOST_ID.get_or_init(amqp_outbox_broker::identity::host_name)
}
