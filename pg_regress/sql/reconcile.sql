-- Reconciliation's SQL contract: tags at publish and their bad input, monitoring rules,
-- receipts, the monitor's classification and actions, compensation registration, trace,
-- daily statistics, reconciliation views, health. The worker publishes nothing here (enabled =
-- off) and sees nothing of this uncommitted transaction: the monitor is called by hand.
\set VERBOSITY terse
SET client_min_messages = warning;
CREATE EXTENSION IF NOT EXISTS amqp_outbox;
RESET client_min_messages;
BEGIN;
\set ON_ERROR_ROLLBACK on
INSERT INTO amqp.broker (broker_id, host) VALUES (1, '127.0.0.1');

-- Tags: given as arguments, or taken from the session's settings; unset ones stay NULL (the
-- worker fills in the database and host names when it sends).
SELECT amqp.publish_message(1, 'users', 'user.registered', '{"id": 7}',
                            business_type => 'registration', business_key => 'user-7') > 0 AS tagged;
SET LOCAL amqp_outbox.system_id = 'shop';
SET LOCAL amqp_outbox.host_id = 'db-1';
SET LOCAL amqp_outbox.traceparent = '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01';
SELECT amqp.publish(1, 'users', 'user.deleted', 'pg_amqp signature') AS pg_amqp_call;
SELECT amqp.publish_message(1, 'users', 'user.renamed', 'explicit trace', NULL, NULL, NULL, NULL, NULL,
                            NULL, NULL, '00-11111111111111111111111111111111-2222222222222222-00') > 0 AS explicit;
RESET amqp_outbox.system_id;
RESET amqp_outbox.host_id;
RESET amqp_outbox.traceparent;
SELECT amqp.publish_bytes(1, 'users', 'user.avatar', '\x00ff'::bytea, business_key => 'user-7') > 0 AS bytes;
SELECT routing_key, business_type, business_key, system_id, host_id, traceparent, resends
  FROM amqp.message ORDER BY id;

\set VERBOSITY sqlstate
-- Bad tags: 22023 (empty, not trace context), 22001 (too long). Nothing is inserted.
SELECT amqp.publish_message(1, 'users', 'k', 'b', business_type => '');
SELECT amqp.publish_message(1, 'users', 'k', 'b', business_key => '');
SELECT amqp.publish_message(1, 'users', 'k', 'b', business_type => repeat('t', 256));
SELECT amqp.publish_message(1, 'users', 'k', 'b', business_key => repeat('k', 1001));
SELECT amqp.publish_message(1, 'users', 'k', 'b', traceparent => 'not-a-trace');
SELECT amqp.publish_message(1, 'users', 'k', 'b', traceparent => '00-00000000000000000000000000000000-b7ad6b7169203331-01');
SET LOCAL amqp_outbox.traceparent = 'garbage';
SELECT amqp.publish(1, 'users', 'k', 'b');
RESET amqp_outbox.traceparent;
SELECT length(set_config('amqp_outbox.system_id', repeat('s', 256), true));
SELECT amqp.publish(1, 'users', 'k', 'b');
RESET amqp_outbox.system_id;
\set VERBOSITY terse
SELECT count(*) AS messages FROM amqp.message;

-- Monitoring rules and their bad input (23514).
INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after, action) VALUES
    ('registration', '{coupon,mail}', '3 s', '30 s', 'compensate'),
    ('order', '{billing}', '3 s', '30 s', 'resend'),
    ('audit', '{archive}', '3 s', '30 s', 'report');
\set VERBOSITY sqlstate
INSERT INTO amqp.monitor_rule (business_type, consumers) VALUES ('x', '{}');
INSERT INTO amqp.monitor_rule (business_type, consumers) VALUES ('x', '{a,NULL}');
INSERT INTO amqp.monitor_rule (business_type, consumers) VALUES ('', '{a}');
INSERT INTO amqp.monitor_rule (business_type, consumers, late_after, lost_after) VALUES ('x', '{a}', '10 s', '5 s');
INSERT INTO amqp.monitor_rule (business_type, consumers, late_after) VALUES ('x', '{a}', '0 s');
INSERT INTO amqp.monitor_rule (business_type, consumers, action) VALUES ('x', '{a}', 'ignore');
\set VERBOSITY terse

