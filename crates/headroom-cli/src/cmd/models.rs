//! `headroom models`: the built-in model catalog, with the parameter counts transformers builds.

use headroom::arch::Architecture;
use headroom::catalog;
use headroom::report::models::ModelJson;
use headroom::report::to_json;

use crate::error::{CliError, CliResult};
use crate::render;

#[derive(clap::Args)]
pub struct Args {
    /// Only the names that contain this text (case-insensitive), e.g. `qwen3` or `7b`.
    pub filter: Option<String>,
    /// Print one JSON array instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> CliResult {
    let filter = args.filter.as_deref().map(str::to_ascii_lowercase);
    let mut rows = Vec::new();
    for (name, config) in catalog::catalog() {
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        // The catalog is tested to parse; a failure here is a bug, not bad input.
        let arch = Architecture::from_hf_config(config)
            .map_err(|e| CliError::failure(format!("catalog model {name}: {e}")))?;
        rows.push((name, arch));
    }
    if rows.is_empty() {
        let f = args.filter.unwrap_or_default();
        return Err(CliError::input(format!(
            "no catalog model name contains `{f}`; run `headroom models` for the full list, or \
             point `model:` at an HF config.json"
        )));
    }
    if args.json {
        let list: Vec<ModelJson> = rows
            .iter()
            .map(|(name, arch)| ModelJson::new(name, arch))
            .collect();
        println!("{}", to_json(&list));
    } else {
        print!("{}", render::models(&rows));
    }
    Ok(())
}
