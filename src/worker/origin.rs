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
    HOST_ID.get_or_init(|| {
        let mut buf = [0u8; 256];
        // SAFETY: the buffer is ours and its length is passed; gethostname NUL-terminates
        // within it on success (the last byte stays 0 if the name was truncated).
        let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
        if rc != 0 {
            return "localhost".to_string();
        }
        let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    })
}
