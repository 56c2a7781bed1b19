
CREATE TRIGGER subscription_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON @extschema@.subscription
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@._config_changed();

CREATE VIEW @extschema@.worker_status AS
    SELECT s.*,
           pg_catalog.current_database()::text AS database,
           pg_catalog.current_database()::text OPERATOR(pg_catalog.=) ANY (@extschema@._served_databases())
               AS serves_this_database
      FROM @extschema@._worker_status() s;
COMMENT ON VIEW @extschema@.worker_status IS
    'This database''s workers: the outbox worker''s pid (NULL when not running) and counters since the server started, the subscription worker''s pid, and whether amqp_outbox.database lists this database.';

REVOKE ALL ON FUNCTION @extschema@._worker_status(), @extschema@._served_databases() FROM PUBLIC;
-- Grantees in the order a new install lists them.
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA @extschema@ TO amqp_outbox_admin;
GRANT EXECUTE ON FUNCTION @extschema@._worker_status(), @extschema@._served_databases() TO pg_monitor;
GRANT SELECT ON @extschema@.worker_status TO pg_monitor;
GRANT SELECT ON @extschema@.worker_status TO amqp_outbox_admin;
