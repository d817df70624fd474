//! `headroom validate`: estimate every row of a calibration file and compare with what was
//! measured. This is how every number headroom prints is checked against a real run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::estimate::{self, Estimate};
use crate::gpu::{self, Gpu};
use crate::spec::{FsdpUnits, RunSpec};

/// What the harness measured for a row (calibration format).
#[derive(Clone, Debug)]
pub struct Measured {
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// Absent for rows measured beside other processes on one GPU.
    pub cuda_context_bytes: Option<u64>,
    pub params: u64,
    pub trainable_params: u64,
}

#[derive(Clone, Debug)]
pub struct Row {
    pub id: String,
    pub spec: RunSpec,
    pub measured: Measured,
    pub gpu: Gpu,
    /// The one rank measured (rank 0 of a fake process group); `None`: every rank was, and
    /// the worst is compared.
    pub rank: Option<u64>,
}

/// One row's comparison. Errors are signed fractions: (estimate - measured) / measured.
#[derive(Clone, Debug)]
pub struct RowResult {
    pub row: Row,
    pub estimate: Estimate,
    pub alloc_error: f64,
    pub reserved_error: f64,
}

/// |error| statistics of one column over a set of rows.
#[derive(Clone, Debug, PartialEq)]
pub struct ErrorStats {
    pub median_abs: f64,
    pub p90_abs: f64,
    pub max_abs: f64,
    pub under_estimates: usize,
}

impl ErrorStats {
    pub fn of(errors: &[f64]) -> ErrorStats {
        let mut abs: Vec<f64> = errors.iter().map(|e| e.abs()).collect();
        abs.sort_by(f64::total_cmp);
        let pick = |q: f64| -> f64 {
            if abs.is_empty() {
                return 0.0;
            }
            // Nearest-rank percentile.
            let rank = ((q * abs.len() as f64).ceil() as usize).clamp(1, abs.len());
            abs[rank - 1]
        };
        let median = if abs.is_empty() {
            0.0
        } else if abs.len() % 2 == 1 {
            abs[abs.len() / 2]
        } else {
            (abs[abs.len() / 2 - 1] + abs[abs.len() / 2]) / 2.0
        };
        ErrorStats {
            median_abs: median,
            p90_abs: pick(0.9),
            max_abs: abs.last().copied().unwrap_or(0.0),
            under_estimates: errors.iter().filter(|e| **e < 0.0).count(),
        }
    }
}

/// |error| statistics of the allocated and of the reserved peaks over a set of comparisons.
#[derive(Clone, Debug, PartialEq)]
pub struct Accuracy {
    pub count: usize,
    pub allocated: ErrorStats,
    pub reserved: ErrorStats,
}

impl Accuracy {
    pub fn of_rows<'a>(rows: impl IntoIterator<Item = &'a RowResult>) -> Accuracy {
        Self::of_errors(rows.into_iter().map(|r| (r.alloc_error, r.reserved_error)))
    }

    pub fn of_phases(phases: &[PhaseResult]) -> Accuracy {
        Self::of_errors(phases.iter().map(|p| (p.alloc_error, p.reserved_error)))
    }

    fn of_errors(errors: impl Iterator<Item = (f64, f64)>) -> Accuracy {
        let (alloc, reserved): (Vec<f64>, Vec<f64>) = errors.unzip();
        Accuracy {
            count: alloc.len(),
            allocated: ErrorStats::of(&alloc),
            reserved: ErrorStats::of(&reserved),
        }
    }
}

/// Estimate against measurement as a signed fraction: (estimate - measured) / measured.
pub fn relative_error(estimate: u64, measured: u64) -> f64 {
    (estimate as f64 - measured as f64) / measured as f64
}

/// Every row and pipeline phase of a set of calibration files, checked.
#[derive(Clone, Debug, Default)]
pub struct Validation {
    pub rows: Vec<RowResult>,
    pub pipelines: PipelineChecks,
}

