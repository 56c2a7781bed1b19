//! Statements that need a database to themselves — `DROP DATABASE`, `ALTER DATABASE … RENAME
//! TO`, `ALTER DATABASE … SET TABLESPACE`, `CREATE DATABASE … TEMPLATE` — would wait for the
//! database's workers and then fail ("being accessed by other users"). Before such a statement
//! runs, its database's workers are paused (the launcher does not start them again) and stopped,
//! and the statement waits a moment for them to exit, as PostgreSQL does for autovacuum.

use crate::shmem::launch;
use pgrx::prelude::*;
use pgrx::PgList;
use std::ffi::CStr;
use std::time::{Duration, Instant};

/// How long the workers stay paused at most (a failed DROP DATABASE leaves its database; its
/// workers come back after this).
const PAUSE: Duration = Duration::from_secs(10);
/// How long the statement waits for the workers to exit.
const WAIT_AT_MOST: Duration = Duration::from_secs(5);

/// A database whose workers are paused for the statement.
pub struct Paused {
    database: u32,
    /// Gone after the statement: the pause runs out instead of being lifted, so the launcher
    /// does not start workers in a database whose drop is not committed yet.
    dropped: bool,
}

impl Paused {
    /// The statement is done: the workers may start again.
    pub fn resume(self) {
        if !self.dropped {
            launch::pause(self.database, None);
            launch::wake_launcher();
        }
    }
}

/// Pauses and stops the workers of the database the statement needs to itself, if any.
///
/// # Safety
/// `pstmt` is a valid `PlannedStmt` whose `utilityStmt` is a valid node (a ProcessUtility
/// hook's argument).
pub unsafe fn pause_for(pstmt: *mut pg_sys::PlannedStmt) -> Option<Paused> {
    // SAFETY: per the contract above.
    if unsafe { creates_database(pstmt) } {
        // A copy of a database with the extension is served too: the launcher looks once the
        // new database is committed.
        crate::commit_wake::wake_launcher_at_commit();
    }
    // SAFETY: per the contract above.
    let (name, what) = unsafe { exclusive_database(pstmt)? };
    // SAFETY: a catalog lookup in a backend; missing_ok, so an unknown name gives InvalidOid.
    let oid = unsafe { pg_sys::get_database_oid(name.as_ptr(), true) }.to_u32();
    launch::slot_of(oid)?;
    // The hook runs before PostgreSQL's own checks: a statement it will refuse for want of a
    // right must not stop anyone's workers (any login role could keep a database's delivery
    // down by trying in a loop).
    if !may(oid, what) {
        return None;
    }
    let dropped = what == Needs::Drop;
    let pids = launch::pause(oid, Some(PAUSE));
    for pid in &pids {
        // SAFETY: kill(2) of a worker of this cluster (same OS user), as pg_terminate_backend()
        // sends; one that already exited gives ESRCH, ignored.
        unsafe { libc::kill(*pid, libc::SIGTERM) };
    }
    launch::wake_launcher();
    let started = Instant::now();
    while started.elapsed() < WAIT_AT_MOST {
        let view = launch::slot_of(oid)
            .map(launch::slot_view)
            .unwrap_or_default();
        if !view.has_worker() {
            break;
        }
        // SAFETY: a backend's own latch; the wait ends on timeout, latch or postmaster death.
        unsafe {
            pg_sys::WaitLatch(
                pg_sys::MyLatch,
                (pg_sys::WL_LATCH_SET | pg_sys::WL_TIMEOUT | pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                20,
                pg_sys::PG_WAIT_EXTENSION,
            );
            pg_sys::ResetLatch(pg_sys::MyLatch);
        }
        pg_sys::check_for_interrupts!();
    }
    Some(Paused {
        database: oid,
        dropped,
    })
}

/// # Safety
/// As [`pause_for`].
unsafe fn creates_database(pstmt: *mut pg_sys::PlannedStmt) -> bool {
    // SAFETY: per the contract.
    unsafe {
        let stmt = (*pstmt).utilityStmt;
        !stmt.is_null() && (*stmt).type_ == pg_sys::NodeTag::T_CreatedbStmt
    }
}

/// What a statement does to the database it needs to itself, for the rights it takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Needs {
    /// DROP DATABASE, ALTER DATABASE ... SET TABLESPACE: its owner.
    Drop,
    Tablespace,
    /// ALTER DATABASE ... RENAME: its owner, with CREATEDB.
    Rename,
    /// CREATE DATABASE ... TEMPLATE: CREATEDB, and its owner unless it is a template.
    Template,
}

