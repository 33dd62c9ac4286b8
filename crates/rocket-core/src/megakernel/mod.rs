//! The persistent decode megakernel, the parts that need no GPU: its geometry,
//! the static schedule rocket-core compiles from a [`ModelSpec`](crate::ModelSpec)
//! (per-SM instruction lists with dependency counters), a verifier that proves
//! a schedule complete and deadlock-free, and a CPU twin that runs a schedule
//! the way the kernel does. The kernel itself is `kernels/src/megakernel.cu`,
//! its contract with the host `abi`, its host side `backend::cuda::megakernel`.
//!
//! One launch runs the whole token loop: one CTA per SM, eight consumer warps
//! executing the SM's instructions and one producer warp streaming the weights
//! of those instructions, step after step, through a shared-memory ring (weights
//! depend on nothing, so the producer runs ahead across instruction and step
//! boundaries while the consumers wait on activations). The last LM-head tile
//! picks the token, publishes it to the host and embeds the next input.

pub mod abi;
mod error;
pub mod geometry;
#[cfg(test)]
mod logprob_model;
pub mod profile;
pub mod schedule;
#[cfg(test)]
mod topk_model;
pub mod twin;
pub mod verify;

pub use error::{MegakernelError, StallSite};
pub use profile::Profile;
pub use schedule::{Counters, Instr, Op, Schedule, Wait, Work};
pub use verify::verify;