impl Validation {
    pub fn row_accuracy(&self) -> Accuracy {
        Accuracy::of_rows(&self.rows)
    }

    pub fn phase_accuracy(&self) -> Accuracy {
        Accuracy::of_phases(&self.pipelines.phases)
    }
}

/// Estimate every row and pipeline row of `files`. A row whose setup is not modelled yet is
/// listed as a note rather than failing the rest: it was measured ahead of its model.
pub fn check_files(files: &[PathBuf]) -> Result<Validation> {
    let mut out = Validation::default();
    for file in files {
        for row in load_rows(file)? {
            let id = row.id.clone();
            match check(row, file.parent()) {
                Ok(result) => out.rows.push(result),
                Err(e @ Error::Unsupported { .. }) => out
                    .pipelines
                    .notes
                    .push((format!("{id}: measured, not estimated: {e}"), true)),
                Err(e) => {
                    return Err(Error::Row {
                        id,
                        error: Box::new(e),
                    });
                }
            }
        }
        let checks = check_pipelines(file)?;
        out.pipelines.phases.extend(checks.phases);
        out.pipelines.notes.extend(checks.notes);
    }
    Ok(out)
}

/// Limits on |error|, in percent, that a validation must keep to.
#[derive(Clone, Debug, Default)]
pub struct Gates {
    /// On every row's and pipeline phase's peak allocated error.
    pub max_alloc_error: Option<f64>,
    /// On the median of the rows' peak allocated errors.
    pub median_alloc_error: Option<f64>,
    /// On every row's and pipeline phase's peak reserved error.
    pub max_reserved_error: Option<f64>,
    /// On the median of the rows' peak reserved errors.
    pub median_reserved_error: Option<f64>,
}

impl Gates {
    /// Why `v` fails: the pipeline notes where the estimate disagrees with the run, then every
    /// limit exceeded. Empty when it passes.
    pub fn failures(&self, v: &Validation) -> Vec<String> {
        let (rows, phases) = (v.row_accuracy(), v.phase_accuracy());
        let mut failures: Vec<String> = v
            .pipelines
            .notes
            .iter()
            .filter(|(_, agrees)| !agrees)
            .map(|(note, _)| note.clone())
            .collect();
        let mut gate = |limit: Option<f64>, value: f64, what: &str| {
            if let Some(limit) = limit
                && 100.0 * value > limit
            {
                failures.push(format!("{what} {:.2}% exceeds {limit}%", 100.0 * value));
            }
        };
        gate(
            self.max_alloc_error,
            rows.allocated.max_abs.max(phases.allocated.max_abs),
            "max |peak allocated error|",
        );
        gate(
            self.median_alloc_error,
            rows.allocated.median_abs,
            "median |peak allocated error|",
        );
        gate(
            self.max_reserved_error,
            rows.reserved.max_abs.max(phases.reserved.max_abs),
            "max |peak reserved error|",
        );
        gate(
            self.median_reserved_error,
            rows.reserved.median_abs,
            "median |peak reserved error|",
        );
        failures
    }
}

/// The largest phase peak of the steps of `ranks` (`headroom_measure dist`'s records: each
/// rank's `steps`, each a mapping of `*_peak` phases), loading left out.
pub fn ranks_steps_peak(ranks: &[Value]) -> Option<u64> {
    ranks
        .iter()
        .filter_map(|r| r["steps"].as_array())
        .flatten()
        .filter_map(Value::as_object)
        .flat_map(|phases| {
            phases
                .iter()
                .filter(|(k, _)| k.ends_with("_peak"))
                .filter_map(|(_, v)| v.as_u64())
        })
        .max()
}

