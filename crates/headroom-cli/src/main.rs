//! `headroom`: how much GPU memory a training run will take, why it ran out, and what to change.
//!
//! A thin binary: it parses arguments, calls the `headroom` library and renders the answer.

mod cmd;
mod error;
mod plot;
mod progress;
mod render;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

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

fn main() -> ExitCode {
    // `headroom validate ... | head` must end quietly when the reader goes away, as Unix
    // tools do, not panic on the failed write (Rust ignores SIGPIPE by default).
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of a signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Estimate(args) => cmd::estimate::run(args),
        Command::Validate(args) => cmd::validate::run(args),
        Command::Snapshot(args) => cmd::snapshot::run(args),
        Command::Replay(args) => cmd::replay::run(args),
        Command::Diagnose(args) => cmd::diagnose::run(args),
        Command::Fit(args) => cmd::fit::run(args),
        Command::Measure(args) => cmd::measure::run(args),
        Command::Trace(args) => cmd::trace::run(args),
        Command::Models(args) => cmd::models::run(args),
        Command::Rules(args) => cmd::rules::run(args),
        Command::Serve(args) => cmd::serve::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::from(err.code)
        }
    }
}
