//! `headroom models`: the built-in model catalog, with the parameter counts transformers builds.

use headroom::arch::Architecture;
use headroom::catalog;
use headroom::report::models::ModelJson;
use headroom::report::to_json;

use crate::error::{CliError, CliResult};
use crate::render;

#[derive(clap::Args)]
pub struct Args {
    /// Only the names that contain this text (case-insensitive), e.g. `qwen3` or `7b`;
    /// `moe` lists the mixture-of-experts models, `dense` the others.
    pub filter: Option<String>,
    /// Print one JSON array instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> CliResult {
    let filter = args.filter.as_deref().map(str::to_ascii_lowercase);
    let mut rows = Vec::new();
    for (name, config) in catalog::catalog() {
        // The catalog is tested to parse; a failure here is a bug, not bad input.
        let arch = Architecture::from_hf_config(config)
            .map_err(|e| CliError::failure(format!("catalog model {name}: {e}")))?;
        let keep = match filter.as_deref() {
            None => true,
            Some("moe") => arch.moe.is_some(),
            Some("dense") => arch.moe.is_none(),
            Some(f) => name.contains(f),
        };
        if keep {
            rows.push((name, arch));
        }
    }
    if rows.is_empty() {
        let f = args.filter.unwrap_or_default();
        return Err(CliError::input(format!(
            "no catalog model name contains `{f}`; run `headroom models` for the full list, \
             `headroom models moe` for the mixture-of-experts ones, or point `model:` at an HF \
             config.json"
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