/// Read a calibration JSONL file: one `{id, spec, measured, env}` object per line.
pub fn load_rows(path: &Path) -> Result<Vec<Row>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |message: String| Error::Syntax {
            path: path.to_path_buf(),
            line: Some(i + 1),
            column: None,
            message,
        };
        let v: Value = serde_json::from_str(line).map_err(|e| at(e.to_string()))?;
        if v.get("pipeline").is_some() {
            continue; // read by `check_pipelines`
        }
        let id = v["id"]
            .as_str()
            .ok_or_else(|| at("a row needs a string `id`".into()))?
            .to_string();
        let spec = RunSpec::from_value(&v["spec"]).map_err(|e| at(format!("row {id}: {e}")))?;
        let m = &v["measured"];
        let int = |key: &str| {
            m[key]
                .as_u64()
                .ok_or_else(|| at(format!("row {id}: `measured.{key}` must be an integer")))
        };
        // The estimate's peak is over the steps (loading is a phase of its own); a record
        // with each rank's phases (`headroom_measure dist`) says its steps' peak apart.
        let steps_peak = m["ranks"]
            .as_array()
            .and_then(|ranks| ranks_steps_peak(ranks));
        let measured = Measured {
            peak_allocated_bytes: match steps_peak {
                Some(peak) => peak,
                None => int("peak_allocated_bytes")?,
            },
            peak_reserved_bytes: int("peak_reserved_bytes")?,
            cuda_context_bytes: m["cuda_context_bytes"].as_u64(),
            params: int("params")?,
            trainable_params: int("trainable_params")?,
        };
        let gpu_name = v["env"]["gpu"].as_str().unwrap_or("NVIDIA H200");
        let gpu = gpu::from_device_name(gpu_name).map_err(|e| at(format!("row {id}: {e}")))?;
        // A pipeline's ranks hold different stages, context parallelism's run different ring
        // steps: a record of every rank (real NCCL) is one row per rank, each against the
        // estimate of its own rank.
        let distinct_ranks = m["ranks"].as_array().filter(|r| r.len() > 1).filter(|_| {
            spec.parallel
                .as_ref()
                .is_some_and(|p| p.pipeline.pp > 1 || p.tensor.cp > 1)
        });
        if let Some(ranks) = distinct_ranks {
            for r in ranks {
                let rank = r["rank"]
                    .as_u64()
                    .ok_or_else(|| at(format!("row {id}: a rank's `rank` must be an integer")))?;
                let (Some(peak_allocated_bytes), Some(peak_reserved_bytes)) = (
                    ranks_steps_peak(std::slice::from_ref(r)),
                    r["peak_reserved_bytes"].as_u64(),
                ) else {
                    return Err(at(format!(
                        "row {id}: rank {rank} needs its `steps` and `peak_reserved_bytes`"
                    )));
                };
                rows.push(Row {
                    rank: Some(rank),
                    id: format!("{id}/rank{rank}"),
                    spec: spec.clone(),
                    measured: Measured {
                        peak_allocated_bytes,
                        peak_reserved_bytes,
                        cuda_context_bytes: r["cuda_context_bytes"].as_u64(),
                        ..measured
                    },
                    gpu: gpu.clone(),
                });
            }
            continue;
        }
        let rank = (v["env"]["process_group"].as_str() == Some("fake"))
            .then(|| m["ranks"].as_array().filter(|r| r.len() == 1))
            .flatten()
            .and_then(|r| r[0]["rank"].as_u64());
        rows.push(Row {
            rank,
            id,
            spec,
            measured,
            gpu,
        });
    }
    Ok(rows)
}

/// Estimate one row. Relative model paths resolve against `base_dir`.
pub fn check(row: Row, base_dir: Option<&Path>) -> Result<RowResult> {
    let estimate = match row.rank {
        Some(rank) => estimate::estimate_rank(&row.spec, base_dir, &row.gpu, rank)?,
        None => estimate::estimate(&row.spec, base_dir, &row.gpu)?,
    };
    Ok(RowResult {
        alloc_error: relative_error(
            estimate.peak_allocated_bytes,
            row.measured.peak_allocated_bytes,
        ),
        reserved_error: relative_error(
            estimate.peak_reserved_bytes,
            row.measured.peak_reserved_bytes,
        ),
        estimate,
        row,
    })
}

