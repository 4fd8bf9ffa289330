//! # ferry-sim: the seeded simulator
//!
//! Runs nodes of the real engine in one thread over a simulated network,
//! disk and clock, drawing every choice from one seed, and checks safety
//! after every step, linearizability of the client history at the end, and
//! liveness once the faults stop.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod history;
