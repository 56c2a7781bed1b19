-- The user surface: every function, table, view and column a user may name, with arguments,
-- defaults, results and types (internal objects, named with a leading underscore, left out).
-- The plain-SQL install for hosted PostgreSQL (scripts/installcheck_hosted.sh) runs this same
-- file and must show the same.
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
SELECT p.proname, pg_get_function_arguments(p.oid) AS arguments,
       pg_get_function_result(p.oid) AS result, p.proisstrict AS strict
  FROM pg_proc p
 WHERE p.pronamespace = 'amqp'::regnamespace AND p.proname !~ '^_'
 ORDER BY 1, 2;
SELECT c.relname, c.relkind, a.attname, format_type(a.atttypid, a.atttypmod) AS type,
       a.attnotnull AS not_null, pg_get_expr(d.adbin, d.adrelid) AS default
  FROM pg_class c
  JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
  LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
 WHERE c.relnamespace = 'amqp'::regnamespace AND c.relkind IN ('r', 'v', 'p') AND c.relname !~ '^_'
 ORDER BY c.relname, a.attnum;
-- Who may call what: the roles' EXECUTE rights on the user functions.
SELECT r.rolname, count(*) AS functions
  FROM pg_proc p CROSS JOIN pg_roles r
 WHERE p.pronamespace = 'amqp'::regnamespace AND p.proname !~ '^_'
   AND r.rolname IN ('amqp_outbox_publisher', 'amqp_outbox_admin', 'amqp_outbox_consumer')
   AND has_function_privilege(r.oid, p.oid, 'EXECUTE')
 GROUP BY r.rolname ORDER BY 1;
