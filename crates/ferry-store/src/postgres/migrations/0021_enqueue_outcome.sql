-- The SQL door, reporting its outcome: ferry.enqueue returns an id, the
-- same whether the call stored a new event or found one already stored
-- under its dispatch key, so a caller could not tell a repeat (as the Rust
-- door's `duplicate` does). This one returns both: the event's id, and
-- whether the call was a no-op. The checks are ferry._enqueue's, as for
-- ferry.enqueue.
CREATE FUNCTION ferry.enqueue_with_outcome(
    event_type text, key text, payload jsonb,
    headers jsonb DEFAULT '{}', dispatch_key text DEFAULT NULL,
    OUT id uuid, OUT duplicate boolean
)
LANGUAGE plpgsql AS $$
DECLARE
    v_new uuid := ferry.uuid_v7();
BEGIN
    id := ferry._enqueue(v_new, event_type, key, convert_to(payload::text, 'UTF8'),
                         'application/json', coalesce(headers, '{}'::jsonb), dispatch_key);
    duplicate := id IS DISTINCT FROM v_new;
END
$$;
