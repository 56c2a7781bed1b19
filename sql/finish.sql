-- amqp_outbox: objects that need the functions defined by pgrx.

-- Direct INSERTs into amqp.message get the producer key of the inserting session too.
ALTER TABLE @extschema@.message
    ALTER COLUMN producer_started_at SET DEFAULT @extschema@._producer_started_at();

-- The worker re-reads brokers and declarations after a transaction that changes them commits.
CREATE TRIGGER broker_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON @extschema@.broker
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@._config_changed();
CREATE TRIGGER exchange_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON @extschema@.exchange
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@._config_changed();
