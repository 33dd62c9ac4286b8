//! What every request goes through before and after its handler: its id
//! (`x-request-id`), the API key check, the request counter, and one log line
//! when it has finished (for a stream: when the stream ends or is dropped; for a
//! request whose client left before its response: status 499).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::auth;
use super::errors::ApiError;
use super::AppState;

pub const REQUEST_ID: &str = "x-request-id";
/// Longest client-sent request id that is echoed.
pub const MAX_REQUEST_ID: usize = 128;

/// The client's `x-request-id` if it is usable (1 to 128 printable ASCII characters).
pub fn client_request_id(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(REQUEST_ID)?.as_bytes();
    let ok = !value.is_empty() && value.len() <= MAX_REQUEST_ID && value.iter().all(|&b| (0x20..0x7f).contains(&b));
    ok.then(|| String::from_utf8_lossy(value).into_owned())
}

/// What the log line of one request reports, filled in as it goes.
#[derive(Default)]
struct Fields {
    status: Option<u16>,
    prompt_tokens: Option<usize>,
    output_tokens: Option<usize>,
    ttft: Option<Duration>,
    finish_reason: Option<&'static str>,
    prompt: Option<String>,
}

/// One request's record. Shared by the middleware and the handler (and its
/// stream); the last holder to drop it writes the log line.
pub struct RequestLog {
    pub id: String,
    pub endpoint: String,
    pub arrived: Instant,
    log_prompts: bool,
    fields: Mutex<Fields>,
}

impl RequestLog {
    fn fields(&self) -> std::sync::MutexGuard<'_, Fields> {
        self.fields.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The prompt was tokenised and handed to the scheduler.
    pub fn submitted(&self, prompt: &str, prompt_tokens: usize) {
        let mut f = self.fields();
        f.prompt_tokens = Some(prompt_tokens);
        if self.log_prompts {
            f.prompt = Some(prompt.to_string());
        }
    }

    pub fn first_token(&self, ttft: Duration) {
        self.fields().ttft = Some(ttft);
    }

    pub fn finished(&self, finish_reason: &'static str, output_tokens: usize) {
        let mut f = self.fields();
        f.finish_reason = Some(finish_reason);
        f.output_tokens = Some(output_tokens);
    }

    fn set_status(&self, status: u16) {
        self.fields().status = Some(status);
    }
}

impl Drop for RequestLog {
    fn drop(&mut self) {
        let f = self.fields.get_mut().unwrap_or_else(|p| p.into_inner());
        let duration_ms = self.arrived.elapsed().as_secs_f64() * 1e3;
        let ttft_ms = f.ttft.map(|t| t.as_secs_f64() * 1e3);
        // Strings are recorded quoted and escaped: a client's id or prompt cannot forge fields.
        macro_rules! line {
            ($level:ident) => {
                tracing::$level!(
                    target: "rocket::serve",
                    id = self.id.as_str(),
                    endpoint = self.endpoint.as_str(),
                    status = f.status,
                    prompt_tokens = f.prompt_tokens,
                    output_tokens = f.output_tokens,
                    ttft_ms,
                    duration_ms,
                    finish_reason = f.finish_reason,
                    prompt = f.prompt.as_deref(),
                    "request"
                )
            };
        }
        // Probes and scrapers come every few seconds: their lines only at debug.
        if matches!(self.endpoint.as_str(), "/health" | "/metrics") {
            line!(debug);
        } else {
            line!(info);
        }
    }
}

/// The status counted and logged for a request whose client went away before
/// its response was made (nginx's "client closed request").
pub const CLIENT_CLOSED: u16 = 499;

/// Counts and logs a request as `CLIENT_CLOSED` if it is dropped armed: the
/// connection closed while the handler worked, and its future was dropped.
struct Abandoned {
    app: Arc<AppState>,
    log: Arc<RequestLog>,
    armed: bool,
}

impl Drop for Abandoned {
    fn drop(&mut self) {
        if self.armed {
            self.log.set_status(CLIENT_CLOSED);
            self.app.metrics.count_request(&self.log.endpoint, CLIENT_CLOSED);
        }
    }
}

/// Around every route (and the fallback): id, key check, counting, log line.
pub async fn middleware(State(app): State<Arc<AppState>>, mut request: Request, next: Next) -> Response {
    let arrived = Instant::now();
    let id = client_request_id(request.headers()).unwrap_or_else(|| app.new_request_id());
    // The route pattern, not the path: label values stay few whatever clients send.
    let endpoint = request.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_string();
    let log = Arc::new(RequestLog { id, endpoint, arrived, log_prompts: app.log_prompts, fields: Mutex::default() });
    let mut abandoned = Abandoned { app: app.clone(), log: log.clone(), armed: true };
    let denied = if auth::protects(request.uri().path()) { app.api_keys.allows(request.headers()).err() } else { None };
    let mut response = match denied {
        // Refused before the body is read: no work is done for it.
        Some(why) => {
            let mut r = ApiError::invalid_api_key(why.message()).into_response();
            r.headers_mut().insert(axum::http::header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            r
        }
        None => {
            request.extensions_mut().insert(log.clone());
            next.run(request).await
        }
    };
    abandoned.armed = false;
    drop(abandoned);
    let status = response.status().as_u16();
    log.set_status(status);
    app.metrics.count_request(&log.endpoint, status);
    if let Ok(v) = HeaderValue::from_str(&log.id) {
        response.headers_mut().insert(REQUEST_ID, v);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(id: &[u8]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_bytes(id).unwrap());
        h
    }

    #[test]
    fn client_ids_are_echoed_only_when_printable_and_short() {
        assert_eq!(client_request_id(&with(b"abc-123 x")).as_deref(), Some("abc-123 x"));
        let longest = "a".repeat(MAX_REQUEST_ID);
        assert_eq!(client_request_id(&with(longest.as_bytes())), Some(longest.clone()));
        assert_eq!(client_request_id(&with(format!("{longest}a").as_bytes())), None);
        assert_eq!(client_request_id(&with(b"")), None);
        assert_eq!(client_request_id(&with(b"tab\there")), None);
        assert_eq!(client_request_id(&with("caf\u{e9}".as_bytes())), None);
        assert_eq!(client_request_id(&HeaderMap::new()), None);
    }
}
