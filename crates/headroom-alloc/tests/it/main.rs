//! The integration tests of the allocator simulator, one binary with a module per area.

mod invariants;
mod restore;
mod rules;
