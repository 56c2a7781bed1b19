-- amqp_outbox 0.11.0 -> 0.12.0
--
-- amqp._uuid7_time() is no longer STRICT, so that PostgreSQL inlines it into the statements that
-- call it (consume_once() and the subscriptions' consumption records, receipts, trace()) instead
-- of parsing and planning its body again in every transaction and subtransaction. Its result is
-- the same for every input, NULL included (see sql/inbox.sql).
\echo Use "ALTER EXTENSION amqp_outbox UPDATE TO '0.12.0'" to load this file. \quit

ALTER FUNCTION @extschema@._uuid7_time(text) CALLED ON NULL INPUT;