-- Compensation handlers: the signature is checked (42P13), NULL removes.
CREATE TABLE compensated (message_id text, consumer text, business_key text, error text);
CREATE FUNCTION undo_registration(original amqp.produced, failure amqp.receipt) RETURNS void
    LANGUAGE sql AS $$ INSERT INTO compensated VALUES (original.message_id, failure.consumer, original.business_key, failure.error) $$;
CREATE FUNCTION wrong_shape(d amqp.delivery) RETURNS void LANGUAGE sql AS $$ SELECT $$;
\set VERBOSITY sqlstate
SELECT amqp.on_failure('registration', 'wrong_shape(amqp.delivery)');
SELECT amqp.on_failure('', 'undo_registration(amqp.produced, amqp.receipt)');
\set VERBOSITY terse
SELECT amqp.on_failure('registration', 'undo_registration(amqp.produced, amqp.receipt)');
SELECT amqp.on_failure('order', 'undo_registration(amqp.produced, amqp.receipt)');
SELECT amqp.on_failure('order', NULL);
SELECT business_type, handler FROM amqp.compensation_handler ORDER BY 1;

-- The production log, as the worker writes it (here by hand): monitored messages delivered at
-- several times before now, each due for a look. Their ids are real UUIDv7, so they land in the
-- day their id names. 'outage' was made ten minutes ago but reached the broker only now.
CREATE TEMP TABLE ids (key text, message_id text);
INSERT INTO ids SELECT k, amqp._new_message_id()
  FROM unnest(ARRAY['fresh', 'slow', 'silent', 'failing', 'done', 'o-lost', 'o-spent', 'audit-lost', 'outage', 'unruled']) k;
INSERT INTO amqp.produced (message_id, message_at, seq, broker_id, exchange, routing_key, system_id, host_id,
                           business_type, business_key, producer_pid, producer_started_at, created_at,
                           published_at, delivered_at, expected, body, delivery_mode, resends,
                           last_resent_at, redelivered_at, check_at)
SELECT i.message_id, amqp._uuid7_time(i.message_id), 100 + row_number() OVER (ORDER BY i.key), 1, 'ex', 'rk', 'shop', 'db-1',
       CASE WHEN i.key IN ('o-lost', 'o-spent') THEN 'order' WHEN i.key = 'audit-lost' THEN 'audit'
            WHEN i.key = 'unruled' THEN 'gone' ELSE 'registration' END,
       i.key, 1, now(), now() - a.age - CASE WHEN i.key = 'outage' THEN interval '10 min' ELSE '0' END,
       now() - a.age, now() - a.age,
       CASE WHEN i.key IN ('o-lost', 'o-spent') THEN '{billing}'::text[] WHEN i.key = 'audit-lost' THEN '{archive}'
            ELSE '{coupon,mail}' END,
       convert_to('body of ' || i.key, 'UTF8'), 2,
       CASE WHEN i.key = 'o-spent' THEN 3 ELSE 0 END,
       CASE WHEN i.key = 'o-spent' THEN now() - interval '61 s' END,
       CASE WHEN i.key = 'o-spent' THEN now() - a.age END,
       now()
  FROM ids i JOIN (VALUES ('fresh', interval '1 s'), ('slow', '10 s'), ('silent', '60 s'), ('failing', '10 s'),
                          ('done', '10 s'), ('o-lost', '60 s'), ('o-spent', '60 s'), ('audit-lost', '60 s'),
                          ('outage', '1 s'), ('unruled', '60 s')) a(key, age) ON a.key = i.key;

-- Receipts arrive through a subscription's handler, amqp.record_receipt.
CREATE FUNCTION receipt_for(key text, consumer text, status text) RETURNS amqp.delivery LANGUAGE sql AS $$
    SELECT ROW('amqp_outbox.receipts', 'r-' || key || '-' || consumer, 'receipts', consumer,
               convert_to(jsonb_build_object('v', 1, 'message_id', (SELECT message_id FROM ids WHERE ids.key = receipt_for.key),
                                             'consumer', consumer, 'status', status,
                                             'error', CASE WHEN status = 'failed' THEN 'coupon service down' END,
                                             'at', '2026-01-01T00:00:00Z', 'business_type', 'registration')::text, 'UTF8'),
               '{}'::jsonb, 'application/json', NULL, NULL, false, 1, NULL, 1, NULL)::amqp.delivery $$;
