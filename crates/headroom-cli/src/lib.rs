//! The `headroom` command as a library: the cargo binary and the Python wheel's console script
//! both call [`main`], so they are one program; the Python bindings call each command's `json`
//! function, so their results are the `--json` of the same code.
//!
//! Thin: it parses arguments, calls the `headroom` library and renders the answer.

pub mod cmd;
pub mod error;
mod plot;
mod progress;
mod render;

use std::ffi::OsString;

use clap::{Parser, Subcommand};

/// The Python `measure` and `trace` run when neither `--python` nor [`PYTHON_ENV`] names one.
pub const DEFAULT_PYTHON: &str = "python3";
/// The environment variable naming the Python that has torch.
pub const PYTHON_ENV: &str = "HEADROOM_PYTHON";

#[derive(Parser)]
#[command(name = "headroom", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Estimate the peak GPU memory of a training or forward step from a run spec.
    Estimate(cmd::estimate::Args),
    /// Estimate every row of calibration files and compare with the measurements.
    Validate(cmd::validate::Args),
    /// Read a torch.cuda.memory snapshot: reserved, allocated, fragmentation, peak and its owners.
    Snapshot(cmd::snapshot::Args),
    /// Replay a snapshot's trace (or a `headroom trace` file) through the allocator simulator.
    Replay(cmd::replay::Args),
    /// Explain a CUDA/HIP out-of-memory error, check launch configs, and rank remedies.
    Diagnose(cmd::diagnose::Args),
    /// The largest micro-batch and sequence that fit a GPU, and the configurations that fit.
    Fit(cmd::fit::Args),
    /// Run the spec's steps on this machine's GPU and compare with the estimate.
    Measure(cmd::measure::Args),
    /// Trace the spec's steps with the real model code under fake tensors (no GPU), and replay them.
    Trace(cmd::trace::Args),
    /// List the built-in models a spec's `model:` can name.
    Models(cmd::models::Args),
    /// List the launch-config lint rules `diagnose` runs, or explain one by its id.
    Rules(cmd::rules::Args),
    /// A local web page: paste a spec and see its estimate, timeline and fit; read a snapshot;
    /// diagnose an OOM message.
    Serve(cmd::serve::Args),
}

/// Runs the command line `args` (the program name first) and returns its exit code: 0, or
/// the error's ([`error::EXIT_BAD_INPUT`] for bad input).
/// `host_python` is the interpreter this runs inside, when it runs inside one (the wheel's
/// console script): `measure`, `trace` and `estimate --trace` use it unless `--python` or
/// `HEADROOM_PYTHON` names another, so they find the torch of the environment headroom was
/// installed into.
pub fn main(args: impl IntoIterator<Item = OsString>, host_python: Option<&str>) -> u8 {
    // `headroom validate ... | head` must end quietly when the reader goes away, as Unix
    // tools do, not panic on the failed write (Rust ignores SIGPIPE, and so does Python).
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of a signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse_from(args);
    let host = |python: String| match host_python {
        Some(host) if python == DEFAULT_PYTHON && std::env::var_os(PYTHON_ENV).is_none() => {
            host.to_string()
        }
        _ => python,
    };
    let result = match cli.command {
        Command::Estimate(mut args) => {
            args.python = host(args.python);
            cmd::estimate::run(args)
        }
        Command::Validate(args) => cmd::validate::run(args),
        Command::Snapshot(args) => cmd::snapshot::run(args),
        Command::Replay(args) => cmd::replay::run(args),
        Command::Diagnose(args) => cmd::diagnose::run(args),
        Command::Fit(args) => cmd::fit::run(args),
        Command::Measure(mut args) => {
            args.python = host(args.python);
            cmd::measure::run(args)
        }
        Command::Trace(mut args) => {
            args.python = host(args.python);
            cmd::trace::run(args)
        }
        Command::Models(args) => cmd::models::run(args),
        Command::Rules(args) => cmd::rules::run(args),
        Command::Serve(args) => cmd::serve::run(args),
    };
    match result {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("error: {err}");
            err.code
        }
    }
}
