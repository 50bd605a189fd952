-- What the admin commands need.
--
-- admin_log   one row per delivery an operator requeued or cancelled: who,
--             when, from which state, and why. `ferry show` prints it.
-- failures    a requeue starts a delivery's attempt count again, so attempt
--             numbers repeat; each failure gets its own id instead of
--             (seq, route, attempt) as its key, and none is lost.
-- deliveries  a BRIN index on updated_at lets `ferry tail` find recent
--             outcomes without reading the table; it costs the relay's
--             writes next to nothing.

CREATE TABLE ferry.admin_log (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    seq        bigint      NOT NULL,
    route      text        NOT NULL,
    at         timestamptz NOT NULL DEFAULT now(),
    actor      text        NOT NULL,
    action     text        NOT NULL CHECK (action IN ('requeue', 'cancel')),
    from_state text        NOT NULL,
    attempts   int         NOT NULL,
    reason     text
);
CREATE INDEX admin_log_delivery ON ferry.admin_log (seq, route);

ALTER TABLE ferry.failures DROP CONSTRAINT failures_pkey;
ALTER TABLE ferry.failures ADD COLUMN id bigint GENERATED ALWAYS AS IDENTITY;
ALTER TABLE ferry.failures ADD PRIMARY KEY (id);
CREATE INDEX failures_delivery ON ferry.failures (seq, route, attempt);

CREATE INDEX deliveries_updated ON ferry.deliveries USING brin (updated_at);
