-- amqp_outbox: who code registered with the extension runs as. A subscription's handler and a
-- compensation handler run as the row's owner, so an owner, a handler (or, for a subscription,
-- what it consumes) may be set only by a role that may act as that owner, whatever the way:
-- the API functions, or an INSERT or UPDATE by a role with rights on the table. Checked here,
-- row by row, as the role that writes; and checked again by the subscription worker before it
-- runs a handler.

-- A handler function as amqp.subscription and amqp.compensation_handler keep it: its
-- schema-qualified name and argument types, as regprocedure prints it with only pg_catalog on
-- the search_path (public.my_handler(amqp.delivery)). Text, not regprocedure: pg_upgrade
-- refuses a cluster whose tables have reg* columns other than regclass, regrole and regtype
-- (the function OIDs they hold do not survive it), while a name does, just as pg_dump's
-- restore already resolved it by name. Resolved with pg_catalog.to_regprocedure() when used.
CREATE FUNCTION @extschema@._handler_name(handler regprocedure) RETURNS text
    LANGUAGE sql STABLE STRICT SET search_path = pg_catalog AS $handler_name$
    SELECT handler::text
$handler_name$;

-- A write of a handler (INSERT, or an UPDATE that changes it) resolves the name as a
-- regprocedure column did, with the writer's search_path, and keeps it schema-qualified. A name
-- that names no function is left as written, and amqp._check_runs_as() refuses it. No SET
-- search_path here, on purpose (the writer's is the one to resolve with): it runs as the writer,
-- decides nothing, and the check that decides runs after it, with its own.
CREATE FUNCTION @extschema@._handler_written() RETURNS trigger LANGUAGE plpgsql AS $handler_written$
BEGIN
    IF TG_OP OPERATOR(pg_catalog.=) 'INSERT' OR NEW.handler IS DISTINCT FROM OLD.handler THEN
        NEW.handler := COALESCE(
            @extschema@._handler_name(pg_catalog.to_regprocedure(NEW.handler)), NEW.handler);
    END IF;
    RETURN NEW;
END
$handler_written$;

CREATE FUNCTION @extschema@._assert_may_run_as(owner regrole, handler regprocedure, what text)
    RETURNS void LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $may_run_as$
DECLARE
    may_set boolean;
BEGIN
    IF owner IS NULL OR handler IS NULL THEN
        RETURN;  -- the NOT NULL constraints say so
    END IF;
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles r WHERE r.oid OPERATOR(pg_catalog.=) owner) THEN
        RAISE EXCEPTION 'amqp_outbox: the owner of % is not an existing role', what
            USING ERRCODE = 'undefined_object';
    END IF;
    -- Membership is what SET ROLE needs; from PostgreSQL 16 on a membership may withhold it.
    may_set := pg_catalog.pg_has_role(CURRENT_USER, owner, 'MEMBER');
    IF may_set AND pg_catalog.current_setting('server_version_num')::integer >= 160000 THEN
        EXECUTE 'SELECT pg_catalog.pg_has_role($1, $2, ''SET'')' INTO may_set USING CURRENT_USER, owner;
    END IF;
    IF NOT may_set THEN
        RAISE EXCEPTION 'amqp_outbox: permission denied to make % run as role %', what, owner
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'Code registered with amqp_outbox runs as its owner: only that role, a role that may SET ROLE to it, or a superuser may register it.';
    END IF;
    IF NOT pg_catalog.has_function_privilege(owner, handler, 'EXECUTE') THEN
        RAISE EXCEPTION 'amqp_outbox: role % may not execute %, the handler of %', owner, handler, what
            USING ERRCODE = 'insufficient_privilege';
    END IF;
END
$may_run_as$;

-- One trigger function for both tables. Its arguments: the column that names the row (for the
-- error), then the columns besides owner and handler whose change is checked too.
CREATE FUNCTION @extschema@._check_runs_as() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $check_runs_as$
DECLARE
    now_ jsonb := pg_catalog.to_jsonb(NEW);
    was jsonb;
    column_ text;
    changed boolean := TG_OP = 'INSERT';
BEGIN
    IF NOT changed THEN
        was := pg_catalog.to_jsonb(OLD);
        FOREACH column_ IN ARRAY ARRAY['owner', 'handler'] OPERATOR(pg_catalog.||) TG_ARGV[1:] LOOP
            changed := changed OR (now_ -> column_) IS DISTINCT FROM (was -> column_);
        END LOOP;
    END IF;
    IF changed THEN
        -- A handler that names no function raises undefined_function here.
        PERFORM @extschema@._assert_may_run_as(NEW.owner, NEW.handler::pg_catalog.regprocedure,
            pg_catalog.format('%s %I', TG_TABLE_NAME, now_ ->> TG_ARGV[0]));
    END IF;
    RETURN NEW;
END
$check_runs_as$;
-- Row triggers of one event fire in name order: the handler's name is resolved (handler_written)
-- before the check (runs_as) reads it.
CREATE TRIGGER subscription_handler_written BEFORE INSERT OR UPDATE ON @extschema@.subscription
    FOR EACH ROW EXECUTE FUNCTION @extschema@._handler_written();
CREATE TRIGGER subscription_runs_as BEFORE INSERT OR UPDATE ON @extschema@.subscription
    FOR EACH ROW EXECUTE FUNCTION @extschema@._check_runs_as('subscription', 'queue', 'broker_id');
CREATE TRIGGER compensation_handler_handler_written BEFORE INSERT OR UPDATE ON @extschema@.compensation_handler
    FOR EACH ROW EXECUTE FUNCTION @extschema@._handler_written();
CREATE TRIGGER compensation_handler_runs_as BEFORE INSERT OR UPDATE ON @extschema@.compensation_handler
    FOR EACH ROW EXECUTE FUNCTION @extschema@._check_runs_as('business_type', 'business_type');

REVOKE ALL ON FUNCTION @extschema@._assert_may_run_as(regrole, regprocedure, text),
    @extschema@._check_runs_as(), @extschema@._handler_name(regprocedure),
    @extschema@._handler_written() FROM PUBLIC;
-- The triggers call it as the role that writes the row (the administrator, through the API
-- functions or not). Trigger functions cannot be called otherwise: granted as every function.
GRANT EXECUTE ON FUNCTION @extschema@._assert_may_run_as(regrole, regprocedure, text),
    @extschema@._check_runs_as(), @extschema@._handler_name(regprocedure),
    @extschema@._handler_written() TO amqp_outbox_admin;
-- amqp.on_failure() registers a compensation as its caller (an administrator), checked above.
GRANT INSERT, UPDATE ON @extschema@.compensation_handler TO amqp_outbox_admin;
