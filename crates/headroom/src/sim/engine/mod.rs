//! Eager PyTorch as the model code sees it. [`tracer`] holds tensors, parameters and the
//! autograd graph; [`ops`] gives each kernel its allocations ([`ops_routing`] those of
//! mixture-of-experts routing, [`ring_attention`] context parallelism's attention);
//! [`backward`] runs the graph as
//! `torch/csrc/autograd/engine.cpp` does; [`memory`] serves every allocation through the
//! caching-allocator simulator and keeps the peak and what it is made of ([`component`]).

pub(crate) mod backward;
pub mod component;
pub mod memory;
pub(crate) mod ops;
pub(crate) mod ops_routing;
pub(crate) mod ring_attention;
pub(crate) mod tracer;
