-- amqp.broker is pg_amqp's table: rows sharing a broker_id are alternative hosts of one broker.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
BEGIN;
-- pg_amqp-style registration: no broker_id given, one is generated.
INSERT INTO amqp.broker (host, port, vhost, username, password)
    VALUES ('rabbit.example', 5672, '/', 'guest', 'guest')
    RETURNING broker_id IS NOT NULL AND broker_id > 0 AS generated_id, host, port, vhost, username;
INSERT INTO amqp.broker (host, port, vhost, username, password)
    VALUES ('other.example', 5673, '/prod', 'app', 'secret');
SELECT count(DISTINCT broker_id) AS distinct_ids FROM amqp.broker;
-- Only host is required; the rest has pg_amqp's defaults.
INSERT INTO amqp.broker (host) VALUES ('defaults.example')
    RETURNING broker_id > 0 AS generated_id, host, port, vhost, username, password;
-- An explicit broker_id is accepted, and a second host with the same broker_id is a failover
-- alternative of the same broker.
INSERT INTO amqp.broker (broker_id, host) VALUES (42, 'rabbit-a.example');
INSERT INTO amqp.broker (broker_id, host, port) VALUES (42, 'rabbit-b.example', 5672);
INSERT INTO amqp.broker (broker_id, host, port) VALUES (42, 'rabbit-a.example', 5673);
SELECT broker_id, host, port FROM amqp.broker WHERE broker_id = 42 ORDER BY host, port;
-- Publishing to a broker with several hosts inserts one message.
SELECT amqp.publish(42, 'ex', 'rk', 'to the broker, whichever host');
SELECT broker_id, count(*) FROM amqp.message GROUP BY broker_id;
-- A generated id works like an explicit one.
SELECT amqp.publish((SELECT broker_id FROM amqp.broker WHERE host = 'defaults.example'),
                    'ex', 'rk', 'to a generated id');
SELECT count(*) FROM amqp.message;
\set ON_ERROR_ROLLBACK on
-- The same host and port twice for one broker_id: 23505 (primary key).
INSERT INTO amqp.broker (broker_id, host) VALUES (42, 'rabbit-a.example');
-- Bad rows: port out of range, empty host (23514), no host (23502).
INSERT INTO amqp.broker (host, port) VALUES ('bad.example', 0);
INSERT INTO amqp.broker (host, port) VALUES ('bad.example', 65536);
INSERT INTO amqp.broker (host) VALUES ('');
INSERT INTO amqp.broker (port) VALUES (5672);
\set ON_ERROR_ROLLBACK off
SELECT count(*) FROM amqp.broker;
ROLLBACK;
SELECT count(*) FROM amqp.broker;
-- A failed write shows no row, so no password: neither the one written nor a stored one.
CREATE FUNCTION pg_temp.failure_of(stmt text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
    state text;
    constraint_name text;
    column_name text;
    detail text;
BEGIN
    EXECUTE stmt;
    RETURN 'accepted';
EXCEPTION WHEN OTHERS THEN
    GET STACKED DIAGNOSTICS state = RETURNED_SQLSTATE, constraint_name = CONSTRAINT_NAME,
                            column_name = COLUMN_NAME, detail = PG_EXCEPTION_DETAIL;
    RETURN concat_ws(' ', state, nullif(constraint_name, ''), nullif(column_name, ''),
                     coalesce(nullif(detail, ''), '(no detail)'));
END
$$;
INSERT INTO amqp.broker (broker_id, host, password) VALUES (77, 'kept.example', 'stored-s3cret');
SELECT what, pg_temp.failure_of(stmt) AS failure
  FROM (VALUES
    ('port 0',          $q$INSERT INTO amqp.broker (host, port, password) VALUES ('h', 0, 'new-s3cret')$q$),
    ('empty host',      $q$INSERT INTO amqp.broker (host, password) VALUES ('', 'new-s3cret')$q$),
    ('bad proof',       $q$INSERT INTO amqp.broker (host, proof, password) VALUES ('h', 'x', 'new-s3cret')$q$),
    ('cert, no key',    $q$INSERT INTO amqp.broker (host, tls_cert_file, password) VALUES ('h', '/c.pem', 'new-s3cret')$q$),
    ('NULL password',   $q$INSERT INTO amqp.broker (host, password) VALUES ('h', NULL)$q$),
    ('NULL broker_id',  $q$INSERT INTO amqp.broker (broker_id, host) VALUES (NULL, 'h')$q$),
    ('stored, port',    $q$UPDATE amqp.broker SET port = 70000 WHERE broker_id = 77$q$),
    ('stored, host',    $q$UPDATE amqp.broker SET host = NULL WHERE broker_id = 77$q$),
    ('valid update',    $q$UPDATE amqp.broker SET port = 5673 WHERE broker_id = 77$q$)
  ) AS t(what, stmt);
DELETE FROM amqp.broker WHERE broker_id = 77;
