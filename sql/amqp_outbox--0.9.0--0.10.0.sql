-- amqp_outbox 0.9.0 -> 0.10.0
--
-- The extension's objects do not change in 0.10.0: this update only moves the installed
-- version. The plain-SQL install for hosted PostgreSQL changes its publish functions in 0.10.0
-- (sql/hosted/amqp_outbox_hosted--0.9.0--0.10.0.sql).
\echo Use "ALTER EXTENSION amqp_outbox UPDATE TO '0.10.0'" to load this file. \quit
