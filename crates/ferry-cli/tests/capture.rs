//! `ferry capture` through the built binary against a real database: add,
//! list, a schema change reported by `ferry check` and fixed by refresh,
//! then remove; and bad input refused with the flag to fix.

use std::path::PathBuf;
use std::process::{Command, Output};

use ferry_testkit::pg::TestDb;
use serde_json::{Value, json};

const BIN: &str = env!("CARGO_BIN_EXE_ferry");

struct Cli {
    config: PathBuf,
    _dir: tempfile::TempDir,
}

impl Cli {
    fn new(db: &TestDb) -> Cli {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("ferry.toml");
        std::fs::write(&config, format!("[database]\nurl = \"{}\"\n", db.url())).unwrap();
        Cli { config, _dir: dir }
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .arg("--config")
            .arg(&self.config)
            .args(args)
            .output()
            .expect("run ferry")
    }

    /// Runs and asserts the exit code; returns stdout.
    fn expect(&self, code: i32, args: &[&str]) -> String {
        let out = self.run(args);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(
            out.status.code(),
            Some(code),
            "ferry {args:?}\nstdout: {stdout}\nstderr: {stderr}"
        );
        stdout
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A capture by a nullable key column is taken, with the warning `ferry
/// check` would give and its fix.
#[tokio::test]
async fn adding_a_capture_by_a_nullable_key_warns() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    let cli = Cli::new(&db);
    cli.expect(0, &["migrate"]);
    sqlx::raw_sql("CREATE TABLE notes (id bigint NOT NULL, author text)")
        .execute(&pool)
        .await
        .unwrap();
    let out = cli.expect(
        0,
        &[
            "capture",
            "add",
            "notes",
            "--type-prefix",
            "app.note",
            "--key",
            "author",
        ],
    );
    assert!(
        out.contains("warning: public.notes: its key column author may be NULL"),
        "{out}"
    );
    assert!(out.contains("SET NOT NULL"), "{out}");
}

/// A capture by a key column of a string type is taken, with a warning
/// naming the producer's key limits and the CHECK that keeps rows within
/// them; the CHECK it gives is valid SQL.
#[tokio::test]
async fn adding_a_capture_by_a_text_key_warns_of_the_key_limits() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    let cli = Cli::new(&db);
    cli.expect(0, &["migrate"]);
    sqlx::raw_sql(
        "CREATE DOMAIN sku AS varchar(600);
         CREATE TABLE items (code sku PRIMARY KEY, n int);
         CREATE TABLE tags (\"Tag\" text PRIMARY KEY)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let args = |table: &'static str, key: &'static str, on_error: &'static str| {
        [
            "capture",
            "add",
            table,
            "--type-prefix",
            "app.x",
            "--key",
            key,
            "--on-error",
            on_error,
        ]
    };
    let out = cli.expect(0, &args("items", "code", "fail"));
    assert!(
        out.contains("warning: public.items: its key column code is of type sku: a row whose key is empty, over 512 bytes or holds a line break (CR or LF) is refused as an event key, so writing such a row fails (on-error fail)"),
        "{out}"
    );
    let check = out.split('`').nth(1).unwrap();
    assert_eq!(
        check,
        "ALTER TABLE public.items ADD CHECK (code <> '' AND octet_length(code) <= 512 AND code !~ '[\\r\\n]')"
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(check.to_owned()))
        .execute(&pool)
        .await
        .unwrap();
    let refused = sqlx::query("INSERT INTO items VALUES (E'a\\nb', 1)")
        .execute(&pool)
        .await
        .unwrap_err();
    assert!(refused.to_string().contains("check constraint"), "{refused}");

    let out = cli.expect(0, &args("tags", "Tag", "warn"));
    assert!(out.contains("its key column \"Tag\" is of type text"), "{out}");
    assert!(
        out.contains("such a row is written without its event (on-error warn drops it)"),
        "{out}"
    );
}

#[tokio::test]
async fn add_list_check_refresh_and_remove() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    let cli = Cli::new(&db);
    cli.expect(0, &["migrate"]);
    sqlx::raw_sql("CREATE TABLE orders (id bigint PRIMARY KEY, status text, card_token text, deleted_at timestamptz)")
        .execute(&pool)
        .await
        .unwrap();

