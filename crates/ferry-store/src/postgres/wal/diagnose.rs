//! What `ferry check` reports about WAL streaming, each problem with its fix.

use sqlx::PgPool;

use super::WalConfig;

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub what: String,
    pub ok: bool,
    pub detail: String,
}

fn finding(what: impl Into<String>, ok: bool, detail: impl Into<String>) -> Finding {
    Finding {
        what: what.into(),
        ok,
        detail: detail.into(),
    }
}

/// Checks `wal_level`, the role's replication grant, the publication and the
/// slot (and its lag against `lag_budget` bytes).
pub async fn diagnose(pool: &PgPool, config: &WalConfig, lag_budget: u64) -> Vec<Finding> {
    match inspect(pool, config, lag_budget).await {
        Ok(found) => found,
        Err(e) => vec![finding("WAL streaming", false, format!("cannot inspect: {e}"))],
    }
}

async fn inspect(pool: &PgPool, config: &WalConfig, lag_budget: u64) -> Result<Vec<Finding>, sqlx::Error> {
    let WalConfig { slot, publication, .. } = config;
    let mut out = Vec::new();

    let wal_level: String = sqlx::query_scalar("SHOW wal_level").fetch_one(pool).await?;
    out.push(if wal_level == "logical" {
        finding("wal_level", true, "logical")
    } else {
        finding(
            "wal_level",
            false,
            format!("{wal_level}; run ALTER SYSTEM SET wal_level = logical and restart PostgreSQL"),
        )
    });
    let (senders, slots): (String, String) =
        sqlx::query_as("SELECT current_setting('max_wal_senders'), current_setting('max_replication_slots')")
            .fetch_one(pool)
            .await?;
    let zero = senders == "0" || slots == "0";
    out.push(finding(
        "max_wal_senders / max_replication_slots",
        !zero,
        if zero {
            format!("{senders} / {slots}; set both above 0 (ALTER SYSTEM) and restart PostgreSQL")
        } else {
            format!("{senders} / {slots}")
        },
    ));

    let (role, can): (String, bool) =
        sqlx::query_as("SELECT rolname::text, rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user")
            .fetch_one(pool)
            .await?;
    out.push(if can {
        finding(format!("role {role}"), true, "may stream (REPLICATION)")
    } else {
        finding(
            format!("role {role}"),
            false,
            format!("lacks REPLICATION; run ALTER ROLE {role} REPLICATION as an administrator"),
        )
    });

    let what = format!("publication {publication}");
    let publication_row = super::publication_fault(pool, publication).await?;
    let create = format!("CREATE PUBLICATION {publication} FOR TABLE ferry.events WITH (publish = 'insert')");
    let has_slot: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)")
        .bind(slot)
        .fetch_one(pool)
        .await?;
    out.push(match publication_row {
        // PostgreSQL before 18 decodes each change against the publications
        // of its time: one committed now stops the slot for good.
        None if has_slot => finding(
            what,
            false,
            format!(
                "does not exist, though replication slot {slot} does (dropped by hand?): a change committed in \
                 this database while it is missing stops the slot for good. Run {create} (a relay in WAL mode \
                 makes it at its next attempt to stream); a relay replaces the slot if it has stopped, sweeping \
                 every undelivered outbox row into the table path, and tableless events the slot holds past that \
                 change are lost. Drop the publication only with the slot"
            ),
        ),
        None => finding(
            what,
            true,
            format!("not created yet; the relay creates it at start (as the owner of ferry.events), or run {create}"),
        ),
        Some(None) => finding(what, true, "publishes every insert into ferry.events, whole"),
        Some(Some(wrong)) => finding(what, false, wrong),
    });

    let what = format!("replication slot {slot}");
    type SlotRow = (
        Option<String>,
        Option<String>,
        bool,
        Option<i32>,
        Option<String>,
        Option<i64>,
        Option<i64>,
    );
    let slot_row: Option<SlotRow> = sqlx::query_as(
        "SELECT database::text, plugin::text, active, active_pid, wal_status, \
                pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint, safe_wal_size \
           FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await?;
    let here: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(pool)
        .await?;
    out.push(match slot_row {
        None => {
            // Read only for the wording: before `ferry migrate` the table
            // is missing, and the slot is simply not created yet.
            let streamed: Option<bool> =
                sqlx::query_scalar("SELECT ready OR lost IS NOT NULL FROM ferry.wal_slots WHERE slot = $1")
                    .bind(slot)
                    .fetch_optional(pool)
                    .await
                    .ok()
                    .flatten();
            if streamed == Some(true) {
                finding(
                    what,
                    can,
                    "gone though a relay streamed from it (a failover to a standby, a restore, or a drop by \
                     hand): the relay makes a new one at start and sweeps every undelivered outbox row; \
                     tableless events the old slot had not handed over are lost",
                )
            } else {
                finding(what, can, "not created yet; the relay creates it at start")
            }
        }
        Some((db, plugin, active, pid, status, lag, safe)) => {
            if db.as_deref() != Some(here.as_str()) || plugin.as_deref() != Some("pgoutput") {
                finding(
                    what,
                    false,
                    format!(
                        "belongs to database {} with plugin {}; choose another [relay] wal_slot",
                        db.unwrap_or_default(),
                        plugin.unwrap_or_default()
                    ),
                )
            } else if status.as_deref() == Some("lost") {
                finding(
                    what,
                    false,
                    "lost: PostgreSQL removed WAL it still needed (max_slot_wal_keep_size). Outbox rows are \
                     safe in the table: a relay in WAL mode replaces the slot at its next attempt to stream \
                     (start one if none runs) and sweeps every unrouted row. Tableless events of that \
                     window cannot be recovered",
                )
            } else {
                let lag = lag.unwrap_or(0).max(0) as u64;
                let who = match (active, pid) {
                    (true, Some(pid)) => format!("streaming (walsender pid {pid})"),
                    _ => "idle: no relay streams from it".to_owned(),
                };
                // How much more WAL before the server invalidates the slot,
                // when max_slot_wal_keep_size caps it.
                let margin = safe
                    .map(|safe| format!("; PostgreSQL invalidates it after {} more bytes of WAL", safe.max(0)))
                    .unwrap_or_default();
                if status.as_deref() == Some("unreserved") {
                    finding(
                        what,
                        false,
                        format!(
                            "{who}; holds back {lag} bytes of WAL, more than max_slot_wal_keep_size: the next \
                             checkpoint invalidates it unless a relay catches up first (start one, or raise \
                             max_slot_wal_keep_size)"
                        ),
                    )
                } else if lag > lag_budget {
                    finding(
                        what,
                        false,
                        format!(
                            "{who}; holds back {lag} bytes of WAL, over the budget of {lag_budget} bytes \
                             (relay.wal_lag_budget_mb): start a relay, or see what slows it (ferry status){margin}"
                        ),
                    )
                } else {
                    finding(what, true, format!("{who}; {lag} bytes behind{margin}"))
                }
            }
        }
    });
    // Another slot that ferry.emit writes tableless events for: a relay on
    // this one would never read them, and `ferry run` refuses to start.
    // Before `ferry migrate` there is no record of any slot.
    if let Ok(others) = super::emit_slots(pool, Some(slot)).await
        && let Some(other) = others.first()
    {
        out.push(finding(
            format!("WAL slot {other}"),
            false,
            super::another_slot(other, slot),
        ));
    }
    Ok(out)
}
