//! One error type for the whole engine. Each variant names the file, tensor,
//! parameter or limit involved so the message alone tells the user what to fix.

use std::path::PathBuf;

pub type Result<T, E = RocketError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum RocketError {
    #[error("model path not found: {path}")]
    ModelNotFound { path: PathBuf },

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

    #[error("tensor {tensor:?} uses GGUF quantization {kind}, which rocket does not support (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)")]
    UnsupportedQuant { tensor: String, kind: String },

    #[error("tokenizer error: {0}")]
    Tokenizer(String),

    #[error("chat template error: {0}")]
    ChatTemplate(String),

    #[error("invalid value for {parameter}: {value} ({message})")]
    InvalidArgument { parameter: String, value: String, message: String },

    #[error("prompt is empty")]
    EmptyPrompt,

    #[error("prompt of {prompt_tokens} tokens + max_tokens {max_tokens} exceeds the context limit of {limit} tokens")]
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
            ModelNotFound { .. } | Io { .. } | InvalidConfig { .. } | UnsupportedModelType { .. }
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
