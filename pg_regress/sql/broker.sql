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
