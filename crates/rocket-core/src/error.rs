//! One error type for the whole engine. Each variant names the file, tensor,
//! parameter or limit involved so the message alone tells the user what to fix.

use std::path::PathBuf;

pub type Result<T, E = RocketError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum RocketError {
    #[error("model path not found: {path}")]
    ModelNotFound { path: PathBuf },

    #[error("{} is not a model folder: it has no {missing} (an HF model folder holds config.json, tokenizer.json and model.safetensors or its index; a GGUF model is one .gguf file)", dir.display())]
    NotAModelFolder { dir: PathBuf, missing: &'static str },

    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("invalid model config {path}: {message}")]
    InvalidConfig { path: PathBuf, message: String },

    #[error("unsupported model_type {found:?}; supported: {}", supported.join(", "))]
    UnsupportedModelType { found: String, supported: Vec<&'static str> },

    #[error("missing tensor {name:?} in {source_file}")]
    MissingTensor { name: String, source_file: String },

    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    TensorShape { name: String, expected: Vec<usize>, found: Vec<usize> },

    #[error("tensor {name:?} has dtype {found}; supported: {allowed}")]
    TensorDtype { name: String, found: String, allowed: String },

    #[error("corrupt or truncated file {path}: {message}")]
    CorruptFile { path: PathBuf, message: String },

    #[error("tensor {tensor:?} uses GGUF quantization {kind}, which rocket does not support (supported: {})", crate::weights::dequant::readable_names())]
    UnsupportedQuant { tensor: String, kind: String },

    #[error("tokenizer error: {0}")]
    Tokenizer(String),

    #[error("chat template error: {0}")]
    ChatTemplate(String),

    #[error("invalid value for {parameter}: {value} ({message})")]
    InvalidArgument { parameter: String, value: String, message: String },

    #[error("prompt is empty")]
    EmptyPrompt,

    #[error("{}", context_overflow_text(*.prompt_tokens, *.max_tokens, *.limit))]
    ContextOverflow { prompt_tokens: usize, max_tokens: usize, limit: usize },

    #[error("device error: {0}")]
    Device(String),

    /// Device memory ran short for an allocation (a request's KV cache): the
    /// device itself is fine, and the allocation may fit once other requests
    /// free theirs.
    #[error("device error: {0}")]
    DeviceMemory(String),

    /// A megakernel launch failed (watchdog, copy fault, hang); decoding goes
    /// on with CUDA graphs where the device still works.
    #[error("device error: {0}")]
    Megakernel(#[from] crate::megakernel::MegakernelError),

    #[error("no default model: {0}")]
    NoDefaultModel(String),

    #[error("the scheduler is at its limit of {max_queue} queued requests; retry later")]
    QueueFull { max_queue: usize },

    #[error("the scheduler is shutting down; it takes no new requests")]
    ShuttingDown,

    /// Every engine of a router is out of service (their devices failed).
    #[error("no device is in service: {0}")]
    NoDevice(String),

    #[error("internal error: {0}")]
    Internal(String),
}

impl RocketError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        RocketError::Io { path: path.into(), source }
    }

    pub fn corrupt(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        RocketError::CorruptFile { path: path.into(), message: message.into() }
    }

    pub fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        RocketError::InvalidConfig { path: path.into(), message: message.into() }
    }

    pub fn invalid_arg(parameter: &str, value: impl ToString, message: impl Into<String>) -> Self {
        RocketError::InvalidArgument {
            parameter: parameter.to_string(),
            value: value.to_string(),
            message: message.into(),
        }
    }

    /// Whether the device itself failed (a fault, a lost device, a megakernel
    /// launch that failed), as opposed to running short of memory for one
    /// allocation: a server takes a failed device out of service.
    pub fn is_device_fault(&self) -> bool {
        matches!(self, RocketError::Device(_) | RocketError::Megakernel(_))
    }

    /// A short stable name for the error class; the Python layer maps it to an exception type.
    pub fn kind(&self) -> ErrorKind {
        use RocketError::*;
        match self {
            ModelNotFound { .. } | NotAModelFolder { .. } | Io { .. } | InvalidConfig { .. } | UnsupportedModelType { .. }
            | MissingTensor { .. } | TensorShape { .. } | TensorDtype { .. } | CorruptFile { .. }
            | UnsupportedQuant { .. } | NoDefaultModel(_) => ErrorKind::ModelLoad,
            Tokenizer(_) | ChatTemplate(_) => ErrorKind::Tokenizer,
            InvalidArgument { .. } | EmptyPrompt => ErrorKind::InvalidArgument,
            ContextOverflow { .. } => ErrorKind::ContextLength,
            Device(_) | DeviceMemory(_) | Megakernel(_) => ErrorKind::Device,
            QueueFull { .. } | ShuttingDown | NoDevice(_) => ErrorKind::Unavailable,
            Internal(_) => ErrorKind::Internal,
        }
    }
}

/// "prompt of 1 token exceeds ...", "prompt of 60 tokens + max_tokens 5 exceeds ...":
/// no max_tokens where none was asked for (logits of a prompt).
fn context_overflow_text(prompt_tokens: usize, max_tokens: usize, limit: usize) -> String {
    let plural = |n: usize| if n == 1 { "" } else { "s" };
    let prompt = format!("prompt of {prompt_tokens} token{}", plural(prompt_tokens));
    // A prompt that fills the context alone is the problem whatever max_tokens is
    // (often a default the caller never set).
    if prompt_tokens == limit && max_tokens > 0 {
        return format!("{prompt} fills the context limit of {limit} tokens, leaving no room to generate");
    }
    let asked = if max_tokens > 0 && prompt_tokens < limit { format!(" + max_tokens {max_tokens}") } else { String::new() };
    format!("{prompt}{asked} exceeds the context limit of {limit} tokens")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    ModelLoad,
    Tokenizer,
    InvalidArgument,
    ContextLength,
    Device,
    /// The request was fine but cannot be taken now (queue full, shutting down).
    Unavailable,
    Internal,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_overflow_reads_as_english() {
        let text = |p, m, l| RocketError::ContextOverflow { prompt_tokens: p, max_tokens: m, limit: l }.to_string();
        assert_eq!(text(60, 5, 64), "prompt of 60 tokens + max_tokens 5 exceeds the context limit of 64 tokens");
        assert_eq!(text(1, 200, 100), "prompt of 1 token + max_tokens 200 exceeds the context limit of 100 tokens");
        assert_eq!(text(65, 0, 64), "prompt of 65 tokens exceeds the context limit of 64 tokens");
        // The prompt alone fills or passes the context: max_tokens is beside the point.
        assert_eq!(text(31, 1, 31), "prompt of 31 tokens fills the context limit of 31 tokens, leaving no room to generate");
        assert_eq!(text(80, 1, 64), "prompt of 80 tokens exceeds the context limit of 64 tokens");
    }
}
