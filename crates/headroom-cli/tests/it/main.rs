//! The integration tests of the `headroom` binary, one test binary with a module per area; each
//! runs the built binary (`common` has the helpers).

mod accuracy;
mod assumptions;
mod common;
mod diagnose_fit;
mod estimate;
mod fit_layouts;
mod fit_megatron_layouts;
mod page;
mod plot;
mod replay;
mod rules;
mod serve;
mod totality;
mod trace;
