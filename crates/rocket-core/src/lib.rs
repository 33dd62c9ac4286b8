//! rocket_core: an LLM inference engine specialised for a few known models.
//!
//! ```no_run
//! use rocket_core::{Engine, EngineOptions, SamplingOptions};
//! let engine = Engine::load("SmolLM2-135M-Instruct.Q4_1.gguf", EngineOptions::default())?;
//! // Unset fields take the model's generation_config defaults; max_tokens 16.
//! let out = engine.generate("The capital of France is", &SamplingOptions::default())?;
//! println!("{}", out.text);
//! let out = engine.generate("Once upon a time", &SamplingOptions { max_tokens: Some(32), temperature: Some(0.8), ..Default::default() })?;
//! println!("{}", out.text);
//! # Ok::<(), rocket_core::RocketError>(())
//! ```
//!
//! Layers: [`model`] (spec, sources, tensor layout), [`weights`] (safetensors,
//! GGUF), [`text`] (tokenizer, chat templates), [`backend`] (the CPU reference),
//! [`sampling`], [`sampling_options`] (requests and their defaults), and [`engine`] which ties them together.

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
pub mod sampling_options;
pub mod text;
pub mod weights;

pub use backend::Device;
pub use batch::{BatchEvent, Batcher, RequestId};
pub use engine::{Engine, EngineOptions, FinishReason, Metrics, ModelInfo, RequestOutput, StopReason, StreamDelta, TokenLogprob};
pub use error::{ErrorKind, Result, RocketError};
pub use model::ModelSpec;
pub use options::{DecodePath, GpuOptions, MatmulPath, Progress, SamplerPlacement};
pub use sampling::SamplingParams;
pub use sampling_options::{RequestKind, SamplingOptions, DEFAULT_COMPLETION_MAX_TOKENS};
pub use text::ChatMessage;
