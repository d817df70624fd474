//! DeepSpeed JSON configs: precision, the ZeRO stage, offload, and the memory its
//! communication buffers and stage-3 gathers take on every GPU (rules HR201-HR209).

use std::path::Path;

use serde_json::{Map, Value};

use super::{Context, Lint, Rule, Severity, Sink, as_count};
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::spec::{self, RunSpec};
use crate::units::{GIB, gib};

/// A number given as a number or as a string of one.
fn number(v: &Value) -> Option<f64> {
    v.as_f64()
        .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
}

/// Check a DeepSpeed JSON config: ZeRO stage, offload, precision, bucket sizes.
pub fn deepspeed(text: &str, path: &Path, cx: Context) -> Result<Vec<Lint>> {
    let doc = spec::parse_document(text, path)?;
    let obj = doc.as_object().ok_or_else(|| Error::Syntax {
        path: path.to_path_buf(),
        line: None,
        column: None,
        message: "a DeepSpeed config is a JSON object".into(),
    })?;
    let source = path.display().to_string();
    let mut s = Sink::new(&source);
    let elem = precision(&mut s, obj);
    let zero = obj.get("zero_optimization").and_then(Value::as_object);
    let Some(stage) = zero_stage(&mut s, zero) else {
        return Ok(s.lints);
    };
    let z = zero.cloned().unwrap_or_default();
    offload(&mut s, &z, stage);
    buffers(&mut s, &z, stage, elem, cx);
    micro_batch(&mut s, obj, cx.spec);
    Ok(s.lints)
}

/// HR201: fp16 and bf16 at once. Returns the bytes of an element of the buffers.
fn precision(s: &mut Sink, obj: &Map<String, Value>) -> f64 {
    let enabled = |k: &str| {
        obj.get(k)
            .and_then(|v| v.get("enabled"))
            .is_some_and(|e| e.as_bool() == Some(true) || e.as_str() == Some("auto"))
    };
    let (fp16, bf16) = (enabled("fp16"), enabled("bf16"));
    if fp16 && bf16 && obj["fp16"]["enabled"] == true && obj["bf16"]["enabled"] == true {
        s.push(
            Rule::DeepspeedFp16AndBf16,
            Severity::Error,
            "fp16.enabled, bf16.enabled",
            "both enabled: DeepSpeed refuses fp16 and bf16 at once".into(),
            "enable one",
        );
    }
    if fp16 || bf16 { 2.0 } else { 4.0 }
}

/// HR202-HR203: the ZeRO stage, `None` when there is no such stage (the other checks then
/// have nothing to go by).
fn zero_stage(s: &mut Sink, zero: Option<&Map<String, Value>>) -> Option<u64> {
    let stage = match zero.and_then(|z| z.get("stage")) {
        None => 0,
        Some(v) => match as_count(v) {
            Some(n @ 0..=3) => n,
            _ => {
                s.push(
                    Rule::DeepspeedZeroStageInvalid,
                    Severity::Error,
                    "zero_optimization.stage",
                    format!("{v} is not a ZeRO stage"),
                    "0, 1, 2 or 3",
                );
                return None;
            }
        },
    };
    if stage == 0 {
        s.push(
            Rule::DeepspeedNoZero,
            Severity::Info,
            "zero_optimization.stage",
            "no ZeRO: every rank holds the full optimizer states, gradients and weights".into(),
            "stage 1 shards the optimizer states, 2 adds gradients, 3 adds weights",
        );
    }
    Some(stage)
}

/// HR204-HR206: offload the stage does not do, or NVMe offload with nowhere to write.
fn offload(s: &mut Sink, z: &Map<String, Value>, stage: u64) {
    let offload_device = |k: &str| {
        z.get(k)
            .and_then(|o| o.get("device"))
            .and_then(Value::as_str)
            .filter(|d| *d != "none")
            .map(str::to_string)
    };
    if let Some(d) = offload_device("offload_param")
        && stage < 3
    {
        s.push(
            Rule::DeepspeedParamOffloadBelowStage3,
            Severity::Warning,
            "zero_optimization.offload_param",
            format!(
                "parameter offload to {d} works only with stage 3; at stage {stage} the weights \
                 stay on the GPU"
            ),
            "stage: 3, or drop offload_param",
        );
    }
    for key in ["offload_optimizer", "offload_param"] {
        if let Some(d) = offload_device(key) {
            if stage == 0 {
                s.push(
                    Rule::DeepspeedOffloadWithoutZero,
                    Severity::Error,
                    &format!("zero_optimization.{key}"),
                    "offload needs ZeRO stage 1, 2 or 3".into(),
                    "stage: 2 (optimizer) or 3 (parameters)",
                );
            }
            if d == "nvme"
                && z.get(key)
                    .and_then(|o| o.get("nvme_path"))
                    .and_then(Value::as_str)
                    .is_none()
            {
                s.push(
                    Rule::DeepspeedNvmeWithoutPath,
                    Severity::Error,
                    &format!("zero_optimization.{key}.nvme_path"),
                    "NVMe offload without nvme_path".into(),
                    "nvme_path: a local NVMe mount",
                );
            }
        }
    }
}

