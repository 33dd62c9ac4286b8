//! rocket_core: an LLM inference engine specialised for a few known models.
//!
//! ```no_run
//! use rocket_core::{Engine, EngineOptions, SamplingParams};
//! let engine = Engine::load("SmolLM2-135M-Instruct.Q4_1.gguf", EngineOptions::default())?;
//! let out = engine.generate("The capital of France is", &SamplingParams::greedy(16))?;
//! println!("{}", out.text);
//! # Ok::<(), rocket_core::RocketError>(())
//! ```
//!
//! Layers: [`model`] (spec, sources, tensor layout), [`weights`] (safetensors,
//! GGUF), [`text`] (tokenizer, chat templates), [`backend`] (the CPU reference),
//! [`sampling`], and [`engine`] which ties them together.

pub mod backend;
pub mod batch;
pub mod default_model;
pub mod engine;
pub mod error;
pub mod megakernel;
pub mod model;
pub mod options;
pub mod progress;
mod request;
pub mod portable_exp;
pub mod sampling;
pub mod text;
pub mod weights;

pub use backend::Device;
pub use batch::{BatchEvent, Batcher, RequestId};
pub use engine::{Engine, EngineOptions, FinishReason, Metrics, ModelInfo, RequestOutput, StopReason, StreamDelta, TokenLogprob};
pub use error::{ErrorKind, Result, RocketError};
pub use model::ModelSpec;
pub use options::{DecodePath, GpuOptions, MatmulPath, Progress, SamplerPlacement};
pub use sampling::SamplingParams;
pub use text::ChatMessage;
