-- publish() checks broker_id against a list each session keeps; every change to amqp.broker
-- must be seen, in the changing transaction at once, after a rollback, and by other sessions.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
DELETE FROM amqp.message;
DELETE FROM amqp.broker WHERE broker_id BETWEEN 700 AND 799;
-- Unknown, and the list is now loaded.
SELECT amqp.publish(701, 'ex', 'rk', 'unknown yet');
-- Added in this transaction: publishable in the same transaction.
BEGIN;
INSERT INTO amqp.broker (broker_id, host) VALUES (701, 'lookup-a.example');
SELECT amqp.publish(701, 'ex', 'rk', 'same transaction');
ROLLBACK;
-- The insert rolled back: unknown again.
SELECT amqp.publish(701, 'ex', 'rk', 'after rollback');
-- Committed, then published in later transactions.
INSERT INTO amqp.broker (broker_id, host) VALUES (701, 'lookup-a.example');
SELECT amqp.publish(701, 'ex', 'rk', 'committed broker');
-- Renumbered: the old id is unknown, the new one known.
UPDATE amqp.broker SET broker_id = 702 WHERE broker_id = 701;
SELECT amqp.publish(701, 'ex', 'rk', 'old id');
SELECT amqp.publish(702, 'ex', 'rk', 'new id');
-- A savepoint rolled back undoes a delete for the lookup too.
BEGIN;
SAVEPOINT s;
DELETE FROM amqp.broker WHERE broker_id = 702;
SELECT amqp.publish(702, 'ex', 'rk', 'deleted in savepoint');
ROLLBACK TO SAVEPOINT s;
SELECT amqp.publish(702, 'ex', 'rk', 'delete undone');
COMMIT;
-- Another session's committed change is seen by this one's next transaction (dblink is that
-- other session, on this server).
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS dblink;
RESET client_min_messages;
SELECT amqp.publish(703, 'ex', 'rk', 'not yet added by the other session');
SELECT dblink_exec(format('dbname=%s port=%s host=%s', current_database(),
                          current_setting('port'),
                          split_part(current_setting('unix_socket_directories'), ',', 1)),
                   'INSERT INTO amqp.broker (broker_id, host) VALUES (703, ''lookup-b.example'')');
SELECT amqp.publish(703, 'ex', 'rk', 'added by the other session');
SELECT dblink_exec(format('dbname=%s port=%s host=%s', current_database(),
                          current_setting('port'),
                          split_part(current_setting('unix_socket_directories'), ',', 1)),
                   'DELETE FROM amqp.broker WHERE broker_id = 703');
SELECT amqp.publish(703, 'ex', 'rk', 'deleted by the other session');
-- TRUNCATE also empties the list.
BEGIN;
TRUNCATE amqp.broker CASCADE;
SELECT amqp.publish(702, 'ex', 'rk', 'after truncate');
ROLLBACK;
SELECT broker_id, convert_from(body, 'UTF8') AS body FROM amqp.message ORDER BY id;
DELETE FROM amqp.message;
DELETE FROM amqp.broker WHERE broker_id BETWEEN 700 AND 799;
DROP EXTENSION dblink;
