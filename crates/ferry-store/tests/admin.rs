//! The admin view of the PostgreSQL store against a real database: the
//! shared admin suite (listing, history, status, and the guardrails of
//! requeue and cancel, down to a running relay).

use ferry_testkit::pg_store::PgHarness;

ferry_testkit::admin_conformance!(PgHarness::create());
