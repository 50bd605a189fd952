use std::process::ExitCode;

use anyhow::Context;

use crate::config::Config;

pub async fn run(cfg: &Config) -> anyhow::Result<ExitCode> {
    let store = super::store(cfg)?;
    let applied = store.migrate().await.with_context(|| {
        format!(
            "migrating the ferry schema at {}",
            ferry_core::redact::url(&cfg.database.url)
        )
    })?;
    if applied.is_empty() {
        println!("ferry schema is up to date");
    } else {
        let list: Vec<String> = applied.iter().map(|v| v.to_string()).collect();
        println!("applied migrations: {}", list.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}
