-- The settings are a contract with DBAs' postgresql.conf: names, defaults, units, when they
-- take effect (postmaster: at start; sighup: on reload; user: per session).
-- The amqp_outbox.test_* settings exist only in a test build (feature fault-injection).
SELECT name, boot_val, unit, context, vartype, min_val, max_val
  FROM pg_settings
 WHERE name LIKE 'amqp\_outbox.%' AND name NOT LIKE 'amqp\_outbox.test\_%'
 ORDER BY name;
