//! `headroom._native`: the `headroom` command's code for Python. Each function runs what one
//! command runs with `--json` and returns that JSON text, so a result's keys are the CLI's by
//! construction; `main` is the command line itself, for the wheel's `headroom` console script.
//!
//! Errors cross as one exception, `Failure(code, message, field, value, allowed)`: the
//! pure-Python package raises `headroom.SpecError` for bad input (code 2) and
//! `headroom.HeadroomError` otherwise. A panic is caught here and crosses as a failure too.

use std::ffi::OsString;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;

use headroom::diagnose::{Inputs, OomLog, decode_log};
use headroom_cli::cmd;
use headroom_cli::error::{CliError, CliResult, EXIT_FAILURE};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    _native,
    Failure,
    PyException,
    "A command's error: (code, message, field, value, allowed)."
);

fn failure(err: CliError) -> PyErr {
    let named = err
        .source
        .as_ref()
        .map(headroom::Error::named)
        .unwrap_or_default();
    Failure::new_err((
        err.code,
        err.message,
        named.field,
        named.value,
        named.allowed,
    ))
}

/// Runs `work` without the GIL (an estimate takes milliseconds, `fit` seconds), turning its
/// error, or a panic, into [`Failure`].
fn run(py: Python<'_>, work: impl FnOnce() -> CliResult<String> + Send) -> PyResult<String> {
    let outcome = py.detach(|| catch_unwind(AssertUnwindSafe(work)));
    match outcome {
        Ok(Ok(json)) => Ok(json),
        Ok(Err(err)) => Err(failure(err)),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            Err(failure(CliError {
                code: EXIT_FAILURE,
                message: format!("internal error (a bug in headroom; please report it): {what}"),
                source: None,
            }))
        }
    }
}

/// `headroom estimate SPEC [--gpu GPU] --json`.
#[pyfunction]
#[pyo3(signature = (spec, gpu=None, spec_dir=None, rank=None))]
fn estimate(
    py: Python<'_>,
    spec: PathBuf,
    gpu: Option<String>,
    spec_dir: Option<PathBuf>,
    rank: Option<u64>,
) -> PyResult<String> {
    run(py, || {
        cmd::estimate::json(&cmd::estimate::Args {
            spec,
            json: true,
            gpu,
            timeline: None,
            plot: None,
            rank,
            trace: false,
            spec_dir,
            python: headroom_cli::DEFAULT_PYTHON.to_string(),
        })
    })
}

/// `headroom fit SPEC --gpu GPU [--gpus N] [--resident R]... [--accelerate-config F] --json`.
#[pyfunction]
#[pyo3(signature = (spec, gpu, gpus=None, residents=Vec::new(), accelerate_config=None, spec_dir=None))]
fn fit(
    py: Python<'_>,
    spec: PathBuf,
    gpu: String,
    gpus: Option<u32>,
    residents: Vec<PathBuf>,
    accelerate_config: Option<PathBuf>,
    spec_dir: Option<PathBuf>,
) -> PyResult<String> {
    run(py, || {
        cmd::fit::json(&cmd::fit::Args {
            spec,
            gpu,
            gpus,
            residents,
            accelerate_config,
            json: true,
            plot: None,
            spec_dir,
        })
    })
}

/// `headroom diagnose --oom LOG [--spec SPEC] ... --json`, the log given as its bytes.
#[pyfunction]
#[pyo3(signature = (
    oom=None, spec=None, spec_dir=None, residents=Vec::new(), accelerate_config=None,
    deepspeed_config=None, scripts=Vec::new(), gpu=None, gpus=None
))]
#[allow(clippy::too_many_arguments)]
fn diagnose(
    py: Python<'_>,
    oom: Option<Vec<u8>>,
    spec: Option<PathBuf>,
    spec_dir: Option<PathBuf>,
    residents: Vec<PathBuf>,
    accelerate_config: Option<PathBuf>,
    deepspeed_config: Option<PathBuf>,
    scripts: Vec<PathBuf>,
    gpu: Option<String>,
    gpus: Option<u32>,
) -> PyResult<String> {
    run(py, || {
        cmd::diagnose::json(&Inputs {
            oom: oom.map(|bytes| OomLog {
                source: "oom_text".to_string(),
                text: decode_log(&bytes),
            }),
            spec,
            spec_dir,
            residents,
            accelerate_config,
            deepspeed_config,
            scripts,
            gpu,
            gpus,
        })
    })
}

/// `headroom snapshot FILE --json`.
#[pyfunction]
fn snapshot(py: Python<'_>, file: PathBuf) -> PyResult<String> {
    run(py, || {
        cmd::snapshot::json(&cmd::snapshot::Args {
            file,
            json: true,
            plot: None,
        })
    })
}

/// `headroom replay FILE [--alloc-conf STR] [--ignore-addresses] --json`.
#[pyfunction]
#[pyo3(signature = (file, alloc_conf=None, ignore_addresses=false))]
fn replay(
    py: Python<'_>,
    file: PathBuf,
    alloc_conf: Option<String>,
    ignore_addresses: bool,
) -> PyResult<String> {
    run(py, || {
        cmd::replay::json(&cmd::replay::Args {
            file,
            json: true,
            alloc_conf,
            plot: None,
            ignore_addresses,
        })
    })
}

/// `headroom measure SPEC [--snapshot F] [--record F] --python PYTHON --json`.
#[pyfunction]
#[pyo3(signature = (spec, python, snapshot=None, record=None, spec_dir=None))]
fn measure(
    py: Python<'_>,
    spec: PathBuf,
    python: String,
    snapshot: Option<PathBuf>,
    record: Option<PathBuf>,
    spec_dir: Option<PathBuf>,
) -> PyResult<String> {
    run(py, || {
        cmd::measure::json(&cmd::measure::Args {
            spec,
            snapshot,
            record,
            python,
            json: true,
            spec_dir,
        })
    })
}

/// The catalog name of the GPU that `torch.cuda.get_device_name()` calls `device`, as
/// `headroom measure` names the GPU it ran on.
#[pyfunction]
fn gpu_of_device(py: Python<'_>, device: String) -> PyResult<String> {
    run(py, || {
        Ok(headroom::gpu::from_device_name(&device)?.name.to_string())
    })
}

/// The `headroom` command line (`argv` with the program name first), run inside the Python at
/// `host_python`; returns the exit code.
#[pyfunction]
fn main(py: Python<'_>, argv: Vec<OsString>, host_python: String) -> u8 {
    py.detach(|| headroom_cli::main(argv, Some(&host_python)))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("Failure", m.py().get_type::<Failure>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(estimate, m)?)?;
    m.add_function(wrap_pyfunction!(fit, m)?)?;
    m.add_function(wrap_pyfunction!(diagnose, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(replay, m)?)?;
    m.add_function(wrap_pyfunction!(measure, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_of_device, m)?)?;
    m.add_function(wrap_pyfunction!(main, m)?)?;
    Ok(())
}