/// Whether the current user has the rights PostgreSQL checks for `what` on database `oid`
/// (ownership counts through role membership, a superuser has them all). A tablespace's own
/// privilege is left to PostgreSQL: an owner may pause their own database's workers.
fn may(oid: u32, what: Needs) -> bool {
    // (owner, CREATEDB or superuser, a template); nothing when the database is gone.
    let rights = Spi::get_three_with_args::<bool, bool, bool>(
        "SELECT pg_catalog.pg_has_role(db.datdba, 'USAGE'), \
                (SELECT r.rolsuper OR r.rolcreatedb FROM pg_catalog.pg_roles r \
                  WHERE r.rolname OPERATOR(pg_catalog.=) CURRENT_USER), \
                db.datistemplate \
           FROM pg_catalog.pg_database db WHERE db.oid OPERATOR(pg_catalog.=) $1",
        &[pg_sys::Oid::from(oid).into()],
    );
    let Ok((Some(owner), Some(createdb), Some(template))) = rights else {
        return false;
    };
    match what {
        Needs::Drop | Needs::Tablespace => owner,
        Needs::Rename => owner && createdb,
        Needs::Template => createdb && (template || owner),
    }
}

/// The database a statement needs to itself, and what the statement does to it.
///
/// # Safety
/// As [`pause_for`].
unsafe fn exclusive_database(
    pstmt: *mut pg_sys::PlannedStmt,
) -> Option<(std::ffi::CString, Needs)> {
    // SAFETY: per the contract; each node is cast to the type its tag names.
    unsafe {
        let stmt = (*pstmt).utilityStmt;
        if stmt.is_null() {
            return None;
        }
        let owned =
            |p: *const std::ffi::c_char| (!p.is_null()).then(|| CStr::from_ptr(p).to_owned());
        match (*stmt).type_ {
            pg_sys::NodeTag::T_DropdbStmt => {
                owned((*stmt.cast::<pg_sys::DropdbStmt>()).dbname).map(|n| (n, Needs::Drop))
            }
            pg_sys::NodeTag::T_RenameStmt => {
                let r = stmt.cast::<pg_sys::RenameStmt>();
                ((*r).renameType == pg_sys::ObjectType::OBJECT_DATABASE)
                    .then(|| owned((*r).subname))
                    .flatten()
                    .map(|n| (n, Needs::Rename))
            }
            pg_sys::NodeTag::T_AlterDatabaseStmt => {
                let a = stmt.cast::<pg_sys::AlterDatabaseStmt>();
                option((*a).options, "tablespace")?;
                owned((*a).dbname).map(|n| (n, Needs::Tablespace))
            }
            pg_sys::NodeTag::T_CreatedbStmt => {
                let c = stmt.cast::<pg_sys::CreatedbStmt>();
                let template = option((*c).options, "template")?;
                Some((template, Needs::Template))
            }
            _ => None,
        }
    }
}

/// The string value of option `name` in a statement's option list.
///
/// # Safety
/// `options` is a valid List of DefElem (or NIL).
unsafe fn option(options: *mut pg_sys::List, name: &str) -> Option<std::ffi::CString> {
    // SAFETY: per the contract; defGetString reads a DefElem's argument as text (raises a
    // clean ERROR for a missing one, as the statement itself would).
    unsafe {
        PgList::<pg_sys::DefElem>::from_pg(options)
            .iter_ptr()
            .find(|d| {
                !(**d).defname.is_null()
                    && CStr::from_ptr((**d).defname).to_bytes() == name.as_bytes()
            })
            .map(|d| CStr::from_ptr(pg_sys::defGetString(d)).to_owned())
    }
}