    let out = cli.expect(
        0,
        &[
            "capture",
            "add",
            "orders",
            "--type-prefix",
            "shop.order",
            "--key",
            "id",
            "--exclude",
            "card_token",
            "--soft-delete",
            "deleted_at",
            "--on",
            "insert,update",
        ],
    );
    assert!(out.contains("capturing public.orders"), "{out}");
    assert!(!out.contains("warning"), "{out}");

    let listed: Value = serde_json::from_str(&cli.expect(0, &["capture", "list", "--json"])).unwrap();
    let entry = &listed[0];
    assert_eq!(listed.as_array().unwrap().len(), 1);
    assert_eq!(entry["table"], json!("public.orders"));
    assert_eq!(entry["type_prefix"], json!("shop.order"));
    assert_eq!(entry["key_column"], json!("id"));
    assert_eq!(entry["exclude"], json!(["card_token"]));
    assert_eq!(entry["soft_delete"], json!("deleted_at"));
    assert_eq!(entry["on"], json!(["insert", "update"]));
    assert_eq!(entry["on_error"], json!("fail"));
    assert_eq!(entry["columns"], json!(["id", "status", "deleted_at"]));
    assert_eq!(entry["dropped"], json!(0));

    // The trigger works: one insert, one event.
    sqlx::query("INSERT INTO orders (id, status) VALUES (1, 'new')")
        .execute(&pool)
        .await
        .unwrap();
    let types: Vec<String> = sqlx::query_scalar("SELECT type FROM ferry.events ORDER BY seq")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(types, ["shop.order.created"]);

    let out = cli.expect(0, &["check"]);
    assert!(
        out.contains("capture public.orders: trigger matches the table"),
        "{out}"
    );

    sqlx::raw_sql("ALTER TABLE orders ADD COLUMN region text")
        .execute(&pool)
        .await
        .unwrap();
    let out = cli.expect(1, &["check"]);
    assert!(out.contains("FAIL capture public.orders: trigger out of date"), "{out}");
    assert!(out.contains("region"), "{out}");
    assert!(out.contains("`ferry capture refresh public.orders`"), "{out}");
    let findings: Value = serde_json::from_str(&cli.expect(1, &["check", "--json"])).unwrap();
    let capture = findings
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["what"] == json!("capture public.orders"))
        .unwrap();
    assert_eq!(capture["ok"], json!(false));

    let out = cli.expect(0, &["capture", "refresh", "public.orders"]);
    assert!(out.contains("refreshed public.orders"), "{out}");
    cli.expect(0, &["check"]);
    let listed: Value = serde_json::from_str(&cli.expect(0, &["capture", "list", "--json"])).unwrap();
    assert_eq!(listed[0]["columns"], json!(["id", "status", "deleted_at", "region"]));

    let out = cli.expect(0, &["capture", "remove", "orders"]);
    assert!(out.contains("stopped capturing public.orders"), "{out}");
    assert_eq!(cli.expect(0, &["capture", "list", "--json"]).trim(), "[]");
    sqlx::query("INSERT INTO orders (id, status) VALUES (2, 'new')")
        .execute(&pool)
        .await
        .unwrap();
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM ferry.events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 1, "a removed capture writes nothing");
    pool.close().await;
    db.drop_db().await;
}

/// A refresh of every table that passes over one it cannot refresh (here
/// dropped since it was captured) exits 1, so a deploy's `ferry migrate &&
/// ferry capture refresh` stops on it; the tables it did refresh stay
/// refreshed.
#[tokio::test]
async fn refreshing_all_with_a_table_passed_over_exits_1() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    let cli = Cli::new(&db);
    cli.expect(0, &["migrate"]);
    sqlx::raw_sql(
        "CREATE TABLE orders (id bigint PRIMARY KEY, status text);
         CREATE TABLE invoices (id bigint PRIMARY KEY, total numeric)",
    )
    .execute(&pool)
    .await
    .unwrap();
    for (table, prefix) in [("orders", "app.order"), ("invoices", "app.invoice")] {
        cli.expect(0, &["capture", "add", table, "--type-prefix", prefix, "--key", "id"]);
    }
    sqlx::raw_sql("ALTER TABLE orders ADD COLUMN region text; DROP TABLE invoices")
        .execute(&pool)
        .await
        .unwrap();

    let out = cli.run(&["capture", "refresh"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "stdout: {stdout}\nstderr: {stderr}");
    assert!(stdout.contains("refreshed public.orders"), "{stdout}");
    assert!(stdout.contains("not refreshed public.invoices"), "{stdout}");
    assert!(stderr.contains("1 captured table(s) not refreshed"), "{stderr}");
    let listed: Value = serde_json::from_str(&cli.expect(0, &["capture", "list", "--json"])).unwrap();
    let orders = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["table"] == json!("public.orders"))
        .unwrap();
    assert_eq!(orders["columns"], json!(["id", "status", "region"]), "committed");

    cli.expect(0, &["capture", "remove", "public.invoices"]);
    let out = cli.expect(0, &["capture", "refresh"]);
    assert!(out.contains("refreshed public.orders"), "{out}");
    pool.close().await;
    db.drop_db().await;
}