SELECT amqp.record_receipt(receipt_for('slow', 'coupon', 'ok'));
SELECT amqp.record_receipt(receipt_for('failing', 'coupon', 'failed'));
SELECT amqp.record_receipt(receipt_for('failing', 'mail', 'ok'));
SELECT amqp.record_receipt(receipt_for('done', 'coupon', 'ok'));
SELECT amqp.record_receipt(receipt_for('done', 'mail', 'ok'));
\set VERBOSITY sqlstate
-- What is not a receipt fails the receipt's handling (22P02, 22023), and records nothing.
SELECT amqp.record_receipt(ROW('s', 'bad-1', 'e', 'k', 'not json'::bytea, '{}', NULL, NULL, NULL, false, 1, NULL, 1, NULL)::amqp.delivery);
SELECT amqp.record_receipt(ROW('s', 'bad-2', 'e', 'k', convert_to('{"message_id": 5}', 'UTF8'), '{}', NULL, NULL, NULL, false, 1, NULL, 1, NULL)::amqp.delivery);
SELECT amqp.record_receipt(ROW('s', 'bad-3', 'e', 'k', convert_to('{"message_id": "m", "consumer": "c", "status": "maybe"}', 'UTF8'), '{}', NULL, NULL, NULL, false, 1, NULL, 1, NULL)::amqp.delivery);
-- A message_id of ours from the future (it would make history partitions retention never
-- drops): 22023.
SELECT amqp.record_receipt(ROW('s', 'bad-4', 'e', 'k', convert_to('{"message_id": "ffffffff-ffff-7fff-bfff-ffffffffffff", "consumer": "c", "status": "ok"}', 'UTF8'), '{}', NULL, NULL, NULL, false, 1, NULL, 1, NULL)::amqp.delivery);
-- Once amqp.receipt_sender lists a consumer's RabbitMQ user, a receipt counts only when its
-- user_id (RabbitMQ checks it against the publishing connection) is that user: a forged
-- receipt (another user, none, or a consumer not listed) fails with 42501 and records nothing.
INSERT INTO amqp.receipt_sender VALUES ('coupon', 'coupon_svc');
CREATE FUNCTION receipt_from(key text, consumer text, sender text) RETURNS amqp.delivery LANGUAGE sql AS $$
    SELECT ROW(d.subscription, d.message_id || '-from', d.exchange, d.routing_key, d.body, d.headers,
               d.content_type, d.correlation_id, d.reply_to, d.redelivered, d.delivery_tag,
               d."timestamp", d.attempt, sender)::amqp.delivery
      FROM receipt_for(key, consumer, 'ok') d $$;
SELECT amqp.record_receipt(receipt_from('silent', 'coupon', 'mallory'));
SELECT amqp.record_receipt(receipt_from('silent', 'coupon', NULL));
SELECT amqp.record_receipt(receipt_from('silent', 'mail', 'coupon_svc'));
SELECT count(*) AS forged_recorded FROM amqp.receipt r JOIN ids i USING (message_id) WHERE i.key = 'silent';
SELECT amqp.record_receipt(receipt_from('fresh', 'coupon', 'coupon_svc'));
DELETE FROM amqp.receipt r USING ids i WHERE r.message_id = i.message_id AND i.key = 'fresh';
DELETE FROM amqp.receipt_sender;
\set VERBOSITY terse
SELECT i.key, r.consumer, r.status, r.error, r.business_type, r.answered_at
  FROM amqp.receipt r JOIN ids i USING (message_id) ORDER BY 1, 2;

