//! `headroom rules` and the rule ids that `diagnose` prints with every lint.

use std::collections::BTreeSet;

use crate::common::{bad_input, headroom, json, p, stdout};

#[test]
fn every_rule_is_listed_once_with_its_doc() {
    let list = json(&["rules", "--json"]);
    let rules = list.as_array().expect("a list");
    assert!(rules.len() >= 30, "{} rules", rules.len());
    let ids: BTreeSet<&str> = rules
        .iter()
        .map(|r| r["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids.len(), rules.len(), "ids are unique");
    for r in rules {
        for field in ["name", "checks", "why", "fix"] {
            let text = r[field].as_str().unwrap_or_default();
            assert!(!text.is_empty(), "{} has no {field}", r["id"]);
        }
    }
}

#[test]
fn one_rule_is_explained_by_id_or_name() {
    let by_id = stdout(&headroom(&["rules", "hr112"]));
    assert!(
        by_id.starts_with("HR112 accelerate-precision-mismatch\n"),
        "{by_id}"
    );
    assert!(
        by_id.contains("Why: ") && by_id.contains("Fix: "),
        "{by_id}"
    );
    let by_name = stdout(&headroom(&["rules", "accelerate-precision-mismatch"]));
    assert_eq!(by_id, by_name);
    let message = bad_input(&["rules", "HR999"]);
    assert!(message.contains("`HR999`"), "{message}");
}

#[test]
fn diagnose_names_the_rule_of_every_lint() {
    let args = [
        "diagnose",
        "--accelerate-config",
        &p("seed002/accelerate_config.original.yaml"),
        "--script",
        &p("seed002/hf_model_cache.original.py"),
    ];
    let known: BTreeSet<String> = json(&["rules", "--json"])
        .as_array()
        .expect("a list")
        .iter()
        .map(|r| r["id"].as_str().expect("id").to_string())
        .collect();
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let report = json(&with_json);
    let lints = report["lints"].as_array().expect("lints");
    assert!(!lints.is_empty());
    let text = stdout(&headroom(&args));
    for lint in lints {
        let id = lint["rule"].as_str().expect("rule id");
        assert!(known.contains(id), "{id} is not a listed rule");
        assert!(text.contains(id), "the table shows {id}");
    }
}
