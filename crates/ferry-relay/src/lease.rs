use std::sync::Arc;

use ferry_core::{Clock, ErrorKind, Ownership, Partition, Store, StoreError, Wake};
use tokio::sync::watch;
use tokio::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::engine::{LeaseView, Shared};
use crate::metrics;

/// Heartbeats and keeps this relay's partition leases, handing back those
/// above its fair share once no work on them is in flight, until `stop`.
/// That is not the relay's shutdown signal: a relay told to stop still
/// waits for the publishes in flight, and its leases must outlast them, or
/// another relay takes the partitions and publishes the same events beside
/// it.
///
/// Every partition is handed back with the token it was held under, and
/// the store frees it only while that token still holds. A tick is given
/// up on after [`tick_timeout`](crate::RelaySettings::tick_timeout)
/// whether or not it hands partitions back: one that runs on the server
/// later can free only leases this relay has not been granted again since,
/// which it stopped working when the tick failed.
pub(crate) async fn keep<S: Store, C: Clock>(
    shared: Arc<Shared<S, C>>,
    tx: watch::Sender<LeaseView>,
    stop: CancellationToken,
) {
    let settings = &shared.settings;
    // (partition, the token it is held under) to hand back.
    let mut release: Vec<(Partition, i64)> = Vec::new();
    // Handed back by a tick that failed (an error, or no answer within the
    // bound), and sent again, each with the token it was held under, with
    // every tick until one answers. A failed tick may have run its course
    // (refused or rolled back, committed with its answer lost) or may still
    // run on the server later (a connection gone silent delivers it when it
    // recovers). The next answer is the truth either way; sending the
    // hand-back again only carries out what the failed one meant, on
    // partitions no work has touched since (the view dropped them). The
    // failed tick running late frees nothing that answer granted: a
    // partition this relay took again since has a new token, which the
    // release does not match.
    let mut unanswered: Vec<(Partition, i64)> = Vec::new();
    // Renewals are timed from the start of the one before, not from its
    // answer: the view a renewal grants runs from when it was sent, so
    // waiting a whole interval after a slow answer let the view lapse every
    // cycle (dropping the publishes in flight) though the database lease
    // never did.
    let mut next = Instant::now();
    loop {
        let mut gate = None;
        if !release.is_empty() {
            // Quiesce: wait for the current units of work to finish, renewing
            // every lease meanwhile. A unit may publish for longer than a
            // lease (a slow destination); were the leases left to run out,
            // the relay that asked for a share would take the partitions
            // still being published, and publish them again.
            shared.quiesce.store(true, std::sync::atomic::Ordering::SeqCst);
            let write = shared.gate.write();
            tokio::pin!(write);
            loop {
                tokio::select! {
                    g = &mut write => {
                        gate = Some(g);
                        break;
                    }
                    _ = tokio::time::sleep_until(next) => next = renew(&shared, &tx).await,
                    _ = stop.cancelled() => break,
                }
            }
            shared.quiesce.store(false, std::sync::atomic::Ordering::SeqCst);
            if gate.is_none() {
                return;
            }
        }
        // A hand-back decided before the stop, whose quiesce ended as the
        // stopping workers let go of the gate, waits too: the sinks may still
        // be flushing those partitions' messages.
        if shared.cancel.is_cancelled() {
            release.clear();
            unanswered.clear();
        }
        let mut sending = release.clone();
        sending.extend(unanswered.iter().filter(|p| !release.contains(p)));
        let sent = Instant::now();
        next = sent + settings.renew_every();
        match tick(&shared, &sending).await {
            Ok(mut owned) => {
                unanswered.clear();
                shared.progress.renewed();
                owned.relay = settings.id.clone();
                let fair = owned.fair_share();
                let (before, held) = {
                    let view = tx.borrow();
                    (view.owned.partitions(), view.owned.leases.clone())
                };
                // A partition taken again under a new token counts too:
                // another relay may have left work there meanwhile, which
                // workers idle since before would not see until their poll.
                let gained = owned.leases.iter().any(|l| !held.contains(l));
                if owned.partitions() != before {
                    info!(
                        partitions = owned.leases.len(),
                        live_relays = owned.live_relays,
                        "partition leases changed"
                    );
                }
                ::metrics::gauge!(metrics::LEASED_PARTITIONS).set(owned.leases.len() as f64);
                // Stopping, nothing is handed back early: the sinks may still
                // be flushing those partitions' messages; every lease goes
                // back at once after they closed.
                release = if owned.leases.len() > fair && !shared.cancel.is_cancelled() {
                    owned.leases[fair..].to_vec()
                } else {
                    Vec::new()
                };
                tx.send_replace(LeaseView::granted(owned, sent, settings));
                drop(gate);
                if gained {
                    shared.wake_all();
                }
                if !release.is_empty() {
                    debug!(?release, "above fair share; handing partitions (and their tokens) back");
                    continue;
                }
            }
            Err(e) => {
                if !sending.is_empty() {
                    // The hand-back may have committed though its answer
                    // was lost, or may still commit later: another relay
                    // can take those partitions. Work on them stops here,
                    // and they are handed back again, under the same
                    // tokens, until a tick answers.
                    tx.send_modify(|view| view.owned.leases.retain(|(p, _)| !sending.iter().any(|(q, _)| q == p)));
                }
                drop(gate);
                release.clear();
                unanswered = sending;
                ::metrics::counter!(metrics::STORE_ERRORS, "op" => "tick").increment(1);
                if e.kind == ErrorKind::Transient {
                    warn!(error = %e, "lease renewal failed; work pauses when the lease runs out");
                } else {
                    warn!(error = %e, "lease renewal refused");
                }
            }
        }
        // A tick given up on (or a slow one) is followed at once: it took
        // longer than the interval.
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// One renewal, handing `release` (partitions with the tokens they are
/// held under) back. It is bounded by the settings'
/// [`tick_timeout`](crate::RelaySettings::tick_timeout) and, given up on,
/// counts as failed: its statement may still run on the server, which
/// only extends the leases or takes free partitions that the next answer
/// reports; the view it would have granted is never claimed.
///
/// A hand-back is bounded too. Given up on, it may still run on the server
/// much later (a connection gone silent delivers it when it recovers),
/// after a later tick answered and this relay took some of those
/// partitions again. Each was taken again under a new token, and the
/// store frees a partition only under the token it was handed back with,
/// so the late release leaves them held. Waiting for it instead held the
/// keeper for as long as the connection stayed silent: no renewal, no
/// work, until the relay was restarted.
async fn tick<S: Store, C: Clock>(
    shared: &Shared<S, C>,
    release: &[(Partition, i64)],
) -> Result<Ownership, StoreError> {
    let settings = &shared.settings;
    let call = shared.store.tick(&settings.id, settings.lease, release);
    let limit = settings.tick_timeout();
    match tokio::time::timeout(limit, call).await {
        Ok(answer) => answer,
        Err(_) if release.is_empty() => Err(StoreError::transient(format!(
            "the database did not answer a lease renewal within {limit:?} (7/15 of relay.lease); sending it \
             again. If renewals are often this slow, raise relay.lease"
        ))),
        Err(_) => Err(StoreError::transient(format!(
            "the database did not answer a lease renewal handing {} partitions back within {limit:?} (7/15 of \
             relay.lease); work on them stops and they are handed back again with the next renewal",
            release.len()
        ))),
    }
}

/// Renews the leases held, handing none back: the view stays as it was but
/// for its deadline (and any partition lost meanwhile). Returns when the
/// next renewal is due.
async fn renew<S: Store, C: Clock>(shared: &Shared<S, C>, tx: &watch::Sender<LeaseView>) -> Instant {
    let settings = &shared.settings;
    let sent = Instant::now();
    let next = sent + settings.renew_every();
    match tick(shared, &[]).await {
        Ok(mut owned) => {
            shared.progress.renewed();
            owned.relay = settings.id.clone();
            // Partitions gained now wait for the next heartbeat's view: the
            // units holding the gate were planned without them.
            let before = tx.borrow().owned.partitions();
            owned.leases.retain(|(p, _)| before.contains(p));
            tx.send_replace(LeaseView::granted(owned, sent, settings));
        }
        Err(e) => {
            ::metrics::counter!(metrics::STORE_ERRORS, "op" => "tick").increment(1);
            warn!(error = %e, "lease renewal failed while handing partitions back");
        }
    }
    next
}

/// Turns commit notifications into router wake-ups; reconnects with backoff.
pub(crate) async fn listen<S: Store, C: Clock>(shared: Arc<Shared<S, C>>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut source = match shared.store.listen().await {
            Ok(s) => s,
            Err(e) => {
                // Stopping, the sleep returns at once: a loop of refusals.
                if shared.cancel.is_cancelled() {
                    return;
                }
                warn!(error = %e, "cannot listen for commits; relying on polls until it reconnects");
                shared.sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        // Anything committed (or requeued) while we were not listening is
        // found by a look at everything.
        shared.wake_all();
        // New events wake the router alone: it publishes them itself, and
        // waking the route workers too would cost a claim per route per
        // commit for nothing. Deliveries made due without new events (an
        // operator's requeue, events parked by a WAL settle) wake everyone.
        loop {
            match source.wait().await {
                Ok(Some(wake)) => {
                    if shared.lease.borrow().owned.owns(wake.partition()) {
                        match wake {
                            Wake::Events(_) => shared.router_wake.notify_one(),
                            Wake::Due(_) => shared.wake_all(),
                        }
                    }
                }
                Ok(None) => shared.wake_all(),
                Err(e) => {
                    debug!(error = %e, "commit listener dropped");
                    break;
                }
            }
        }
    }
}
