//! Running users' code as its owner, never as the relay's role. The relay's role (the
//! install's owner) cannot switch users the way the extension's processes do inside the server.
//! For each owner it keeps two functions in its session's own temporary schema (no other
//! session sees it), created after `SET ROLE` to the owner (so the owner owns them) and
//! `SECURITY DEFINER`: `pg_temp.amqp_outbox_as_<owner oid>(handler, amqp.delivery)` calls a
//! subscription's handler, `pg_temp.amqp_outbox_compensate_as_<owner oid>(handler, produced,
//! receipt)` a compensation's. Code called through them runs as the owner, and PostgreSQL
//! refuses `SET ROLE`, `RESET ROLE` and `SET SESSION AUTHORIZATION` inside a security-definer
//! function, so it cannot come back to the relay's role. A relay whose role may not `SET ROLE`
//! to an owner (the right `amqp.subscribe()` and `amqp.on_failure()` ask of whoever registers
//! code for another role) runs nothing as it, and says why.

use amqp_outbox_engine::consume::statements::DELIVERY_ROW;
use postgres::Client;
use std::collections::BTreeMap;

/// Creates (or replaces) the owner's two functions, as the owner, with the handlers'
/// search_path. `amqp_outbox_relay.owner` (the owner's oid) and that search_path are set for
/// the transaction before ([`SETTINGS_SQL`]); the names are quoted by PostgreSQL (`%I`).
const MAKE_SQL: &str = r#"DO $make_runners$
DECLARE
    owner_ oid := pg_catalog.current_setting('amqp_outbox_relay.owner')::oid;
    find text := $find$
    SELECT pg_catalog.format('%I.%I', n.nspname, p.proname) INTO f
      FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) p.pronamespace
     WHERE p.oid OPERATOR(pg_catalog.=) handler;
    IF f IS NULL THEN
        RAISE EXCEPTION 'amqp_outbox: the handler function (oid %) no longer exists', handler
            USING ERRCODE = 'undefined_function';
    END IF;$find$;
BEGIN
    EXECUTE pg_catalog.format('SET LOCAL ROLE %I',
        (SELECT rolname FROM pg_catalog.pg_roles WHERE oid OPERATOR(pg_catalog.=) owner_));
    EXECUTE pg_catalog.format($create$
CREATE OR REPLACE FUNCTION pg_temp.%I(handler oid, d amqp.delivery) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $run$
DECLARE
    f text;
BEGIN %s
    EXECUTE pg_catalog.format('SELECT %%s($1)', f) USING d;
END
$run$$create$, 'amqp_outbox_as_' OPERATOR(pg_catalog.||) owner_::text, find);
    EXECUTE pg_catalog.format($create$
CREATE OR REPLACE FUNCTION pg_temp.%I(handler oid, original text, failure text) RETURNS void
    LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $run$
DECLARE
    f text;
BEGIN %s
    EXECUTE pg_catalog.format('SELECT %%s($1::amqp.produced, $2::amqp.receipt)', f)
        USING original, failure;
END
$run$$create$, 'amqp_outbox_compensate_as_' OPERATOR(pg_catalog.||) owner_::text, find);
    RESET ROLE;
END
$make_runners$"#;

/// The settings [`MAKE_SQL`] reads, for the transaction.
const SETTINGS_SQL: &str = "\
SELECT pg_catalog.set_config('amqp_outbox_relay.owner', $1::oid::text, true), \
       pg_catalog.set_config('search_path', $2, true)";

/// The owner's functions' names, quoted by PostgreSQL.
const NAMES_SQL: &str = "\
SELECT 'pg_temp.' OPERATOR(pg_catalog.||) pg_catalog.quote_ident('amqp_outbox_as_' OPERATOR(pg_catalog.||) $1::oid::text), \
       'pg_temp.' OPERATOR(pg_catalog.||) pg_catalog.quote_ident('amqp_outbox_compensate_as_' OPERATOR(pg_catalog.||) $1::oid::text)";

/// The calls of one owner's functions.
#[derive(Clone, Debug)]
pub struct Calls {
    /// A subscription's handler: the message's 14 values ([`DELIVERY_ROW`]), then the handler's
    /// oid as `$15` and whether the message set a trace context (`$16`). After the handler, in
    /// the same statement (in this order): the subscriptions as they are then
    /// (`pg_temp.amqp_outbox_subscriptions()`, see `client_inbox`), the bound of time taken away,
    /// the trace context too when there was one.
    pub handler: String,
    /// A compensation: the `amqp.produced` and `amqp.receipt` rows as text (`$1`, `$2`), and
    /// the handler's oid as `$3`.
    pub compensation: String,
}

/// The owners' functions made on one connection.
pub struct Runners {
    /// The search_path users' code runs with: the session's before the relay set its own (the
    /// database's and the role's setting).
    search_path: String,
    made: BTreeMap<u32, Result<Calls, String>>,
}

impl Runners {
    pub fn new(search_path: String) -> Runners {
        Runners {
            search_path,
            made: BTreeMap::new(),
        }
    }

    /// Forgets what was made: the next [`Runners::ensure`] makes each owner's functions again,
    /// with the owner's rights and the relay's right to act as it as they are then.
    pub fn forget(&mut self) {
        self.made.clear();
    }

    /// Makes the owner's functions unless made already, in a transaction of its own (call
    /// outside a transaction block); returns their calls, or why they cannot be made.
    pub fn ensure(&mut self, client: &mut Client, owner: u32) -> Result<Calls, String> {
        if let Some(made) = self.made.get(&owner) {
            return made.clone();
        }
        let made = make(client, owner, &self.search_path);
        self.made.insert(owner, made.clone());
        made
    }

    /// Why the owner's functions could not be made (or that they were not yet).
    pub fn why_not(&self, owner: u32) -> String {
        match self.made.get(&owner) {
            Some(Err(why)) => why.clone(),
            _ => "the relay has not prepared to run as its owner yet".into(),
        }
    }

    /// The calls of the owner's functions, if they were made.
    pub fn calls(&self, owner: u32) -> Option<&Calls> {
        self.made.get(&owner).and_then(|m| m.as_ref().ok())
    }
}

fn make(client: &mut Client, owner: u32, search_path: &str) -> Result<Calls, String> {
    let describe = |e: postgres::Error| crate::connect::describe(&e);
    let mut t = client.transaction().map_err(describe)?;
    t.query_one(SETTINGS_SQL, &[&owner, &search_path])
        .map_err(describe)?;
    if let Err(e) = t.batch_execute(MAKE_SQL) {
        return Err(format!(
            "the relay cannot run code as its owner (role oid {owner}): {}; grant the relay's role membership in it (with SET)",
            describe(e)
        ));
    }
    let names = t.query_one(NAMES_SQL, &[&owner]).map_err(describe)?;
    let (handler, compensation): (String, String) = (
        names.try_get(0).map_err(describe)?,
        names.try_get(1).map_err(describe)?,
    );
    t.commit().map_err(describe)?;
    Ok(Calls {
        handler: format!(
            "SELECT {handler}($15, {DELIVERY_ROW}), pg_temp.amqp_outbox_subscriptions(), \
             pg_catalog.set_config('statement_timeout', '0', true), \
             CASE WHEN $16 THEN pg_catalog.set_config('amqp_outbox.traceparent', '', true) END"
        ),
        compensation: format!("SELECT {compensation}($3, $1, $2)"),
    })
}
