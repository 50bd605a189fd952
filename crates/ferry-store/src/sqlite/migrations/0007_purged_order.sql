-- Order marks: what retention deleted that a requeue's order check needs.
-- Mirrors `ferry.purged_order` (PostgreSQL migration 31); see there.
CREATE TABLE ferry_purged_order (
    key   TEXT    NOT NULL,
    route TEXT    NOT NULL,
    seq   INTEGER NOT NULL,
    PRIMARY KEY (key, route)
) STRICT;
