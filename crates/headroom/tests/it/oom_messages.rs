//! The OOM parser and the message-only diagnosis over real messages from public issue
//! trackers (tests/data/oom_messages.json): every parsed field, and the cause.

use headroom::diagnose::oom_message::{self, Backend};
use serde_json::{Value, json};

fn corpus() -> Vec<Value> {
    let text = include_str!("../data/oom_messages.json");
    let doc: Value = serde_json::from_str(text).expect("oom_messages.json is JSON");
    doc["messages"]
        .as_array()
        .expect("a messages array")
        .clone()
}

/// The parsed message in the corpus's shape.
fn as_json(m: &oom_message::OomMessage, cause: &str, distinct: usize) -> Value {
    json!({
        "backend": match m.backend { Backend::Cuda => "CUDA", Backend::Hip => "HIP" },
        "format": m.format.key(),
        "torch_versions": m.torch_versions,
        "device": m.device,
        "tried_to_allocate_bytes": m.tried_to_allocate_bytes,
        "total_capacity_bytes": m.total_capacity_bytes,
        "free_bytes": m.free_bytes,
        "allocated_by_pytorch_bytes": m.allocated_by_pytorch_bytes,
        "reserved_unallocated_bytes": m.reserved_unallocated_bytes,
        "reserved_by_pytorch_bytes": m.reserved_by_pytorch_bytes,
        "allowed_bytes": m.allowed_bytes,
        "private_pools_bytes": m.private_pools_bytes,
        "processes": m.processes.iter().map(|p| json!({"pid": p.pid, "bytes": p.bytes})).collect::<Vec<_>>(),
        "cause": cause,
        "distinct_messages": distinct,
    })
}

#[test]
fn every_field_of_every_real_message() {
    let messages = corpus();
    assert!(messages.len() >= 25, "the corpus holds {}", messages.len());
    let mut failures = Vec::new();
    for entry in &messages {
        let source = entry["source"].as_str().unwrap_or("?");
        let text = entry["text"].as_str().expect("text");
        let all = oom_message::parse_all(text);
        let Some(m) = all.first() else {
            failures.push(format!("{source}: no message found"));
            continue;
        };
        let cause = oom_message::explain(m).cause.key();
        let got = as_json(m, cause, all.len());
        let want = &entry["expected"];
        for (key, expected) in want.as_object().expect("expected is an object") {
            if &got[key] != expected {
                failures.push(format!(
                    "{source}: {key}: got {}, expected {expected}",
                    got[key]
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_corpus_covers_every_format_backend_and_clause() {
    let messages = corpus();
    let has = |f: &dyn Fn(&Value) -> bool| messages.iter().any(|m| f(&m["expected"]));
    for format in ["cached", "reserved_in_total", "sentences"] {
        assert!(has(&|e| e["format"] == format), "no {format} message");
    }
    for versions in [
        "≤1.3",
        "1.4–2.0",
        "1.10–2.0",
        "2.1",
        "2.2–2.9",
        "2.4–2.9",
        "2.10",
        "2.11+",
    ] {
        assert!(
            has(&|e| e["torch_versions"] == versions),
            "no {versions} message"
        );
    }
    assert!(has(&|e| e["backend"] == "HIP"));
    assert!(has(&|e| !e["allowed_bytes"].is_null()));
    assert!(has(&|e| !e["private_pools_bytes"].is_null()));
    assert!(has(&|e| e["device"].is_null()));
    // Several processes in one message, the own one among them.
    assert!(has(&|e| {
        let p = e["processes"].as_array().map_or(0, Vec::len);
        p >= 3
            && e["processes"]
                .as_array()
                .is_some_and(|v| v.iter().any(|x| x["pid"].is_null()))
    }));
    for cause in [
        "shortage",
        "fragmentation",
        "other_processes",
        "impossible_request",
        "memory_fraction_cap",
        "free_exceeds_request",
        "unknown",
    ] {
        assert!(has(&|e| e["cause"] == cause), "no {cause} message");
    }
}

#[test]
fn explanations_quote_the_numbers() {
    for entry in corpus() {
        let text = entry["text"].as_str().expect("text");
        let Some(m) = oom_message::parse(text) else {
            continue;
        };
        let e = oom_message::explain(&m);
        if let Some(req) = m.tried_to_allocate_bytes {
            assert!(
                e.summary.contains(&headroom_alloc::format_size(req)),
                "{}: the summary does not quote the request: {}",
                entry["source"],
                e.summary
            );
        }
        if let Some(a) = &e.accounting {
            // The accounting never claims more than the device has (sysmem fallback aside).
            if a.allocated <= a.total {
                let attributed = a.free
                    + a.allocated
                    + a.reserved_unallocated
                    + a.this_process_non_pytorch.unwrap_or(0)
                    + a.other_processes.unwrap_or(0)
                    + a.unattributed;
                let slack = a.total / 50 + (16 << 20);
                assert!(
                    attributed <= a.total + slack,
                    "{}: {attributed} attributed on a {} device",
                    entry["source"],
                    a.total
                );
            }
        }
    }
}