/// HR207-HR208: the communication buffers and stage-3 gathers every GPU holds, in elements
/// (DeepSpeed's defaults when unset).
fn buffers(s: &mut Sink, z: &Map<String, Value>, stage: u64, elem: f64, cx: Context) {
    let hidden = cx.arch.map(|a| a.hidden as f64);
    let value_of = |key: &str, default: f64, auto: Option<f64>| -> (f64, &'static str) {
        match z.get(key) {
            None => (default, "DeepSpeed's default"),
            Some(Value::String(a)) if a == "auto" => match auto {
                Some(x) => (x, "filled in by the HF integration from hidden_size"),
                None => (
                    default,
                    "auto (hidden_size unknown without a spec; default shown)",
                ),
            },
            Some(v) => (number(v).unwrap_or(default), "set"),
        }
    };
    let overlap = z.get("overlap_comm").and_then(Value::as_bool) == Some(true);
    if (1..=2).contains(&stage) {
        let (reduce, reduce_src) = value_of("reduce_bucket_size", 5e8, hidden.map(|h| h * h));
        let (gather, gather_src) = value_of("allgather_bucket_size", 5e8, None);
        // The HF DeepSpeed guide: "overlap_comm uses 4.5x the allgather_bucket_size and
        // reduce_bucket_size values".
        let factor = if overlap { 4.5 } else { 1.0 };
        let bytes = (reduce + gather) * elem * factor;
        let severity = threshold(bytes, cx.gpu);
        s.push(
            Rule::DeepspeedBucketMemory,
            severity,
            "zero_optimization.reduce_bucket_size, allgather_bucket_size",
            format!(
                "buckets of {reduce:.3e} ({reduce_src}) + {gather:.3e} ({gather_src}) elements \
                 × {elem} bytes{}: about {} per GPU on top of the model's memory",
                if overlap {
                    " × 4.5 (overlap_comm)"
                } else {
                    ""
                },
                gib(bytes.round() as u64)
            ),
            if severity == Severity::Info {
                ""
            } else {
                "smaller buckets (2e8 is common) or overlap_comm: false"
            },
        );
    }
    if stage == 3 {
        let (live, live_src) = value_of("stage3_max_live_parameters", 1e9, None);
        let (prefetch, prefetch_src) = value_of(
            "stage3_prefetch_bucket_size",
            5e7,
            hidden.map(|h| 0.9 * h * h),
        );
        let bytes = (live + prefetch) * elem;
        let severity = threshold(bytes, cx.gpu);
        s.push(
            Rule::DeepspeedStage3LiveParameters,
            severity,
            "zero_optimization.stage3_max_live_parameters, stage3_prefetch_bucket_size",
            format!(
                "up to {live:.3e} ({live_src}) gathered plus {prefetch:.3e} ({prefetch_src}) \
                 prefetched parameters × {elem} bytes: up to {} per GPU at once",
                gib(bytes.round() as u64)
            ),
            if severity == Severity::Info {
                ""
            } else {
                "lower stage3_max_live_parameters (e.g. 3e8)"
            },
        );
    }
}

/// HR209: the micro-batch against the spec's.
fn micro_batch(s: &mut Sink, obj: &Map<String, Value>, spec: Option<&RunSpec>) {
    if let (Some(spec), Some(mb)) = (
        spec,
        obj.get("train_micro_batch_size_per_gpu").and_then(as_count),
    ) && mb != spec.batch_size
    {
        s.push(
            Rule::DeepspeedMicroBatchMismatch,
            Severity::Warning,
            "train_micro_batch_size_per_gpu",
            format!(
                "{mb} per GPU here, {} in the spec: the estimate is for the spec's",
                spec.batch_size
            ),
            "make them agree",
        );
    }
}

/// Buffers worth a warning: a GiB or more, or 5% of the GPU.
fn threshold(bytes: f64, gpu: Option<&Gpu>) -> Severity {
    let limit = gpu.map_or(GIB as f64, |g| {
        (g.total_bytes as f64 / 20.0).min(GIB as f64)
    });
    if bytes >= limit {
        Severity::Warning
    } else {
        Severity::Info
    }
}
