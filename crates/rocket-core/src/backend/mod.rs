//! Backends run the model: `cpu` is the f32 reference and the oracle every
//! faster backend is checked against.

pub mod cpu;

use crate::error::Result;

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's (decode, and the end of prefill).
    Last,
    /// Every position's, row after row (teacher forcing).
    All,
}

pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// A new sequence with KV room for `capacity` tokens.
    fn new_session(&self, capacity: usize) -> Result<Box<dyn Session + '_>>;
}

/// One sequence's state (its KV cache) on a backend.
pub trait Session {
    /// Tokens already in the cache.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Append `tokens` at positions `len()..` and return logits (f32, `vocab` per row).
    fn forward(&mut self, tokens: &[u32], logits: Logits) -> Result<Vec<f32>>;
}

/// Where the user asked the engine to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for Device {
    type Err = crate::error::RocketError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            other => Err(crate::error::RocketError::invalid_arg("device", other, "expected \"auto\", \"cpu\" or \"cuda\"")),
        }
    }
}