-- The receipts are collected through a subscription whose queue was last seen empty 45 s ago:
-- an answer sent since may still wait there, so nothing that was due to answer after that is
-- lost yet.
INSERT INTO amqp.subscription (subscription, broker_id, queue, handler)
VALUES ('amqp_outbox.receipts', 1, 'q.receipts', 'amqp.record_receipt(amqp.delivery)');
INSERT INTO amqp._subscription_state (subscription, caught_up_at) VALUES ('amqp_outbox.receipts', now() - interval '45 s');
\set VERBOSITY sqlstate
SELECT amqp._monitor(0);
\set VERBOSITY terse
-- The first pass: looks at every due message (10), counts the receipts. 'done' completes;
-- 'failing' has a compensation queued for coupon; 'slow' and the silent ones are late (timed
-- from delivery: 'outage' is not), and so are 'done' and 'failing', whose answers came 10 s
-- after their delivery (late_after 3 s); 'fresh' and 'outage' are looked at next when they
-- would be lost (being late needs no look); nothing is lost while receipts are behind (each
-- looked at again when the collection could have caught up: in 15 s); a message whose rule is
-- gone stops being monitored.
SELECT amqp._monitor() AS looked;
SELECT i.key, p.late_at IS NOT NULL AS late, p.lost_at IS NOT NULL AS lost, p.resends, p.outcome,
       p.answered_ok, p.answered_failed, p.check_at - now() AS next_look
  FROM amqp.produced p JOIN ids i USING (message_id) ORDER BY 1;
SELECT i.key, c.consumer, c.state FROM amqp.compensation c JOIN ids i USING (message_id) ORDER BY 1, 2;
-- A pass with nothing due looks at nothing.
SELECT amqp._monitor() AS looked_again;
-- Being late needs no look: 'fresh', as if delivered 4 s earlier, is late in the views at once,
-- with nothing written to its record (not stamped, its next look unchanged).
UPDATE amqp.produced p SET delivered_at = p.delivered_at - interval '4 s'
  FROM ids i WHERE i.message_id = p.message_id AND i.key = 'fresh';
SELECT i.key, r.status, r.waiting_for, p.late_at IS NULL AS not_stamped, p.check_at - now() AS next_look
  FROM amqp.reconciliation r JOIN ids i USING (message_id) JOIN amqp.produced p USING (message_id)
 WHERE i.key IN ('fresh', 'outage') ORDER BY 1;
UPDATE amqp.produced p SET delivered_at = p.delivered_at + interval '4 s'
  FROM ids i WHERE i.message_id = p.message_id AND i.key = 'fresh';

-- The receipts catch up, and time passes (every look due now). 'silent' is given up under
-- 'compensate' ('lost' answers, a compensation per consumer); 'o-lost' is resent with its
-- message_id; 'o-spent' has used its max_resends (3) and is lost; 'audit-lost' ('report') is
-- lost, finished. max_messages bounds a pass.
UPDATE amqp._subscription_state SET caught_up_at = now();
UPDATE amqp.produced SET check_at = now() WHERE check_at IS NOT NULL;
SELECT amqp._monitor(2) AS looked_first, amqp._monitor() AS looked_rest;
SELECT i.key, p.late_at IS NOT NULL AS late, p.lost_at IS NOT NULL AS lost, p.resends,
       p.last_resent_at IS NOT NULL AS resent, p.outcome, p.answered_failed, p.check_at - now() AS next_look
  FROM amqp.produced p JOIN ids i USING (message_id) ORDER BY 1;
SELECT i.key, m.routing_key, m.business_type, m.business_key, m.resends, convert_from(m.body, 'UTF8') AS body
  FROM amqp.message m JOIN ids i USING (message_id);
SELECT i.key, c.consumer, c.state, c.attempts FROM amqp.compensation c JOIN ids i USING (message_id) ORDER BY 1, 2;
SELECT i.key, r.consumer, r.status, r.error FROM amqp.receipt r JOIN ids i USING (message_id)
 WHERE r.status = 'lost' ORDER BY 1, 2;

-- Looked at again before the copy reached the broker: never a second copy while one waits.
UPDATE amqp.produced SET check_at = now() WHERE check_at IS NOT NULL;
SELECT amqp._monitor() AS looked;
SELECT i.key, p.resends, (SELECT count(*) FROM amqp.message m WHERE m.message_id = p.message_id) AS copies
  FROM amqp.produced p JOIN ids i USING (message_id) WHERE i.key = 'o-lost';

-- coupon answers ok for 'failing' before its compensation ran: the compensation is cancelled
-- and the message completes. A receipt for a finished message ('audit-lost') changes nothing
-- but its trace (not even the statistics).
SELECT amqp.record_receipt(receipt_for('failing', 'coupon', 'ok'));
-- (Later than its failure: in one transaction both would carry the same time.)
UPDATE amqp.receipt r SET received_at = now() + interval '1 s' FROM ids i
 WHERE i.message_id = r.message_id AND i.key = 'failing' AND r.consumer = 'coupon' AND r.status = 'ok';
