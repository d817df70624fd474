//! One module per subcommand: each has `Args` (clap) and `run(Args) -> CliResult`.

pub mod diagnose;
pub mod estimate;
pub mod fit;
pub mod measure;
pub mod models;
pub mod replay;
pub mod rules;
pub mod serve;
pub mod snapshot;
pub mod trace;
pub mod validate;