#[tokio::test]
async fn bad_input_is_refused_with_the_flag_to_fix() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    let cli = Cli::new(&db);
    cli.expect(0, &["migrate"]);
    sqlx::raw_sql("CREATE TABLE orders (id bigint PRIMARY KEY, status text)")
        .execute(&pool)
        .await
        .unwrap();
    let cases: [(&[&str], &str); 5] = [
        (
            &["capture", "add", "nosuch", "--type-prefix", "shop.order", "--key", "id"],
            "no such table",
        ),
        (
            &[
                "capture",
                "add",
                "orders",
                "--type-prefix",
                "shop.order",
                "--key",
                "uid",
            ],
            "--key one of: id, status",
        ),
        (
            &[
                "capture",
                "add",
                "orders",
                "--type-prefix",
                "shop.order",
                "--key",
                "id",
                "--exclude",
                "id",
            ],
            "drop it from --exclude",
        ),
        (
            &["capture", "add", "orders", "--type-prefix", "Shop", "--key", "id"],
            "--type-prefix",
        ),
        (&["capture", "remove", "orders"], "not captured"),
    ];
    for (args, wanted) in cases {
        let out = cli.run(args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "ferry {args:?}: {stderr}");
        assert!(stderr.contains(wanted), "ferry {args:?}: {stderr}");
    }
    // clap refuses an unknown operation before anything runs.
    let out = cli.run(&[
        "capture",
        "add",
        "orders",
        "--type-prefix",
        "shop.order",
        "--key",
        "id",
        "--on",
        "upsert",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("use insert, update or delete"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(cli.expect(0, &["capture", "list", "--json"]).trim(), "[]");
    pool.close().await;
    db.drop_db().await;
}

/// A captured table's spec changes with `ferry capture add --replace`, in
/// one transaction; without the flag the add is refused with the hint
/// naming it, and the flag needs a table already captured.
#[tokio::test]
async fn add_replace_changes_a_spec_in_one_step() {
    let db = TestDb::create().await;
    let pool = db.pool().await;
    let cli = Cli::new(&db);
    cli.expect(0, &["migrate"]);
    sqlx::raw_sql(
        "CREATE TABLE orders (id bigint PRIMARY KEY, status text, card_token text);
         CREATE TABLE visits (id bigint PRIMARY KEY, page text)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let add = |extra: &[&'static str]| {
        let mut args = vec!["capture", "add", "orders", "--type-prefix", "shop.order", "--key", "id"];
        args.extend_from_slice(extra);
        args
    };
    cli.expect(0, &add(&[]));

    let out = cli.run(&add(&["--exclude", "card_token"]));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("already captured"), "{stderr}");
    assert!(
        stderr.contains("`ferry capture add public.orders --replace`"),
        "{stderr}"
    );

    let out = cli.expect(0, &add(&["--exclude", "card_token", "--replace"]));
    assert!(out.contains("capturing public.orders (spec replaced)"), "{out}");
    let listed: Value = serde_json::from_str(&cli.expect(0, &["capture", "list", "--json"])).unwrap();
    assert_eq!(listed[0]["exclude"], json!(["card_token"]));
    assert_eq!(listed[0]["columns"], json!(["id", "status"]));

    let out = cli.run(&[
        "capture",
        "add",
        "visits",
        "--type-prefix",
        "web.visit",
        "--key",
        "id",
        "--replace",
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("not captured"), "{stderr}");
    pool.close().await;
    db.drop_db().await;
}
