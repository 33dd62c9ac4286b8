//! RocketError → the Python exception classes defined in `rocket/errors.py`
//! (kept in Python so `InvalidArgumentError` can also subclass `ValueError`).

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use rocket_core::{ErrorKind, RocketError};

fn class_name(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::ModelLoad => "ModelLoadError",
        ErrorKind::Tokenizer => "TokenizerError",
        ErrorKind::InvalidArgument => "InvalidArgumentError",
        ErrorKind::ContextLength => "ContextLengthError",
        ErrorKind::Device => "DeviceError",
        // The scheduler refused (queue full, shutting down): no narrower class fits.
        ErrorKind::Unavailable => "RocketError",
        ErrorKind::Internal => "InternalError",
    }
}

fn build(py: Python<'_>, err: &RocketError) -> PyResult<PyErr> {
    let module = py.import("rocket.errors")?;
    let class = module.getattr(class_name(err.kind()))?;
    let exc = class.call1((err.to_string(),))?;
    match err {
        RocketError::InvalidArgument { parameter, value, .. } => {
            exc.setattr("parameter", parameter)?;
            exc.setattr("value", value)?;
        }
        RocketError::EmptyPrompt => {
            exc.setattr("parameter", "prompt")?;
            exc.setattr("value", "")?;
        }
        RocketError::ContextOverflow { prompt_tokens, max_tokens, limit } => {
            exc.setattr("parameter", "prompt")?;
            exc.setattr("value", prompt_tokens)?;
            exc.setattr("prompt_tokens", prompt_tokens)?;
            exc.setattr("max_tokens", max_tokens)?;
            exc.setattr("limit", limit)?;
        }
        _ => {}
    }
    Ok(PyErr::from_value(exc))
}

pub fn to_py_err(py: Python<'_>, err: RocketError) -> PyErr {
    build(py, &err).unwrap_or_else(|_| PyRuntimeError::new_err(err.to_string()))
}
