-- An event and its unrouted row are written by one statement: the insert
-- into ferry_events, whose trigger adds the unrouted row. In SQLite a
-- failed statement does not end the transaction, so with two statements a
-- failure of the second (a full disk) left the event to commit without
-- its unrouted row, never delivered, if the caller committed anyway.
CREATE TRIGGER ferry_events_unrouted AFTER INSERT ON ferry_events
BEGIN
    INSERT INTO ferry_unrouted (seq, partition) VALUES (NEW.seq, NEW.partition);
END;

-- A producer built before this migration still inserts the unrouted row
-- itself, after the trigger did: that insert is skipped rather than
-- failing its enqueue.
CREATE TRIGGER ferry_unrouted_once BEFORE INSERT ON ferry_unrouted
WHEN EXISTS (SELECT 1 FROM ferry_unrouted u WHERE u.seq = NEW.seq)
BEGIN
    SELECT RAISE(IGNORE);
END;
