//! `ferry cancel`: dead, pending or retrying deliveries become cancelled,
//! with the reason recorded, and stop holding back later events of their
//! key. A delivery a relay may be publishing right now is refused.

use std::process::ExitCode;

use ferry_store::Action;
use uuid::Uuid;

use super::list::FilterArgs;
use super::requeue::{ChangeArgs, change};
use crate::config::Config;

#[derive(Debug, clap::Args)]
pub struct CancelArgs {
    /// Event ids; all their deliveries, narrowed by the filter flags.
    #[arg(value_name = "EVENT_ID")]
    pub ids: Vec<Uuid>,
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Why; kept with each cancelled delivery and shown by `ferry show`.
    #[arg(long, value_parser = non_empty)]
    pub reason: String,
    #[command(flatten)]
    pub change: ChangeArgs,
}

fn non_empty(text: &str) -> Result<String, String> {
    if text.trim().is_empty() {
        Err("is empty; say why these deliveries are cancelled".into())
    } else {
        Ok(text.to_owned())
    }
}

pub async fn run(cfg: &Config, args: CancelArgs) -> anyhow::Result<ExitCode> {
    let action = Action::Cancel { reason: args.reason };
    change(cfg, &action, args.filter.to_filter(&args.ids)?, &args.change).await
}
