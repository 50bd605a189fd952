-- Attempts at an event that started and never finished: the process
-- handling it died inside the handler, and the attempt's claim rolled back
-- with its count. Mirrors `ferry.inbox.unfinished` (PostgreSQL migration
-- 25); see there.
ALTER TABLE ferry_inbox ADD COLUMN unfinished INTEGER NOT NULL DEFAULT 0;
