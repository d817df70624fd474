//! The layout keys a user writes under `parallel:` as Megatron-LM's arguments name the sizes
//! (`dp`, and with `framework: megatron` the settings headroom keeps in `megatron:`): `ep`,
//! `etp`, `distributed_optimizer` and `recompute` are read into the `megatron` block, so one
//! layout is one mapping; `dp` is the data-parallel size the other sizes leave, checked and
//! dropped.

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// `parallel` key, its `megatron:` key, and what it is.
const MEGATRON_ALIASES: &[(&str, &str, &str)] = &[
    (
        "ep",
        "expert_model_parallel_size",
        "Megatron-core's expert parallelism",
    ),
    (
        "etp",
        "expert_tensor_parallel_size",
        "Megatron-core's expert tensor parallelism",
    ),
    (
        "distributed_optimizer",
        "distributed_optimizer",
        "Megatron-core's distributed optimizer",
    ),
    (
        "recompute",
        "recompute_granularity",
        "Megatron-core's recompute granularity",
    ),
];

/// Moves the Megatron settings written under `parallel:` into `megatron:` (a value given in
/// both places must agree) and checks `parallel.dp`; `root` is the whole run spec.
pub(crate) fn fold(root: &mut Map<String, Value>) -> Result<()> {
    let Some(Value::Object(parallel)) = root.get_mut("parallel") else {
        return Ok(());
    };
    check_dp(parallel)?;
    let megatron_framework = parallel.get("framework").and_then(Value::as_str) == Some("megatron");
    let mut moved = Vec::new();
    for &(key, megatron_key, what) in MEGATRON_ALIASES {
        let Some(value) = parallel.get(key) else {
            continue;
        };
        if !megatron_framework {
            if key == "ep" {
                continue;
            }
            return Err(Error::field(
                format!("parallel.{key}"),
                value,
                format!("it is {what}: set parallel.framework: megatron, or leave it out"),
            ));
        }
        // `recompute: none` is Megatron's unset granularity.
        let value = match value {
            Value::String(s) if key == "recompute" && s == "none" => Value::Null,
            _ => value.clone(),
        };
        moved.push((key, megatron_key, value));
        parallel.remove(key);
    }
    if moved.is_empty() {
        return Ok(());
    }
    let megatron = root
        .entry("megatron")
        .or_insert_with(|| Value::Object(Map::new()));
    if megatron.is_null() {
        *megatron = Value::Object(Map::new());
    }
    // A block that is not a mapping is `parse_megatron`'s to name.
    let Value::Object(megatron) = megatron else {
        return Ok(());
    };
    for (key, megatron_key, value) in moved {
        match megatron.get(megatron_key).filter(|given| !given.is_null()) {
            Some(given) if *given != value => {
                return Err(Error::field(
                    format!("parallel.{key}"),
                    &value,
                    format!(
                        "megatron.{megatron_key} says {given}: give it once, under parallel or \
                         under megatron"
                    ),
                ));
            }
            Some(_) => {}
            None if value.is_null() => {}
            None => {
                megatron.insert(megatron_key.to_owned(), value);
            }
        }
    }
    Ok(())
}

/// `parallel.dp`: what `world_size / (tp · pp · cp)` is, or an error naming both.
fn check_dp(parallel: &mut Map<String, Value>) -> Result<()> {
    let Some(given) = parallel.get("dp") else {
        return Ok(());
    };
    let size = |key: &str| parallel.get(key).and_then(Value::as_u64).unwrap_or(1);
    let Some(dp) = given.as_u64().filter(|&dp| dp >= 1) else {
        return Err(Error::field(
            "parallel.dp",
            given,
            "use a positive integer: world_size / (tp * pp * cp)",
        ));
    };
    let model = size("tp")
        .saturating_mul(size("pp"))
        .saturating_mul(size("cp"));
    // The other keys' own checks name a world that the sizes do not divide.
    if let Some(world) = parallel.get("world_size").and_then(Value::as_u64)
        && model > 0
        && world.is_multiple_of(model)
        && world / model != dp
    {
        return Err(Error::field(
            "parallel.dp",
            dp,
            format!(
                "world_size {world} / (tp * pp * cp = {model}) is {}: give that, or leave dp out",
                world / model
            ),
        ));
    }
    parallel.remove("dp");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn folded(spec: Value) -> Result<Value> {
        let mut spec = spec;
        fold(spec.as_object_mut().unwrap())?;
        Ok(spec)
    }

    #[test]
    fn megatron_settings_under_parallel_move_to_the_megatron_block() {
        let spec = folded(
            json!({"parallel": {"framework": "megatron", "world_size": 64, "tp": 4,
            "ep": 8, "etp": 1, "distributed_optimizer": true, "recompute": "full", "dp": 16}}),
        )
        .unwrap();
        assert_eq!(
            spec["megatron"],
            json!({"expert_model_parallel_size": 8, "expert_tensor_parallel_size": 1,
                "distributed_optimizer": true, "recompute_granularity": "full"})
        );
        let parallel = spec["parallel"].as_object().unwrap();
        for key in ["ep", "etp", "distributed_optimizer", "recompute", "dp"] {
            assert!(!parallel.contains_key(key), "{key}");
        }
        let none =
            folded(json!({"parallel": {"framework": "megatron", "recompute": "none"}})).unwrap();
        assert_eq!(none["megatron"], json!({}));
    }

    #[test]
    fn a_setting_given_twice_must_agree() {
        let agree = json!({"parallel": {"framework": "megatron", "ep": 8},
            "megatron": {"expert_model_parallel_size": 8}});
        assert!(folded(agree).is_ok());
        let err = folded(json!({"parallel": {"framework": "megatron", "ep": 8},
            "megatron": {"expert_model_parallel_size": 4}}))
        .unwrap_err()
        .to_string();
        assert!(err.contains("parallel.ep") && err.contains("megatron.expert_model_parallel_size"));
    }

    #[test]
    fn megatron_settings_need_the_megatron_framework() {
        let err = folded(json!({"parallel": {"framework": "torchtitan", "etp": 2}}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("parallel.etp") && err.contains("framework: megatron"));
        // Without Megatron, `ep` is transformers' expert parallelism and stays.
        let spec = folded(json!({"parallel": {"strategy": "none", "ep": 4}})).unwrap();
        assert_eq!(spec["parallel"]["ep"], 4);
    }

    #[test]
    fn dp_is_checked_against_the_other_sizes() {
        let err = folded(json!({"parallel": {"world_size": 64, "tp": 8, "pp": 4, "dp": 4}}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("parallel.dp") && err.contains("is 2"), "{err}");
        assert!(folded(json!({"parallel": {"world_size": 64, "tp": 8, "pp": 4, "dp": 2}})).is_ok());
        assert!(folded(json!({"parallel": {"dp": 0}})).is_err());
    }
}
