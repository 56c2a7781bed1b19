-- The plain-SQL install (sql/hosted/), run by a role that is not a superuser: CREATE on the
-- database and CREATEROLE, what a hosted service's administrator has.
CREATE ROLE hosted_admin LOGIN CREATEROLE;
GRANT CREATE ON DATABASE contrib_regression TO hosted_admin;
-- Services' administrator roles can read every session's statistics: publish() then keys each
-- producer by its backend's start time, as the extension does (without it, by the time of the
-- session's first publishing transaction).
GRANT pg_monitor TO hosted_admin;
SET ROLE hosted_admin;
\set ECHO none
\ir amqp_outbox_hosted.sql
\set ECHO all
RESET ROLE;
-- Nothing of the extension: no library, no extension, the same schema.
SELECT count(*) AS extensions FROM pg_extension WHERE extname = 'amqp_outbox';
SELECT nspname, pg_get_userbyid(nspowner) AS owner FROM pg_namespace WHERE nspname = 'amqp';
SELECT count(*) AS library_functions FROM pg_proc WHERE prolang = (SELECT oid FROM pg_language WHERE lanname = 'c')
   AND pronamespace = 'amqp'::regnamespace;
