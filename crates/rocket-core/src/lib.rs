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
//! [`sampling`], [`sampling_options`] (requests and their defaults), and [`engine`]
//! which ties them together. Generation runs in a chain: [`engine`] → [`batch`]
//! (continuous batching) → the per-request policy → [`output`]; [`scheduler`]
//! runs an engine's batcher on a thread of its own for callers on many threads
//! (the server, Python).

pub mod backend;
pub mod batch;
pub mod default_model;
pub mod engine;
pub mod error;
pub mod megakernel;
pub mod model;
pub mod options;
pub mod output;
pub mod prefix_cache;
pub mod progress;
pub mod race;
pub mod router;
mod request;
pub mod portable_exp;
pub mod sampling;
pub mod sampling_options;
pub mod scheduler;
pub mod text;
pub mod weights;

#[cfg(test)]
mod device_loop_tests;
#[cfg(test)]
mod device_memory_tests;
#[cfg(test)]
mod prefix_pass_tests;

pub use backend::{BackendCounters, Device, SharedRows};
pub use batch::{BatchEvent, BatchModel, Batcher, RequestId};
pub use engine::{Engine, EngineOptions, ModelInfo, DEFAULT_PREFIX_CACHE_BYTES};
pub use prefix_cache::PrefixCacheStats;
pub use output::{FinishReason, Metrics, RequestOutput, StopReason, StreamDelta, TokenLogprob};
pub use request::EngineRequest;
pub use scheduler::{DecodePaths, EventSink, RequestHandle, Scheduler, SchedulerOptions};
pub use error::{ErrorKind, Result, RocketError};
pub use model::ModelSpec;
pub use options::{DecodePath, Devices, GpuOptions, MatmulPath, Progress, SamplerPlacement};
pub use sampling::SamplingParams;
pub use sampling_options::{RequestKind, SamplingOptions, DEFAULT_COMPLETION_MAX_TOKENS};
pub use text::ChatMessage;
