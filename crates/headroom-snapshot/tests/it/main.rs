//! The integration tests of the snapshot reader, one binary with a module per area; the path
//! of the shared fixture is in `common`.

mod addresses;
mod common;
mod corrupt;
mod fixture;
mod hostile;
mod memory_viz;
mod properties;
mod recorded;
mod replay;