/// The accuracy of `rows` per family, families sorted by name.
pub fn accuracy_by_family(rows: &[RowResult]) -> BTreeMap<String, Accuracy> {
    let mut groups: BTreeMap<String, Vec<&RowResult>> = BTreeMap::new();
    for row in rows {
        for family in families(&row.row) {
            groups.entry(family).or_default().push(row);
        }
    }
    groups
        .into_iter()
        .map(|(family, rows)| (family, Accuracy::of_rows(rows)))
        .collect()
}

/// Families rows are grouped into for the accuracy report.
pub fn families(row: &Row) -> Vec<String> {
    let s = &row.spec;
    // Rows built from a config file (small test models) form one group, not one each.
    let model = if crate::catalog::catalog().contains_key(&s.model) {
        s.model.clone()
    } else {
        "config.json files".to_string()
    };
    let mut out = vec![
        format!("model: {model}"),
        format!("precision: {}", s.precision.name()),
        format!("optimizer: {}", s.optimizer.name()),
    ];
    out.push(format!("gpu: {}", row.gpu.name));
    out.push(match &s.parallel {
        Some(p) if p.tensor.framework == crate::spec::Framework::Megatron => format!(
            "parallel: megatron-core ddp{} over {} ranks",
            if s.megatron.is_some_and(|m| m.distributed_optimizer) {
                " (distributed optimizer)"
            } else {
                ""
            },
            p.world_size
        ),
        Some(p) => format!(
            "parallel: {} over {} ranks",
            p.strategy.name(),
            p.world_size
        ),
        None => "parallel: one GPU".to_string(),
    });
    if s.parallel
        .as_ref()
        .is_some_and(|p| p.mixed_precision.is_some())
    {
        out.push("parallel: FSDP2 MixedPrecisionPolicy".to_string());
    }
    if let Some(tensor) = s.parallel.as_ref().map(|p| p.tensor).filter(|t| t.tp > 1) {
        out.push(if tensor.framework == crate::spec::Framework::Megatron {
            "parallel: tensor parallel (megatron-core)".to_string()
        } else if tensor.framework == crate::spec::Framework::Transformers {
            "parallel: tensor parallel (transformers' plan)".to_string()
        } else if tensor.sequence_parallel {
            "parallel: tensor parallel with sequence parallelism".to_string()
        } else {
            "parallel: tensor parallel".to_string()
        });
    }
    if s.parallel.as_ref().is_some_and(|p| p.tensor.cp > 1) {
        out.push("parallel: context parallel (ring attention)".to_string());
    }
    if let Some(pipeline) = s
        .parallel
        .as_ref()
        .map(|p| &p.pipeline)
        .filter(|p| p.pp > 1)
    {
        out.push(format!("parallel: pipeline {}", pipeline.schedule.name()));
    }
    if let Some(p) = s.parallel.as_ref().filter(|p| p.units != FsdpUnits::Layers) {
        out.push(format!("parallel: FSDP2 units {}", p.units.name()));
    }
    out.push(
        match (&s.lora, s.quantization) {
            (_, Some(_)) => "adapters: QLoRA (nf4)",
            (Some(_), None) => "adapters: LoRA",
            (None, None) => "adapters: full fine-tune",
        }
        .to_string(),
    );
    out.push(format!(
        "context: {}",
        match s.seq_len {
            0..=1024 => "<= 1k",
            1025..=4096 => "2k-4k",
            _ => "> 4k (long)",
        }
    ));
    let transformers = s.versions.followed(crate::spec::Library::Transformers);
    out.push(format!(
        "transformers: {}",
        transformers.map_or("not used".to_string(), |v| v.to_string())
    ));
    out.push(format!("trainer: {}", s.trainer.kind.name()));
    out.push(format!(
        "mode: {}",
        if s.mode == crate::spec::Mode::Forward {
            "forward"
        } else {
            "train"
        }
    ));
    out
}

