use std::process::ExitCode;

use anyhow::Context;
use ferry_store::postgres::migrate;

use crate::config::Config;

pub async fn run(cfg: &Config) -> anyhow::Result<ExitCode> {
    let mut conn = super::connect(cfg).await?;
    let applied = migrate(&mut conn).await.context("migrating the ferry schema")?;
    if applied.is_empty() {
        println!("ferry schema is up to date");
    } else {
        let list: Vec<String> = applied.iter().map(|v| v.to_string()).collect();
        println!("applied migrations: {}", list.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}
