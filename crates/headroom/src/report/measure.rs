//! `headroom measure --json`: a measurement on this machine's GPU beside the estimate.

use serde::Serialize;
use serde_json::Value;

use super::estimate::EstimateJson;
use crate::estimate::Estimate;
use crate::validate::relative_error;

#[derive(Debug, Serialize)]
pub struct MeasureJson<'a> {
    /// The harness's record as it printed it: the calibration format that `--record`
    /// appends and `headroom validate` reads.
    pub measured: &'a Value,
    /// The estimate on the GPU the harness ran on, without a verdict.
    pub estimate: EstimateJson<'a>,
    /// (estimate - measured) / measured of the peak allocated bytes.
    pub alloc_error: f64,
    /// The same of the peak reserved bytes.
    pub reserved_error: f64,
}

impl<'a> MeasureJson<'a> {
    pub fn new(
        record: &'a Value,
        est: &'a Estimate,
        measured_peak_allocated: u64,
        measured_peak_reserved: u64,
    ) -> Self {
        Self {
            measured: record,
            estimate: EstimateJson::new(est, false),
            alloc_error: relative_error(est.peak_allocated_bytes, measured_peak_allocated),
            reserved_error: relative_error(est.peak_reserved_bytes, measured_peak_reserved),
        }
    }
}
