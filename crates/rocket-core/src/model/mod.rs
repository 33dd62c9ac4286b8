//! What a model is: its validated spec, where it came from, and its tensor layout.

pub mod generation_config;
pub mod layout;
pub mod rope;
pub mod source;
pub mod spec;

pub use generation_config::GenerationConfig;
pub use layout::{LayerWeights, ModelWeights};
pub use source::{Format, ModelSource, SpecialTokens};
pub use spec::{Family, Llama3RopeScaling, ModelSpec, SUPPORTED_MODEL_TYPES};
