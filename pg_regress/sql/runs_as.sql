-- Code registered with the extension (a subscription's handler, a compensation) runs as its
-- owner: an administrator may make it run only as a role it may act as itself, whether through
-- the API functions or by writing the tables (FAULTS.md case 24).
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
CREATE ROLE regress_runs_as_dba IN ROLE amqp_outbox_admin;
CREATE ROLE regress_runs_as_app;
GRANT regress_runs_as_app TO regress_runs_as_dba;
CREATE ROLE regress_runs_as_other;
GRANT CREATE ON SCHEMA public TO regress_runs_as_dba;
INSERT INTO amqp.broker (broker_id, host, username, password) VALUES (9, '127.0.0.1', 'app', 'pw');
\set VERBOSITY sqlstate
\set ON_ERROR_ROLLBACK on
BEGIN;
SET LOCAL ROLE regress_runs_as_dba;
-- The attack: a handler of the administrator's own that does something only a superuser may.
CREATE FUNCTION public.regress_h(d amqp.delivery) RETURNS void LANGUAGE plpgsql AS $$
BEGIN IF current_user = 'postgres' THEN EXECUTE 'CREATE ROLE regress_pwned SUPERUSER'; END IF; END $$;
CREATE FUNCTION public.regress_comp(o amqp.produced, f amqp.receipt) RETURNS void LANGUAGE sql AS '';
SELECT amqp.subscribe('s1', 9, 'q1', 'public.regress_h(amqp.delivery)');
-- Refused (42501), and nothing changes: make it run as a superuser, or as a role the
-- administrator is not a member of; insert such a row directly.
UPDATE amqp.subscription SET owner = 'postgres' WHERE subscription = 's1';
UPDATE amqp.subscription SET owner = 'regress_runs_as_other' WHERE subscription = 's1';
INSERT INTO amqp.subscription (subscription, broker_id, queue, handler, owner)
VALUES ('s2', 9, 'q2', 'public.regress_h(amqp.delivery)', 'postgres');
SELECT subscription, owner FROM amqp.subscription ORDER BY 1;
-- A role it is a member of: allowed, as SET ROLE would be (if that role may run the handler).
UPDATE amqp.subscription SET owner = 'regress_runs_as_app' WHERE subscription = 's1';
SELECT subscription, owner FROM amqp.subscription ORDER BY 1;
RESET ROLE;
-- A handler the owner may not execute cannot be put in either.
REVOKE EXECUTE ON FUNCTION public.regress_h(amqp.delivery) FROM PUBLIC;
SET LOCAL ROLE regress_runs_as_dba;
UPDATE amqp.subscription SET queue = 'q1b' WHERE subscription = 's1';
RESET ROLE;
GRANT EXECUTE ON FUNCTION public.regress_h(amqp.delivery) TO PUBLIC;
SET LOCAL ROLE regress_runs_as_dba;
-- Settings that do not change who runs what are the administrator's.
UPDATE amqp.subscription SET prefetch = 10, paused = true WHERE subscription = 's1';
-- Compensations: registered by the administrator through on_failure(), as itself; a row
-- written directly is checked the same way.
SELECT amqp.on_failure('order', 'public.regress_comp(amqp.produced, amqp.receipt)');
SELECT business_type, owner FROM amqp.compensation_handler;
UPDATE amqp.compensation_handler SET owner = 'postgres';
INSERT INTO amqp.compensation_handler (business_type, handler, owner)
VALUES ('invoice', 'public.regress_comp(amqp.produced, amqp.receipt)', 'postgres');
SELECT business_type, owner FROM amqp.compensation_handler;
SELECT amqp.on_failure('order', NULL);
SELECT count(*) FROM amqp.compensation_handler;
RESET ROLE;
-- A superuser may register code for any role.
UPDATE amqp.subscription SET owner = 'regress_runs_as_other' WHERE subscription = 's1';
SELECT subscription, owner, prefetch, paused FROM amqp.subscription ORDER BY 1;
ROLLBACK;
\set ON_ERROR_ROLLBACK off
\set VERBOSITY terse
DELETE FROM amqp.broker WHERE broker_id = 9;
REVOKE CREATE ON SCHEMA public FROM regress_runs_as_dba;
DROP ROLE regress_runs_as_dba, regress_runs_as_app, regress_runs_as_other;