/// One measured phase of a pipeline row against the estimate.
#[derive(Clone, Debug)]
pub struct PhaseResult {
    pub id: String,
    pub gpu: &'static str,
    pub phase: String,
    pub iteration: u32,
    pub measured_allocated: u64,
    pub estimated_allocated: u64,
    pub measured_reserved: u64,
    pub estimated_reserved: u64,
    pub alloc_error: f64,
    pub reserved_error: f64,
}

/// What the pipeline rows of a file gave: phases compared, and one line for each row whose
/// run ran out of memory or whose placement is not modelled (`ok` false: the estimate
/// disagrees with the measurement).
#[derive(Clone, Debug, Default)]
pub struct PipelineChecks {
    pub phases: Vec<PhaseResult>,
    pub notes: Vec<(String, bool)>,
}

/// Estimate every pipeline row of a calibration file (`{id, pipeline, measured: {phases}, env}`)
/// on the GPU it was measured on.
pub fn check_pipelines(path: &Path) -> Result<PipelineChecks> {
    use crate::estimate::estimate_pipeline;
    use crate::spec::PipelineSpec;
    let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let mut out = PipelineChecks::default();
    for (i, line) in text.lines().enumerate() {
        let at = |message: String| Error::Syntax {
            path: path.to_path_buf(),
            line: Some(i + 1),
            column: None,
            message,
        };
        let v: Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(_) if line.trim().is_empty() => continue,
            Err(e) => return Err(at(e.to_string())),
        };
        if v.get("pipeline").is_none() {
            continue;
        }
        let id = v["id"].as_str().unwrap_or("?").to_string();
        let spec = match PipelineSpec::from_value(&v["pipeline"]) {
            Ok(spec) => spec,
            Err(e) => {
                out.notes
                    .push((format!("{id}: measured, not estimated: {e}"), true));
                continue;
            }
        };
        let gpu = gpu::from_device_name(v["env"]["gpu"].as_str().unwrap_or("NVIDIA H200"))
            .map_err(|e| at(format!("row {id}: {e}")))?;
        let est = estimate_pipeline(&spec, path.parent(), &gpu, crate::estimate::Limit::Gpu)
            .map_err(|e| at(format!("row {id}: {e}")))?;
        for m in v["measured"]["phases"].as_array().into_iter().flatten() {
            let phase = m["phase"].as_str().unwrap_or_default().to_string();
            let iteration = m["iteration"].as_u64().unwrap_or_default() as u32;
            if m.get("oom").is_some() {
                let same = est
                    .oom
                    .as_ref()
                    .is_some_and(|o| o.phase == phase && o.step == iteration);
                out.notes.push((
                    format!(
                        "{id}: ran out of memory in {phase} {iteration}; the estimate {}",
                        if same {
                            "runs out there too"
                        } else {
                            "does not run out there"
                        }
                    ),
                    same,
                ));
                continue;
            }
            let Some(e) = est
                .phases
                .iter()
                .find(|p| p.name == phase && p.iteration == iteration)
            else {
                return Err(at(format!(
                    "row {id}: the estimate has no {phase} {iteration}"
                )));
            };
            let (ma, mr) = (
                m["peak_allocated"].as_u64().unwrap_or_default(),
                m["peak_reserved"].as_u64().unwrap_or_default(),
            );
            out.phases.push(PhaseResult {
                id: id.clone(),
                gpu: gpu.name,
                phase,
                iteration,
                measured_allocated: ma,
                estimated_allocated: e.peak_allocated,
                measured_reserved: mr,
                estimated_reserved: e.peak_reserved,
                alloc_error: relative_error(e.peak_allocated, ma),
                reserved_error: relative_error(e.peak_reserved, mr),
            });
        }
    }
    Ok(out)
}
