
CREATE TRIGGER subscription_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON @extschema@.subscription
    FOR EACH STATEMENT EXECUTE FUNCTION @extschema@._config_changed();

CREATE VIEW @extschema@.worker_status AS
    SELECT s.worker_pid, s.published, s.confirmed, s.acknowledged, s.resent_lost,
           s.resent_timeout, s.failed, s.parked, s.ack_queue, s.steps, s.commit_wakeups,
           s.subscription_worker_pid, d.datname::text AS database, s.state
      FROM @extschema@._worker_status() s
      LEFT JOIN pg_catalog.pg_database d ON d.oid OPERATOR(pg_catalog.=) s.database_oid
     ORDER BY d.datname;
COMMENT ON VIEW @extschema@.worker_status IS
    'One row per database the launcher serves or cannot serve, and one for this database: state (running, starting, paused, not served: why), the workers'' pids, and the outbox worker''s counters since the database got its workers.';

REVOKE ALL ON FUNCTION @extschema@._worker_status(), @extschema@._serves_this_database() FROM PUBLIC;
-- Grantees in the order a new install lists them.
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA @extschema@ TO amqp_outbox_admin;
GRANT EXECUTE ON FUNCTION @extschema@._worker_status(), @extschema@._serves_this_database() TO pg_monitor;
GRANT SELECT ON @extschema@.worker_status TO pg_monitor;
GRANT SELECT ON @extschema@.worker_status TO amqp_outbox_admin;
