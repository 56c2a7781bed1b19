-- amqp.wait_for_standbys(): its errors by SQLSTATE; true at once without
-- amqp_outbox.standby_names; false after its timeout when a named standby is not there; and
-- amqp.health()'s row for that standby. (The setting is the server's: set and reset here with
-- ALTER SYSTEM on this test's own instance.)
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
\set VERBOSITY sqlstate
SELECT amqp.wait_for_standbys(NULL);
SELECT amqp.wait_for_standbys('-1 second');
SELECT amqp.wait_for_standbys();
CREATE TABLE standby_probe (x int);
INSERT INTO standby_probe VALUES (1);
-- The session has committed a write, and the setting is empty: nothing to wait for.
SELECT amqp.wait_for_standbys('0');
ALTER SYSTEM SET amqp_outbox.standby_names = 'no_such_standby';
SELECT pg_reload_conf();
SELECT pg_sleep(0.3);
SELECT current_setting('amqp_outbox.standby_names');
SELECT amqp.wait_for_standbys('50 milliseconds');
SELECT component, status FROM amqp.health() WHERE component LIKE 'standby%';
ALTER SYSTEM RESET amqp_outbox.standby_names;
SELECT pg_reload_conf();
SELECT pg_sleep(0.3);
SELECT amqp.wait_for_standbys('50 milliseconds');
SELECT count(*) FROM amqp.health() WHERE component LIKE 'standby%';
DROP TABLE standby_probe;
