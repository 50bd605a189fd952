-- Each inbox attempt's claim gets a number of its own. An attempt tells
-- whether its claim committed (a handler may end the inbox's transaction
-- itself) by finding the row with its claim; the time it used before has
-- millisecond precision, so a second delivery of the same event, queued
-- on the write lock behind one whose transaction SQLite rolled back, could
-- claim in the same millisecond, and the first attempt took the second's
-- committed claim for its own. A random 64-bit number per attempt is not
-- shared that way. Rows written before this migration have none, and no
-- attempt in progress matches them.
ALTER TABLE ferry_inbox ADD COLUMN claim INTEGER;
