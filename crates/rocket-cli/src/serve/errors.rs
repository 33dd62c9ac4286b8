//! OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rocket_core::RocketError;
use serde_json::json;

/// An error answered to the client. `param` names the request field at fault.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: Some(code) }
    }

    fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    /// 400: a field has the wrong type.
    pub fn invalid_type(param: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_type", message).with_param(param)
    }

    /// 400: a field has a value outside its range.
    pub fn invalid_value(param: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_value", message).with_param(param)
    }

    /// 400: a required field is absent.
    pub fn missing(param: &str) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "missing_required_parameter",
            format!("you must provide the '{param}' parameter"),
        )
        .with_param(param)
    }

    /// 400: a valid OpenAI feature that rocket does not implement.
    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "unsupported_value", message).with_param(param)
    }

    /// 400: the body is not a JSON object.
    pub fn invalid_json(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_json", message)
    }

    /// 400: prompt + max_tokens do not fit the context.
    pub fn context_length(param: &str, prompt_tokens: usize, max_tokens: usize, limit: usize) -> Self {
        let message = if prompt_tokens >= limit {
            // The prompt alone leaves no room: max_tokens (often a default) is beside the point.
            format!("this model's maximum context length is {limit} tokens, and the {param} alone take {prompt_tokens}; shorten the {param}")
        } else {
            format!(
                "this model's maximum context length is {limit} tokens, but {} tokens were requested \
                 ({prompt_tokens} in the {param}, {max_tokens} for the completion); \
                 shorten the {param} or lower max_tokens",
                prompt_tokens + max_tokens
            )
        };
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", "context_length_exceeded", message).with_param(param)
    }

    pub fn model_not_found(model: &str, served: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("the model '{model}' does not exist; this server serves '{served}'"),
        )
        .with_param("model")
    }

    /// 401: no API key, or not one of the server's (OpenAI's type and code).
    pub fn invalid_api_key(message: &str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", "invalid_api_key", message)
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", "not_found", format!("no route for {path}"))
    }

    pub fn method_not_allowed() -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method_not_allowed", "method not allowed")
    }

    /// 429: the request queue is full.
    pub fn overloaded(limit: usize) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "queue_full",
            format!("the server is at its limit of {limit} queued requests; retry later"),
        )
    }

    pub fn loading() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "model_loading", "the model is still loading; retry later")
    }

    pub fn shutting_down() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "shutting_down", "the server is shutting down")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal_error", message)
    }

    /// An engine error for a request whose prompt came in the field `prompt_param`.
    pub fn from_engine(e: &RocketError, prompt_param: &str) -> Self {
        match e {
            RocketError::InvalidArgument { parameter, message, value } => {
                Self::invalid_value(parameter, format!("invalid value for '{parameter}': {value} ({message})"))
            }
            RocketError::EmptyPrompt => Self::invalid_value(prompt_param, format!("'{prompt_param}' must not be empty")),
            RocketError::ContextOverflow { prompt_tokens, max_tokens, limit } => {
                Self::context_length(prompt_param, *prompt_tokens, *max_tokens, *limit)
            }
            // Chat templates reject some conversations (raise_exception), tokenizers odd input.
            RocketError::ChatTemplate(m) | RocketError::Tokenizer(m) => Self::invalid_value(prompt_param, m.clone()),
            RocketError::QueueFull { max_queue } => Self::overloaded(*max_queue),
            RocketError::ShuttingDown => Self::shutting_down(),
            RocketError::NoDevice(m) => Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "no_device", format!("no device is in service: {m}")),
            // Raised only when no running request would free memory for it: a smaller
            // max_tokens or prompt may fit, or the same request once the prefix cache
            // and other servers' work on the GPU have shrunk.
            RocketError::DeviceMemory(m) => Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", "insufficient_device_memory", m.clone()),
            other => Self::internal(other.to_string()),
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        // A full queue or a model still loading: clients (the openai one included) may retry.
        if matches!(self.status, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE) {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_has_the_openai_shape() {
        let e = ApiError::invalid_value("temperature", "must be >= 0");
        assert_eq!(
            e.body(),
            json!({"error": {"message": "must be >= 0", "type": "invalid_request_error",
                             "param": "temperature", "code": "invalid_value"}})
        );
        assert_eq!(ApiError::overloaded(4).status, StatusCode::TOO_MANY_REQUESTS);
        for busy in [ApiError::overloaded(4), ApiError::loading()] {
            assert_eq!(busy.into_response().headers()["retry-after"], "1");
        }
        assert!(ApiError::invalid_value("x", "y").into_response().headers().get("retry-after").is_none());
        assert_eq!(ApiError::overloaded(4).body()["error"]["param"], serde_json::Value::Null);
    }

    #[test]
    fn engine_errors_map_to_client_errors() {
        let e = ApiError::from_engine(&RocketError::ContextOverflow { prompt_tokens: 10, max_tokens: 5, limit: 12 }, "messages");
        assert_eq!((e.status, e.code, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("context_length_exceeded"), Some("messages")));
        assert!(e.message.contains("12 tokens") && e.message.contains("15 tokens"), "{}", e.message);
        let e = ApiError::from_engine(&RocketError::ContextOverflow { prompt_tokens: 80031, max_tokens: 1, limit: 8192 }, "messages");
        assert!(e.message.contains("the messages alone take 80031") && !e.message.contains("for the completion"), "{}", e.message);
        let e = ApiError::from_engine(&RocketError::invalid_arg("top_p", 2.0, "must be in (0, 1]"), "prompt");
        assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("top_p")));
        let e = ApiError::from_engine(&RocketError::NoDevice("cuda:0 (lost)".into()), "prompt");
        assert_eq!((e.status, e.code), (StatusCode::SERVICE_UNAVAILABLE, Some("no_device")));
        assert!(e.message.contains("cuda:0 (lost)"), "{}", e.message);
        let e = ApiError::from_engine(&RocketError::DeviceMemory("not enough device memory for the KV cache".into()), "prompt");
        assert_eq!((e.status, e.code), (StatusCode::SERVICE_UNAVAILABLE, Some("insufficient_device_memory")));
        assert!(e.message.contains("KV cache"), "{}", e.message);
        let e = ApiError::from_engine(&RocketError::Internal("boom".into()), "prompt");
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
}
