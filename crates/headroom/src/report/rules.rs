//! `headroom rules --json`: the launch-config lint rules `diagnose` runs.

use serde::Serialize;

use crate::diagnose::lint::Rule;

/// One rule; the command prints a list of them, in id order.
#[derive(Debug, Serialize)]
pub struct RuleJson {
    /// The stable id a lint carries (`HR112`).
    pub id: &'static str,
    /// The kebab-case name (`accelerate-precision-mismatch`).
    pub name: &'static str,
    /// What the rule checks.
    pub checks: &'static str,
    /// Why that ends in an out-of-memory error, or in a crash that looks like one.
    pub why: &'static str,
    /// What to change.
    pub fix: &'static str,
}

impl RuleJson {
    pub fn new(rule: Rule) -> Self {
        let doc = rule.doc();
        Self {
            id: rule.id(),
            name: rule.name(),
            checks: doc.checks,
            why: doc.why,
            fix: doc.fix,
        }
    }
}
