//! Running one fixed statement with the extension owner's rights, so that callers need EXECUTE
//! on a function and no right on the tables behind it.

use pgrx::prelude::*;

/// Runs as another role until dropped, as SECURITY DEFINER would, but only around one statement
/// and without a `search_path` switch per call. Restricted: the statement may not run code that
/// assumes the caller's rights. An error in between is cleaned up by PostgreSQL's abort, which
/// restores the user id too.
pub struct RunAs {
    user: pg_sys::Oid,
    context: i32,
}

impl RunAs {
    pub fn new(role: pg_sys::Oid) -> Self {
        let mut user = pg_sys::InvalidOid;
        let mut context = 0;
        // SAFETY: on the backend's main thread; the out-pointers are our locals. The switch is
        // undone by Drop, or by the transaction's abort on an ERROR.
        unsafe {
            pg_sys::GetUserIdAndSecContext(&mut user, &mut context);
            pg_sys::SetUserIdAndSecContext(
                role,
                context
                    | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32
                    | pg_sys::SECURITY_RESTRICTED_OPERATION as i32,
            );
        }
        RunAs { user, context }
    }
}

impl Drop for RunAs {
    fn drop(&mut self) {
        // SAFETY: on the backend's main thread; restores the values read in `new`.
        unsafe { pg_sys::SetUserIdAndSecContext(self.user, self.context) };
    }
}

/// The extension's owner (the role the fixed statements run as).
pub fn extension_owner() -> pg_sys::Oid {
    Spi::get_one::<pg_sys::Oid>(
        "SELECT extowner FROM pg_catalog.pg_extension WHERE extname OPERATOR(pg_catalog.=) 'amqp_outbox'",
    )
    .ok()
    .flatten()
    .unwrap_or(pg_sys::BOOTSTRAP_SUPERUSERID.into())
}

/// The name of the role calling now (before any [`RunAs`]).
pub fn current_role_name() -> String {
    // SAFETY: GetUserId has no preconditions in a backend; GetUserNameFromId returns a
    // palloc'd name for an existing role (noerr = true: NULL when it was dropped meanwhile).
    unsafe {
        let name = pg_sys::GetUserNameFromId(pg_sys::GetUserId(), true);
        if name.is_null() {
            return String::new();
        }
        std::ffi::CStr::from_ptr(name)
            .to_string_lossy()
            .into_owned()
    }
}
