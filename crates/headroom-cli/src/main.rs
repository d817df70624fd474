//! `headroom`: how much GPU memory a training run will take, why it ran out, and what to change.

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(headroom_cli::main(std::env::args_os(), None))
}
