
-- As monitor.sql grants it.
REVOKE ALL ON FUNCTION @extschema@._monitor(integer, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@._monitor(integer, boolean) TO amqp_outbox_admin;
