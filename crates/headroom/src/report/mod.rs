//! The `--json` output of every command, as types: each `*Json` struct is the contract of one
//! command's JSON, documented field by field, so that what scripts may rely on is written
//! down in one place and changes to it show in review.
//!
//! The structs borrow from the library's results and are built by their `new` functions;
//! the CLI prints them with [`to_json`] and nothing else.
//!
//! Three rules hold for every report:
//! - keys are sorted alphabetically at every level: [`to_json`] goes through
//!   [`serde_json::Value`], whose objects are sorted maps (serde_json's `preserve_order` is
//!   off), so fields are declared in the order that reads best, not the order they print;
//! - sizes are integers of bytes (`i128` where a difference can be negative); ratios and
//!   errors are unrounded `f64` fractions (0.05 is 5%);
//! - an `Option` prints `null` when it is empty, unless its doc says the key is absent
//!   (`skip_serializing_if`): absent keys mark parts of a report that only some runs have.
//!
//! A library type whose JSON is exactly its fields ([`Gpu`](crate::gpu::Gpu),
//! [`Resident`](crate::plan::Resident), [`ProcessMemory`](crate::diagnose::oom_message::ProcessMemory))
//! derives `Serialize` itself and is embedded as it is; its doc says where it appears.
//!
//! The snapshot commands' reports live in `headroom_snapshot::report`, beside the types they
//! read, and follow the same rules.

pub mod assumptions;
pub mod diagnose;
pub mod estimate;
pub mod fit;
pub mod layouts;
pub mod measure;
pub mod models;
pub mod rules;
pub mod trace;
pub mod validate;

use serde::Serialize;

/// One line of JSON, keys sorted (see the module's rules).
pub fn to_json(report: &impl Serialize) -> String {
    serde_json::to_value(report)
        .expect("reports hold only strings, numbers in range, booleans, lists and structs")
        .to_string()
}

/// A component of a breakdown and its bytes.
#[derive(Debug, Serialize)]
pub struct ComponentBytes {
    /// `weights`, `gradients`, `optimizer_states`, `activations`, ...
    pub component: &'static str,
    pub bytes: u64,
}

impl ComponentBytes {
    /// A breakdown in its order (largest first, or the simulator's component order).
    pub fn list(breakdown: &[(crate::sim::Component, u64)]) -> Vec<Self> {
        breakdown
            .iter()
            .map(|&(c, bytes)| Self {
                component: c.key(),
                bytes,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule every report relies on: keys print sorted, whatever the declaration order,
    /// and an empty `Option` prints `null` unless skipped.
    #[test]
    fn keys_print_sorted_and_empty_options_as_null() {
        #[derive(Serialize)]
        struct Report {
            zeta: u64,
            alpha: Option<u64>,
            #[serde(skip_serializing_if = "Option::is_none")]
            absent: Option<u64>,
            mid: Inner,
        }
        #[derive(Serialize)]
        struct Inner {
            y: f64,
            x: i128,
        }
        let report = Report {
            zeta: 1,
            alpha: None,
            absent: None,
            mid: Inner { y: 1.0, x: -2 },
        };
        assert_eq!(
            to_json(&report),
            r#"{"alpha":null,"mid":{"x":-2,"y":1.0},"zeta":1}"#
        );
    }
}
