//! `DROP EXTENSION amqp_outbox` would drop `amqp.message`, and with it every committed message
//! not yet delivered, without a word. It is refused while the outbox holds messages; deleting
//! them first (`DELETE FROM amqp.message`, in the same transaction if you like) says that
//! losing them is meant. Installed as a ProcessUtility hook, the one place that sees which
//! extension a DROP names before anything is dropped. The same hook pauses a database's workers
//! for the statements that need the database to themselves ([`crate::database_statements`]),
//! and tells the launcher about a `CREATE EXTENSION amqp_outbox` once it commits.

use pgrx::prelude::*;
use pgrx::PgList;
use std::ffi::{c_char, CStr};

static mut PREVIOUS: pg_sys::ProcessUtility_hook_type = None;

/// Installs the hook; from `_PG_init`, once per process.
pub fn install() {
    // SAFETY: `_PG_init` runs once per process, on its only thread, before any statement.
    unsafe {
        PREVIOUS = pg_sys::ProcessUtility_hook;
        pg_sys::ProcessUtility_hook = Some(guard);
    }
}

#[pg_guard]
#[allow(clippy::too_many_arguments)]
unsafe extern "C-unwind" fn guard(
    pstmt: *mut pg_sys::PlannedStmt,
    query_string: *const c_char,
    read_only_tree: bool,
    context: pg_sys::ProcessUtilityContext::Type,
    params: pg_sys::ParamListInfo,
    query_env: *mut pg_sys::QueryEnvironment,
    dest: *mut pg_sys::DestReceiver,
    qc: *mut pg_sys::QueryCompletion,
) {
    // SAFETY: PostgreSQL hands a valid planned utility statement.
    if unsafe { drops_this_extension(pstmt) } {
        refuse_while_messages_wait();
    }
    // SAFETY: as above.
    if unsafe { creates_this_extension(pstmt) } {
        // Whatever version's script runs: once the transaction commits, the launcher starts
        // this database's workers.
        crate::commit_wake::extension_created_at_commit();
    }
    // SAFETY: as above.
    let paused = unsafe { crate::database_statements::pause_for(pstmt) };
    // SAFETY: the same arguments, passed on unchanged.
    unsafe {
        match PREVIOUS {
            Some(previous) => previous(
                pstmt,
                query_string,
                read_only_tree,
                context,
                params,
                query_env,
                dest,
                qc,
            ),
            None => pg_sys::standard_ProcessUtility(
                pstmt,
                query_string,
                read_only_tree,
                context,
                params,
                query_env,
                dest,
                qc,
            ),
        }
    }
    // Not reached when the statement fails: the pause then runs out by itself.
    if let Some(p) = paused {
        p.resume();
    }
}

/// Whether the statement is a `CREATE EXTENSION amqp_outbox`.
///
/// # Safety
/// `pstmt` is a valid `PlannedStmt` whose `utilityStmt` is a valid node.
unsafe fn creates_this_extension(pstmt: *mut pg_sys::PlannedStmt) -> bool {
    // SAFETY: per the contract above; the node is cast to the type its tag names.
    unsafe {
        let stmt = (*pstmt).utilityStmt;
        if stmt.is_null() || (*stmt).type_ != pg_sys::NodeTag::T_CreateExtensionStmt {
            return false;
        }
        let name = (*stmt.cast::<pg_sys::CreateExtensionStmt>()).extname;
        !name.is_null() && CStr::from_ptr(name).to_bytes() == b"amqp_outbox"
    }
}

/// Whether the statement is a `DROP EXTENSION` naming `amqp_outbox`.
///
/// # Safety
/// `pstmt` is a valid `PlannedStmt` whose `utilityStmt` is a valid node.
unsafe fn drops_this_extension(pstmt: *mut pg_sys::PlannedStmt) -> bool {
    // SAFETY: per the contract above; a DropStmt's objects are String nodes for extensions.
    unsafe {
        let stmt = (*pstmt).utilityStmt;
        if stmt.is_null() || (*stmt).type_ != pg_sys::NodeTag::T_DropStmt {
            return false;
        }
        let drop = stmt.cast::<pg_sys::DropStmt>();
        if (*drop).removeType != pg_sys::ObjectType::OBJECT_EXTENSION {
            return false;
        }
        PgList::<pg_sys::Node>::from_pg((*drop).objects)
            .iter_ptr()
            .any(|node| {
                !node.is_null()
                    && (*node).type_ == pg_sys::NodeTag::T_String
                    && CStr::from_ptr((*node.cast::<pg_sys::String>()).sval).to_bytes()
                        == b"amqp_outbox"
            })
    }
}

/// Whether the current user owns the extension in this database (directly or through a role):
/// what DROP EXTENSION requires, checked by PostgreSQL only after this hook.
fn owns_extension() -> bool {
    Spi::get_one::<bool>(
        "SELECT pg_catalog.pg_has_role(e.extowner, 'USAGE') FROM pg_catalog.pg_extension e \
          WHERE e.extname OPERATOR(pg_catalog.=) 'amqp_outbox'",
    )
    .ok()
    .flatten()
    .unwrap_or(false)
}

fn refuse_while_messages_wait() {
    // A role that may not drop the extension gets PostgreSQL's own error, without having
    // locked amqp.message (every publisher would queue behind that lock).
    if !owns_extension() {
        return;
    }
    // The lock the DROP takes anyway, taken first: no publish can commit between the count and
    // the drop, and the worker (whose every transaction locks amqp.message before any other
    // table of the extension) finishes its transaction first, instead of holding a table the
    // DROP reaches before amqp.message while waiting for amqp.message: a deadlock.
    if !crate::message_table::installed_and_locked(pg_sys::AccessExclusiveLock) {
        return;
    }
    let waiting = Spi::get_two::<i64, i64>(
        "SELECT pg_catalog.count(*), pg_catalog.count(parked_at) FROM amqp.message",
    );
    let Ok((Some(total), parked)) = waiting else {
        return;
    };
    if total > 0 {
        pgrx::pg_sys::panic::ErrorReport::new(
            PgSqlErrorCode::ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST,
            format!(
                "amqp_outbox: amqp.message holds {total} committed messages not delivered yet ({} parked); DROP EXTENSION would lose them",
                parked.unwrap_or(0)
            ),
            "amqp_outbox",
        )
        .set_hint("Wait until amqp.outbox_summary is empty and amqp.discard() the parked ones, or DELETE FROM amqp.message first to drop them on purpose.")
        .report(PgLogLevel::ERROR);
    }
    // Delayed messages are committed messages too (not there before the update to 0.8.0).
    if !crate::scheduled_move::tables_present() {
        return;
    }
    let scheduled = Spi::get_one::<i64>("SELECT pg_catalog.count(*) FROM amqp.scheduled_message");
    if let Ok(Some(n)) = scheduled {
        if n > 0 {
            pgrx::pg_sys::panic::ErrorReport::new(
                PgSqlErrorCode::ERRCODE_DEPENDENT_OBJECTS_STILL_EXIST,
                format!(
                    "amqp_outbox: amqp.scheduled_message holds {n} committed messages published for later; DROP EXTENSION would lose them"
                ),
                "amqp_outbox",
            )
            .set_hint("amqp.discard() them (cancelled, with a record), or DELETE FROM amqp.scheduled_message first to drop them on purpose.")
            .report(PgLogLevel::ERROR);
        }
    }
}
