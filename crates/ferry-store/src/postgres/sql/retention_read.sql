-- The candidates again, now that their deliveries are locked: an operator's
-- requeue that committed in between takes its event out. Returns each event
-- whole, with its deliveries, their failures and the operators' actions on
-- them, as the archive keeps them.
-- $1 candidate seqs, $2 published cutoff, $3 settled cutoff
SELECT e.seq, e.id, e.type, e.key, e.payload, e.content_type, e.headers, e.dispatch_key, e.created_at,
       (SELECT jsonb_agg(jsonb_build_object(
                   'route', d.route, 'state', d.state, 'attempts', d.attempts,
                   'last_error', d.last_error, 'published_at', d.published_at, 'updated_at', d.updated_at,
                   'failures', (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                           'attempt', f.attempt, 'at', f.at, 'dead', f.dead, 'error', f.error)
                                       ORDER BY f.id), '[]'::jsonb)
                                  FROM ferry.failures f WHERE f.seq = d.seq AND f.route = d.route),
                   'actions', (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                          'at', a.at, 'actor', a.actor, 'action', a.action,
                                          'from_state', a.from_state, 'attempts', a.attempts, 'reason', a.reason)
                                      ORDER BY a.id), '[]'::jsonb)
                                 FROM ferry.admin_log a WHERE a.seq = d.seq AND a.route = d.route))
               ORDER BY d.route)
          FROM ferry.deliveries d WHERE d.seq = e.seq) AS deliveries
  FROM ferry.events e
 WHERE e.seq = ANY($1::bigint[])
   AND NOT EXISTS (SELECT 1 FROM ferry.unrouted u WHERE u.seq = e.seq)
   AND EXISTS (SELECT 1 FROM ferry.deliveries d WHERE d.seq = e.seq)
   AND NOT EXISTS (
       SELECT 1 FROM ferry.deliveries d
        WHERE d.seq = e.seq
          AND NOT coalesce((d.state = 'published' AND d.published_at < $2)
                        OR (d.state IN ('dead', 'cancelled') AND d.updated_at < $3), false))
 ORDER BY e.seq
