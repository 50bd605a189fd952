-- Order marks: what retention deleted that a requeue's order check needs.
--
-- A requeue refuses a delivery when a later event of its key was published
-- on its route (on any route, for a `(no route)` delivery): requeued, it
-- would reach the destination after that event. Retention deletes
-- published events after `published_window` but keeps dead and cancelled
-- ones, so that later event could be gone by the time the older one is
-- requeued, and the requeue let through. When a retention batch deletes
-- published deliveries of a key that still has a delivery (or an unrouted
-- event) before them, it keeps here the latest such seq per (key, route);
-- the order checks read a mark as a published delivery. A mark no retained
-- delivery of its key sits below is removed when retention next deletes an
-- event of that key, so the table holds about one row per route of each
-- key with an old kept delivery.

CREATE TABLE ferry.purged_order (
    key   text   NOT NULL,
    route text   NOT NULL,
    seq   bigint NOT NULL,
    PRIMARY KEY (key, route)
);
