//! A PostgreSQL server of a test's own, which the test may crash.
//!
//! The shared server of [`pg`](crate::pg) must never be killed: other tests
//! use it. A test of what a database crash does to the relay starts a
//! [`PgServer`] instead: a new cluster (`initdb`) in a temporary directory,
//! on a free port, with `wal_level = logical` so WAL streaming works on it.
//! [`crash`](PgServer::crash) sends SIGKILL to the postmaster and every
//! backend at once, as a machine losing power does to the processes:
//! transactions in progress are lost, and so is any asynchronous commit
//! whose WAL had not reached the file yet. [`restart`](PgServer::restart)
//! starts the server again on the same directory and port, through crash
//! recovery.
//!
//! The server binaries are found in `FERRY_TEST_PG_BIN`, else in the newest
//! `/usr/lib/postgresql/<version>/bin` (Debian's layout), else on `PATH`.
//! PostgreSQL refuses to run as root; as root, the server runs as the
//! `postgres` user (`setpriv`), which owns the cluster's directory. A
//! cluster whose test process was killed before it could stop it is
//! stopped and removed by the next [`PgServer::start`].
//!
//! ```no_run
//! # async fn demo() {
//! use ferry_testkit::pg::TestDb;
//! use ferry_testkit::pg_server::PgServer;
//! let mut server = PgServer::start().await;
//! let db = TestDb::create_on(&server.admin_url()).await;
//! server.crash();
//! server.restart().await;
//! # drop(db);
//! # }
//! ```

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use sqlx::Connection;

/// Environment variable naming the directory of `initdb` and `postgres`.
pub const BIN_ENV: &str = "FERRY_TEST_PG_BIN";
/// How long a start (crash recovery included) may take.
const READY_WITHIN: Duration = Duration::from_secs(60);
/// The log line a server writes once it accepts connections.
const READY: &str = "database system is ready to accept connections";
/// The account the server runs as when the tests run as root.
const SERVER_USER: &str = "postgres";
/// A cluster's directory: `<temp dir>/ferry-pg-<random>`.
const DIR_PREFIX: &str = "ferry-pg-";
/// In a cluster's directory: the process id of the test that made it.
const OWNER_FILE: &str = "owner";

/// A running PostgreSQL server in a directory of its own; shut down and
/// removed on drop.
pub struct PgServer {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    as_root: bool,
    postmaster: Option<Child>,
}

impl PgServer {
    /// Creates a cluster and starts it.
    ///
    /// # Panics
    ///
    /// When the binaries are missing or the server does not start; the
    /// message says what to install or set.
    pub async fn start() -> PgServer {
        Self::start_in_epoch(0).await
    }

