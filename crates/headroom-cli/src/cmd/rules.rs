//! `headroom rules [ID]`: the launch-config lint rules `diagnose` runs, and what each means.

use comfy_table::{Cell, ContentArrangement};
use headroom::diagnose::lint::Rule;
use headroom::report::rules::RuleJson;
use headroom::report::to_json;

use crate::error::{CliError, CliResult};

#[derive(clap::Args)]
pub struct Args {
    /// One rule, by id (`HR112`) or name (`accelerate-precision-mismatch`): what it checks,
    /// why it matters and the fix.
    pub rule: Option<String>,
    /// Print one JSON array instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> CliResult {
    let rules: Vec<Rule> = match &args.rule {
        None => Rule::ALL.to_vec(),
        Some(wanted) => {
            let found = Rule::ALL.iter().copied().find(|r| {
                r.id().eq_ignore_ascii_case(wanted) || r.name().eq_ignore_ascii_case(wanted)
            });
            let Some(rule) = found else {
                return Err(CliError::input(format!(
                    "`{wanted}`: no lint rule has this id or name; use an id from HR101 to \
                     HR303 as `headroom rules` lists them"
                )));
            };
            vec![rule]
        }
    };
    if args.json {
        let list: Vec<RuleJson> = rules.into_iter().map(RuleJson::new).collect();
        println!("{}", to_json(&list));
        return Ok(());
    }
    if let [rule] = rules[..]
        && args.rule.is_some()
    {
        let doc = rule.doc();
        println!("{} {}\n", rule.id(), rule.name());
        println!(
            "Checks: {}\n\nWhy: {}\n\nFix: {}",
            doc.checks, doc.why, doc.fix
        );
        return Ok(());
    }
    let mut table = crate::render::table();
    table
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_width(120)
        .set_header(vec!["id", "name", "checks"]);
    for rule in rules {
        table.add_row(vec![
            Cell::new(rule.id()),
            Cell::new(rule.name()),
            Cell::new(rule.doc().checks),
        ]);
    }
    println!("{table}");
    Ok(())
}
