-- amqp_outbox 0.1.0 -> 0.2.0
--   * the message_id is stored in amqp.message (and amqp.discarded), made once at INSERT;
--   * pg_dump keeps every row of the user's tables and the sequences behind their ids;
--   * amqp.worker_status says which database the worker serves;
--   * a failed write to amqp.broker no longer shows the row (and its password).
\echo Use "ALTER EXTENSION amqp_outbox UPDATE TO '0.2.0'" to load this file. \quit

CREATE FUNCTION @extschema@."_new_message_id"() RETURNS TEXT STRICT VOLATILE PARALLEL SAFE
    LANGUAGE c AS 'MODULE_PATHNAME', 'new_message_id_wrapper';

-- Rows already there keep the id 0.1.0 derived for them when it published them (system
-- identifier, database, table and row id, in hex): a copy that went out before the update and a
-- resend after it carry the same message_id.
ALTER TABLE @extschema@.message ADD COLUMN message_id text;
ALTER TABLE @extschema@.discarded ADD COLUMN message_id text;
WITH p AS (
    SELECT pg_catalog.to_hex(s.system_identifier) OPERATOR(pg_catalog.||) '-'
           OPERATOR(pg_catalog.||) pg_catalog.to_hex(d.oid::pg_catalog.int8) OPERATOR(pg_catalog.||) '-'
           OPERATOR(pg_catalog.||) pg_catalog.to_hex('@extschema@.message'::pg_catalog.regclass::pg_catalog.oid::pg_catalog.int8)
           OPERATOR(pg_catalog.||) '-' AS prefix
      FROM pg_catalog.pg_control_system() s, pg_catalog.pg_database d
     WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database()
), m AS (
    UPDATE @extschema@.message m SET message_id = p.prefix OPERATOR(pg_catalog.||) m.id::pg_catalog.text
      FROM p
)
UPDATE @extschema@.discarded m SET message_id = p.prefix OPERATOR(pg_catalog.||) m.id::pg_catalog.text
  FROM p;

ALTER TABLE @extschema@.message
    ALTER COLUMN message_id SET NOT NULL,
    ALTER COLUMN message_id SET DEFAULT @extschema@._new_message_id(),
    ADD CONSTRAINT message_message_id_valid
        CHECK (message_id <> '' AND pg_catalog.octet_length(message_id) <= 255);
ALTER TABLE @extschema@.discarded ALTER COLUMN message_id SET NOT NULL;
COMMENT ON COLUMN @extschema@.message.message_id IS
    'The AMQP message_id: a UUIDv7 made at INSERT, the same on every resend, never repeated (not after a restore or a point-in-time recovery).';

SELECT pg_catalog.pg_extension_config_dump('@extschema@.broker', '');
SELECT pg_catalog.pg_extension_config_dump('@extschema@.exchange', '');
SELECT pg_catalog.pg_extension_config_dump('@extschema@.queue', '');
SELECT pg_catalog.pg_extension_config_dump('@extschema@.binding', '');
SELECT pg_catalog.pg_extension_config_dump('@extschema@.message', '');
SELECT pg_catalog.pg_extension_config_dump('@extschema@.discarded', '');
SELECT pg_catalog.pg_extension_config_dump(
    pg_catalog.pg_get_serial_sequence('@extschema@.broker', 'broker_id')::pg_catalog.regclass, '');
SELECT pg_catalog.pg_extension_config_dump(
    pg_catalog.pg_get_serial_sequence('@extschema@.message', 'id')::pg_catalog.regclass, '');

CREATE OR REPLACE VIEW @extschema@.message_status AS
    SELECT m.id, m.broker_id, m.exchange, m.routing_key,
           CASE WHEN m.parked_at IS NOT NULL THEN 'parked'
                WHEN f.confirmed THEN 'awaiting_ack'
                WHEN f.id IS NOT NULL THEN 'in_flight'
                WHEN m.next_attempt_at OPERATOR(pg_catalog.>) pg_catalog.now() THEN 'retry_wait'
                ELSE 'pending' END AS state,
           m.attempts, m.created_at, m.next_attempt_at, m.parked_at, m.last_error,
           m.producer_pid, m.producer_started_at, m.message_id
      FROM @extschema@.message m
      LEFT JOIN @extschema@._in_flight() f ON f.id OPERATOR(pg_catalog.=) m.id;

REVOKE ALL ON FUNCTION @extschema@._new_message_id() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@._new_message_id() TO amqp_outbox_admin;

CREATE OR REPLACE VIEW @extschema@.worker_status AS
    SELECT s.*,
           pg_catalog.current_setting('amqp_outbox.database', true) AS database,
           pg_catalog.current_setting('amqp_outbox.database', true)
               IS NOT DISTINCT FROM pg_catalog.current_database() AS serves_this_database
      FROM @extschema@._worker_status() s;
COMMENT ON VIEW @extschema@.worker_status IS
    'The worker''s pid (NULL when not running), its counters since the server started, the database it serves and whether that is this one.';

-- A failed INSERT or UPDATE of amqp.broker would report the whole row ("Failing row contains
-- ...") to the client and into the server log, password included, even a stored one the
-- statement did not name. This trigger checks the NOT NULL columns and the CHECK constraints
-- first and raises the same errors (same SQLSTATE, constraint and column) without the row.
CREATE FUNCTION @extschema@._broker_check() RETURNS trigger
    LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $check$
DECLARE
    null_column text := CASE WHEN NEW.broker_id IS NULL THEN 'broker_id'
                             WHEN NEW.host IS NULL THEN 'host'
                             WHEN NEW.port IS NULL THEN 'port'
                             WHEN NEW.vhost IS NULL THEN 'vhost'
                             WHEN NEW.username IS NULL THEN 'username'
                             WHEN NEW.password IS NULL THEN 'password'
                             WHEN NEW.proof IS NULL THEN 'proof'
                             WHEN NEW.tls IS NULL THEN 'tls' END;
    failed text := CASE WHEN NEW.host = '' THEN 'broker_host_not_empty'
                        WHEN NEW.port NOT BETWEEN 1 AND 65535 THEN 'broker_port_range'
                        WHEN NEW.proof NOT IN ('ack_queue', 'confirm') THEN 'broker_proof_valid'
                        WHEN (NEW.tls_cert_file IS NULL) <> (NEW.tls_key_file IS NULL)
                            THEN 'broker_tls_client_pair' END;
BEGIN
    IF null_column IS NOT NULL THEN
        RAISE EXCEPTION 'null value in column "%" of relation "broker" violates not-null constraint',
                        null_column
            USING ERRCODE = 'not_null_violation', SCHEMA = 'amqp', TABLE = 'broker',
                  COLUMN = null_column;
    END IF;
    IF failed IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "broker" violates check constraint "%"', failed
            USING ERRCODE = 'check_violation', SCHEMA = 'amqp', TABLE = 'broker',
                  CONSTRAINT = failed;
    END IF;
    RETURN NEW;
END
$check$;
CREATE TRIGGER broker_check BEFORE INSERT OR UPDATE ON @extschema@.broker
    FOR EACH ROW EXECUTE FUNCTION @extschema@._broker_check();

REVOKE ALL ON FUNCTION @extschema@._broker_check() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@._broker_check() TO amqp_outbox_admin;