SELECT amqp.record_receipt(receipt_for('audit-lost', 'archive', 'ok'));
-- Nor does an answer from a consumer the rule does not expect.
SELECT amqp.record_receipt(receipt_for('fresh', 'stranger', 'failed'));
SELECT amqp._monitor() AS looked;
SELECT i.key, c.consumer, c.state FROM amqp.compensation c JOIN ids i USING (message_id) ORDER BY 1, 2;
SELECT i.key, p.outcome, p.answered_ok, p.answered_failed FROM amqp.produced p JOIN ids i USING (message_id)
 WHERE i.key IN ('failing', 'audit-lost', 'fresh') ORDER BY 1;

-- What the monitor does to run a compensation: the handler, then done (which brings the
-- message's next look), in one transaction. Once every failure of 'silent' is compensated, it
-- is finished as compensated.
SELECT undo_registration(p, r)
  FROM amqp.produced p JOIN amqp.receipt r USING (message_id, message_at) JOIN ids i USING (message_id)
 WHERE i.key = 'silent' AND r.status = 'lost';
UPDATE amqp.compensation c SET state = 'done', done_at = now(), attempts = 1
  FROM ids i WHERE i.message_id = c.message_id AND i.key = 'silent';
UPDATE amqp.produced p SET check_at = now() FROM ids i WHERE i.message_id = p.message_id AND i.key = 'silent';
SELECT amqp._monitor() AS looked;
SELECT business_key, consumer, error FROM compensated ORDER BY 2;
SELECT i.key, p.outcome FROM amqp.produced p JOIN ids i USING (message_id) WHERE p.completed_at IS NOT NULL ORDER BY 1;

-- The views: what is not finished, or finished lost or failed, counted.
SELECT i.key, r.status, r.waiting_for, r.failed_at, r.outbox
  FROM amqp.reconciliation r JOIN ids i USING (message_id) ORDER BY 1, r.outbox;
SELECT business_type, status, messages FROM amqp.reconciliation_summary ORDER BY 1, 2;
SELECT business_type, produced, delivered, consumed, late, lost, resent, compensated, parked, failed
  FROM amqp.daily_stats ORDER BY 1;

-- One message's life.
SELECT event, detail FROM amqp.trace((SELECT message_id FROM ids WHERE key = 'failing'));
SELECT event FROM amqp.trace((SELECT message_id FROM ids WHERE key = 'o-lost'));
SELECT event FROM amqp.trace((SELECT message_id FROM ids WHERE key = 'audit-lost'));
SELECT count(*) AS unknown FROM amqp.trace('no-such-message');

-- Health: one row per check; the monitored messages as the monitor counted them.
SELECT amqp._summarize();
SELECT component FROM amqp.health();
SELECT status, detail FROM amqp.health() WHERE component IN ('lost', 'late', 'failed', 'parked') ORDER BY component;

-- Day partitions: made when the default partition holds rows of a day (the worker does it),
-- moving them in. A day ten days ahead has none.
INSERT INTO amqp.produced (message_id, message_at, seq, broker_id, exchange, routing_key, system_id, host_id,
                           business_type, producer_pid, producer_started_at, created_at)
VALUES ('ahead', now() + interval '10 days', 1, 1, 'ex', 'rk', 's', 'h', 't', 1, now(), now());
SELECT tableoid::regclass AS stored_in FROM amqp.produced WHERE message_id = 'ahead';
SELECT amqp._history_day('produced', amqp._day(now() + interval '10 days')) AS made,
       amqp._history_day('produced', amqp._day(now() + interval '10 days')) AS again;
SELECT tableoid::regclass::text ~ '^amqp\.produced_[0-9]{8}$' AS moved_to_its_day,
       (SELECT count(*) FROM amqp.produced_default WHERE message_id = 'ahead') AS left_in_default
  FROM amqp.produced WHERE message_id = 'ahead';
\set VERBOSITY sqlstate
SELECT amqp._history_day('message', current_date);
\set VERBOSITY terse
ROLLBACK;