    /// Creates a cluster whose transaction ids are in `epoch` (the upper 32
    /// bits of every `xid8`), as on a server that has used more than 2³²
    /// transaction ids since it began, and starts it.
    ///
    /// # Panics
    ///
    /// As [`start`](PgServer::start), and when `pg_resetwal` fails.
    pub async fn start_in_epoch(epoch: u32) -> PgServer {
        let bin = find_bin();
        // SAFETY: geteuid(2) has no preconditions and cannot fail.
        let as_root = unsafe { libc::geteuid() } == 0;
        reap_leftovers();
        let dir = tempfile::Builder::new()
            .prefix(DIR_PREFIX)
            .tempdir()
            .expect("create a directory for the test cluster");
        std::fs::write(dir.path().join(OWNER_FILE), std::process::id().to_string())
            .expect("write the test cluster's owner");
        if as_root {
            let chown = Command::new("chown")
                .arg(format!("{SERVER_USER}:{SERVER_USER}"))
                .arg(dir.path())
                .status()
                .expect("run chown");
            assert!(
                chown.success(),
                "cannot give {} to the {SERVER_USER} user, which runs the test cluster as root",
                dir.path().display()
            );
        }
        let mut server = PgServer {
            bin,
            dir,
            port: 0,
            as_root,
            postmaster: None,
        };
        let initdb = server
            .command("initdb")
            .arg("--pgdata")
            .arg(server.data())
            .args([
                "--username",
                "postgres",
                "--auth",
                "trust",
                "--encoding",
                "UTF8",
                "--no-sync",
            ])
            .output()
            .expect("run initdb");
        assert!(
            initdb.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&initdb.stdout),
            String::from_utf8_lossy(&initdb.stderr)
        );
        if epoch > 0 {
            let reset = server
                .command("pg_resetwal")
                .arg("--epoch")
                .arg(epoch.to_string())
                .arg("--pgdata")
                .arg(server.data())
                .output()
                .expect("run pg_resetwal");
            assert!(
                reset.status.success(),
                "pg_resetwal --epoch {epoch} failed: {}{}",
                String::from_utf8_lossy(&reset.stdout),
                String::from_utf8_lossy(&reset.stderr)
            );
        }
        // A free port can be taken by another process before the server
        // binds it: try a few.
        for attempt in 1..=5 {
            server.port = free_port();
            match server.launch().await {
                Ok(()) => return server,
                Err(log) if attempt < 5 && log.contains("could not bind") => continue,
                Err(log) => panic!("the test cluster did not start:\n{log}"),
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// The URL of its `postgres` database, as the superuser `postgres`.
    pub fn admin_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// SIGKILL to the postmaster and all its backends at once.
    pub fn crash(&mut self) {
        let Some(mut postmaster) = self.postmaster.take() else {
            panic!("crash: the test cluster is not running");
        };
        // The postmaster leads a process group of its own (see `launch`),
        // which its backends inherit.
        let group = postmaster.id() as i32;
        // SAFETY: kill(2) with a negative pid signals the group this
        // process created; SIGKILL is a valid signal.
        unsafe { libc::kill(-group, libc::SIGKILL) };
        let _ = postmaster.wait();
    }

    /// A fast shutdown (SIGINT), as `pg_ctl stop` makes: `true` when the
    /// postmaster exited within `limit`. Past it the server is killed, so
    /// that [`Self::restart`] can start it again either way.
    ///
    /// # Panics
    ///
    /// When the server is not running.
    pub fn stop_within(&mut self, limit: Duration) -> bool {
        let Some(mut postmaster) = self.postmaster.take() else {
            panic!("stop_within: the test cluster is not running");
        };
        let pid = postmaster.id() as i32;
        // SAFETY: kill(2) on our own child's pid, then on the group it leads.
        unsafe { libc::kill(pid, libc::SIGINT) };
        let deadline = std::time::Instant::now() + limit;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = postmaster.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // SAFETY: as above.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
        let _ = postmaster.wait();
        false
    }

    /// Starts the server again on the same directory and port, after a
    /// crash or not; returns once it accepts connections.
    ///
    /// # Panics
    ///
    /// When it does not come up; with its log.
    pub async fn restart(&mut self) {
        if let Some(mut postmaster) = self.postmaster.take() {
            stop(&mut postmaster);
        }
        // Until every backend of a crashed server has exited, the new
        // postmaster refuses the directory: try again for a moment.
        let mut last = String::new();
        for _ in 0..20 {
            match self.launch().await {
                Ok(()) => return,
                Err(log) => last = log,
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        panic!("the test cluster did not restart:\n{last}");
    }

    /// Makes PostgreSQL invalidate the replication slot `slot`, as it does
    /// to a slot that holds back more WAL than `max_slot_wal_keep_size`:
    /// sets that limit to 1 MB (kept for the rest of the test), then
    /// switches to a new WAL segment and checkpoints until the slot's
    /// `wal_status` reads `lost`. A streaming slot's walsender is ended by
    /// the server, as in production.
    ///
    /// # Panics
    ///
    /// When the slot does not exist or is still not lost after ten rounds.
    pub async fn invalidate_slot(&self, slot: &str) {
        let mut admin = sqlx::PgConnection::connect(&self.admin_url())
            .await
            .expect("connect to the test cluster");
        for statement in [
            "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'",
            "SELECT pg_reload_conf()",
            "CREATE TABLE IF NOT EXISTS ferry_test_wal_filler (at timestamptz)",
        ] {
            sqlx::query(statement).execute(&mut admin).await.expect(statement);
        }
        for _ in 0..10 {
            // Something to switch away from, a new segment, and a
            // checkpoint whose redo point lies past the slot's WAL: the
            // checkpoint is where the server invalidates slots.
            for statement in [
                "INSERT INTO ferry_test_wal_filler VALUES (now())",
                "SELECT pg_switch_wal()",
                "CHECKPOINT",
            ] {
                sqlx::query(statement).execute(&mut admin).await.expect(statement);
            }
            let status: Option<Option<String>> =
                sqlx::query_scalar("SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1")
                    .bind(slot)
                    .fetch_optional(&mut admin)
                    .await
                    .expect("read the slot's status");
            match status {
                None => panic!("invalidate_slot: there is no slot {slot}"),
                Some(Some(s)) if s == "lost" => return,
                Some(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        panic!("slot {slot} is still not lost; server log:\n{}", self.log());
    }

    /// Takes back the cap [`PgServer::invalidate_slot`] set: slots keep
    /// their WAL for as long as they need it again.
    pub async fn uncap_slots(&self) {
        let mut admin = sqlx::PgConnection::connect(&self.admin_url())
            .await
            .expect("connect to the test cluster");
        for statement in ["ALTER SYSTEM RESET max_slot_wal_keep_size", "SELECT pg_reload_conf()"] {
            sqlx::query(statement).execute(&mut admin).await.expect(statement);
        }
    }

    /// What the server logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    /// Runs one of the server's binaries, as `postgres` when we are root.
    fn command(&self, program: &str) -> Command {
        let program = self.bin.join(program);
        if self.as_root {
            let mut c = Command::new("setpriv");
            c.args(["--reuid", SERVER_USER, "--regid", SERVER_USER, "--init-groups"])
                .arg(program);
            c
        } else {
            Command::new(program)
        }
    }

    /// Starts the postmaster and waits until it is ready; on failure,
    /// returns what it logged.
    async fn launch(&mut self) -> Result<(), String> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open the test cluster's log");
        let ready_before = self.log().matches(READY).count();
        let socket_dir = self.dir.path().to_owned();
        let mut command = self.command("postgres");
        command
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string()])
            .args(["-c", "listen_addresses=127.0.0.1"])
            .arg("-c")
            .arg(format!("unix_socket_directories={}", socket_dir.display()))
            .args(["-c", "wal_level=logical", "-c", "max_replication_slots=8"])
            .args(["-c", "max_wal_senders=8", "-c", "max_connections=50"])
            // Crash recovery first syncs the data directory, by default one
            // fsync per file: seconds on a busy disk. One syncfs(2) does it.
            .args(["-c", "recovery_init_sync_method=syncfs"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone the log's handle"))
            .stderr(log)
            // A group of its own, so that `crash` reaches every backend.
            .process_group(0);
        let mut postmaster = command.spawn().expect("spawn postgres");
        let deadline = tokio::time::Instant::now() + READY_WITHIN;
        loop {
            if self.log().matches(READY).count() > ready_before {
                self.postmaster = Some(postmaster);
                return Ok(());
            }
            if postmaster.try_wait().expect("poll postgres").is_some() {
                return Err(self.log());
            }
            if tokio::time::Instant::now() >= deadline {
                stop(&mut postmaster);
                return Err(format!("not ready within {READY_WITHIN:?}:\n{}", self.log()));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if let Some(mut postmaster) = self.postmaster.take() {
            stop(&mut postmaster);
        }
    }
}

/// A fast shutdown (SIGINT), and SIGKILL to the group if that takes long.
fn stop(postmaster: &mut Child) {
    let pid = postmaster.id() as i32;
    // SAFETY: kill(2) on our own child's pid, then on the group it leads.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        if let Ok(Some(_)) = postmaster.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: as above.
    unsafe { libc::kill(-pid, libc::SIGKILL) };
    let _ = postmaster.wait();
}

/// Stops and removes the clusters of test processes that are gone: a test
/// killed outright (SIGKILL, a harness's timeout) never runs its `Drop`.
/// Only a postmaster whose command line names the directory is signalled,
/// so a reused process id is left alone.
fn reap_leftovers() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let dir = entry.path();
        if !entry.file_name().to_string_lossy().starts_with(DIR_PREFIX) {
            continue;
        }
        let Some(owner) = read_pid(&dir.join(OWNER_FILE)) else {
            continue;
        };
        if Path::new(&format!("/proc/{owner}")).exists() {
            continue;
        }
        if let Some(postmaster) = read_pid(&dir.join("data").join("postmaster.pid")) {
            let cmdline = std::fs::read(format!("/proc/{postmaster}/cmdline")).unwrap_or_default();
            let data = dir.join("data");
            if String::from_utf8_lossy(&cmdline).contains(&*data.to_string_lossy()) {
                // SAFETY: kill(2) on the process group of a postmaster a
                // test of ours started in this directory, as checked above.
                unsafe { libc::kill(-postmaster, libc::SIGKILL) };
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The process id on the first line of `file`.
fn read_pid(file: &Path) -> Option<i32> {
    std::fs::read_to_string(file).ok()?.lines().next()?.trim().parse().ok()
}

fn find_bin() -> PathBuf {
    if let Ok(dir) = std::env::var(BIN_ENV) {
        return PathBuf::from(dir);
    }
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((version, bin))
        })
        .max_by_key(|(version, _)| *version);
    if let Some((_, bin)) = newest {
        return bin;
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .find(|dir| Path::new(dir).join("initdb").is_file());
    on_path.unwrap_or_else(|| {
        panic!(
            "no PostgreSQL server binaries (initdb, postgres) found: install the postgresql package, \
             or set {BIN_ENV} to the directory that holds them"
        )
    })
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("find a free port")
        .port()
}
