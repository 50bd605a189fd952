-- Gives up on an event whose failure was just counted.
UPDATE ferry_inbox
SET state = 'dead', last_error = ?3, processed_at = CAST(unixepoch('subsec') * 1000000 AS INTEGER)
WHERE consumer = ?1 AND event_id = ?2
