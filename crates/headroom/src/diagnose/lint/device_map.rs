//! `device_map="auto"` (or `balanced`, `sequential`) in scripts and logs, judged by the launch
//! that runs it (rules HR301-HR303).

use super::{Launch, Lint, Rule, Severity, Sink};

/// `device_map="auto"` (or `balanced`, `sequential`) in scripts or logs: one process spreading
/// a model over every visible GPU, which in a multi-process run puts a slice of every rank's
/// copy on every GPU.
pub fn device_map(source: &str, text: &str, launch: Option<&Launch>) -> Vec<Lint> {
    let mut s = Sink::new(source);
    for (i, line) in text.lines().enumerate() {
        let Some(value) = device_map_value(line) else {
            continue;
        };
        let distributed = launch.is_some_and(Launch::is_distributed);
        let processes = launch.and_then(|l| l.processes);
        if distributed && processes == Some(1) {
            s.push(
                Rule::DeviceMapOneProcessDistributed,
                Severity::Error,
                &format!("line {}", i + 1),
                format!(
                    "device_map=\"{value}\" under a distributed launch of one process: with \
                     several GPUs visible the model is spread over them, and accelerate refuses \
                     to train it (\"You can't train a model that has been loaded with \
                     `device_map='auto'` in any distributed mode\"); with one visible GPU it is \
                     the same as {{\"\": 0}}"
                ),
                "one process: distributed_type: 'NO' and device_map={\"\": 0}; several GPUs: \
                 one process per GPU, each loading with device_map={\"\": \
                 PartialState().process_index}",
            );
        } else if distributed {
            let ranks = processes
                .filter(|&n| n > 1)
                .map_or("each rank".to_string(), |n| {
                    format!("each of the {n} ranks")
                });
            s.push(
                Rule::DeviceMapDistributed,
                Severity::Error,
                &format!("line {}", i + 1),
                format!(
                    "device_map=\"{value}\" in a distributed launch: {ranks} spreads its own copy \
                     of the model over every visible GPU, so GPU 0 holds a slice of every rank's \
                     copy, and accelerate refuses to train a model placed on several devices in \
                     a distributed mode"
                ),
                "each rank holds its own copy on its own GPU: \
                 device_map={\"\": PartialState().process_index}, or no device_map and let \
                 accelerate place the model",
            );
        } else {
            s.push(
                Rule::DeviceMapSingleProcess,
                Severity::Info,
                &format!("line {}", i + 1),
                format!(
                    "device_map=\"{value}\" splits one model over every visible GPU (a pipeline \
                     where one GPU works at a time): in a single process that lowers the memory \
                     per GPU, and on one visible GPU it is the same as {{\"\": 0}}"
                ),
                "",
            );
        }
    }
    s.lints
}

/// The value of a `device_map` assignment on this line, if it is one that spreads a model.
fn device_map_value(line: &str) -> Option<&'static str> {
    let code = line.trim_start();
    if code.starts_with('#') || code.starts_with("//") {
        return None;
    }
    let at = line.find("device_map")?;
    // `device_map=`, `"device_map":`, `kwargs["device_map"] = `.
    let rest = line[at + "device_map".len()..].trim_start_matches(['"', '\'', ']', ' ']);
    let rest = rest.strip_prefix(['=', ':'])?.trim_start();
    let rest = rest.trim_start_matches(['"', '\'']);
    ["auto", "balanced_low_0", "balanced", "sequential"]
        .into_iter()
        .find(|v| {
            rest.strip_prefix(v)
                .is_some_and(|after| !after.starts_with(|c: char| c.is_alphanumeric() || c == '_'))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_map_values_are_read_from_python_yaml_and_json() {
        assert_eq!(
            device_map_value(r#"m = AutoModel.from_pretrained(p, device_map="auto")"#),
            Some("auto")
        );
        assert_eq!(
            device_map_value("  device_map = 'balanced_low_0',"),
            Some("balanced_low_0")
        );
        assert_eq!(device_map_value(r#""device_map": "auto","#), Some("auto"));
        assert_eq!(
            device_map_value("device_map: sequential"),
            Some("sequential")
        );
        assert_eq!(device_map_value(r#"device_map={"": 0}"#), None);
        assert_eq!(device_map_value("device_map=device_map"), None);
        assert_eq!(device_map_value(r#"device_map="automatic""#), None);
        assert_eq!(
            device_map_value(r#"        model_kwargs["device_map"] = "auto""#),
            Some("auto")
        );
        assert_eq!(
            device_map_value(r#"# used to pass device_map="auto""#),
            None
        );
    }
}
