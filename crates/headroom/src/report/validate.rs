//! `headroom validate --json`: every measured row and pipeline phase against its estimate.

use serde::Serialize;

use crate::validate::{ErrorStats, Validation};

/// Errors are signed fractions, (estimate - measured) / measured; the statistics are over
/// their absolute values.
#[derive(Debug, Serialize)]
pub struct ValidateJson<'a> {
    pub rows: Vec<ComparisonJson<'a>>,
    /// Over `rows`.
    pub allocated: StatsJson,
    /// Over `rows`.
    pub reserved: StatsJson,
    pub pipeline_phases: Vec<ComparisonJson<'a>>,
    /// Pipeline rows that ran out of memory or are not estimated, and rows measured ahead of
    /// their model.
    pub pipeline_notes: Vec<NoteJson<'a>>,
}

/// A row, or one phase of a pipeline row, measured and estimated.
#[derive(Debug, Serialize)]
pub struct ComparisonJson<'a> {
    pub id: &'a str,
    /// A pipeline phase's name; absent for a row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<&'a str>,
    /// A pipeline phase's iteration; absent for a row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iteration: Option<u32>,
    pub measured_peak_allocated_bytes: u64,
    pub estimated_peak_allocated_bytes: u64,
    pub alloc_error: f64,
    pub measured_peak_reserved_bytes: u64,
    pub estimated_peak_reserved_bytes: u64,
    pub reserved_error: f64,
}

#[derive(Debug, Serialize)]
pub struct StatsJson {
    pub median_abs_error: f64,
    /// Nearest-rank 90th percentile.
    pub p90_abs_error: f64,
    pub max_abs_error: f64,
    /// Errors below zero: the estimate was short.
    pub under_estimates: usize,
}

#[derive(Debug, Serialize)]
pub struct NoteJson<'a> {
    pub note: &'a str,
    /// False when the estimate disagrees with the measurement (an accuracy gate fails).
    pub agrees: bool,
}

impl<'a> ValidateJson<'a> {
    pub fn new(v: &'a Validation) -> Self {
        let accuracy = v.row_accuracy();
        Self {
            rows: v
                .rows
                .iter()
                .map(|x| ComparisonJson {
                    id: &x.row.id,
                    phase: None,
                    iteration: None,
                    measured_peak_allocated_bytes: x.row.measured.peak_allocated_bytes,
                    estimated_peak_allocated_bytes: x.estimate.peak_allocated_bytes,
                    alloc_error: x.alloc_error,
                    measured_peak_reserved_bytes: x.row.measured.peak_reserved_bytes,
                    estimated_peak_reserved_bytes: x.estimate.peak_reserved_bytes,
                    reserved_error: x.reserved_error,
                })
                .collect(),
            allocated: StatsJson::new(&accuracy.allocated),
            reserved: StatsJson::new(&accuracy.reserved),
            pipeline_phases: v
                .pipelines
                .phases
                .iter()
                .map(|p| ComparisonJson {
                    id: &p.id,
                    phase: Some(&p.phase),
                    iteration: Some(p.iteration),
                    measured_peak_allocated_bytes: p.measured_allocated,
                    estimated_peak_allocated_bytes: p.estimated_allocated,
                    alloc_error: p.alloc_error,
                    measured_peak_reserved_bytes: p.measured_reserved,
                    estimated_peak_reserved_bytes: p.estimated_reserved,
                    reserved_error: p.reserved_error,
                })
                .collect(),
            pipeline_notes: v
                .pipelines
                .notes
                .iter()
                .map(|(note, agrees)| NoteJson {
                    note,
                    agrees: *agrees,
                })
                .collect(),
        }
    }
}

impl StatsJson {
    fn new(s: &ErrorStats) -> Self {
        Self {
            median_abs_error: s.median_abs,
            p90_abs_error: s.p90_abs,
            max_abs_error: s.max_abs,
            under_estimates: s.under_estimates,
        }
    }
}
