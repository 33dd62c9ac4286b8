//! HTTP handlers: request → validated engine request → scheduler → JSON body
//! or server-sent events.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode, Uri};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use rocket_core::{BatchEvent, Engine, EngineRequest, FinishReason, RequestHandle, RequestKind, RequestOutput, SamplingOptions, SamplingParams};
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::access::{self, RequestLog};
use super::errors::ApiError;
use super::metrics::{self, ServerMetrics};
use super::response::{self, ChunkWriter, Endpoint, TokenText};
use super::schema::{ChatRequest, CompletionRequest, Prompt};
use super::{AppState, Ready};

pub fn router(app: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(|uri: Uri| async move { ApiError::not_found(uri.path()) })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(axum::middleware::from_fn_with_state(app.clone(), access::middleware))
        .with_state(app)
}

/// Prometheus metrics; open like /health (vLLM's choice): counts, not content.
async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], app.metrics.render(app.ready())).into_response()
}

async fn health(State(app): State<Arc<AppState>>) -> Response {
    let (status, state) = if app.is_shutting_down() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting_down")
    } else {
        match app.ready() {
            None => (StatusCode::SERVICE_UNAVAILABLE, "loading"),
            Some(r) if !r.router.healthy() => (StatusCode::SERVICE_UNAVAILABLE, "failed"),
            // Some devices failed; the others serve.
            Some(r) if r.router.in_service() < r.router.len() => (StatusCode::OK, "degraded"),
            Some(_) => (StatusCode::OK, "ok"),
        }
    };
    let mut body = json!({"status": state, "model": app.model_name});
    if let Some(r) = app.ready() {
        body["requests_in_flight"] = json!(r.router.in_flight());
        body["max_queue"] = json!(r.router.options().max_queue);
        let devices: Vec<Value> = r
            .router
            .loads()
            .into_iter()
            .map(|d| {
                json!({
                    "device": d.name,
                    "in_service": d.in_service,
                    "requests_in_flight": d.in_flight,
                    "running": d.running,
                    "queued_prompt_tokens": d.queued_prompt_tokens,
                    "error": d.error,
                })
            })
            .collect();
        body["devices"] = json!(devices);
        // Each engine has its own prefix cache (its KV lives on its device): the
        // figures are summed, and max_bytes is the budget of each.
        let pc = r.router.prefix_cache_stats();
        let (max_bytes, block) = r.engine.prefix_cache_limits();
        body["prefix_cache"] = json!({
            "hits": pc.hits, "lookups": pc.lookups, "tokens_reused": pc.tokens_reused,
            "entries": pc.entries, "bytes": pc.bytes, "max_bytes": max_bytes,
            "block": block,
        });
    }
    (status, Json(body)).into_response()
}

fn model_card(app: &AppState) -> Value {
    json!({
        "id": app.model_name,
        "object": "model",
        "created": app.created,
        "owned_by": "rocket",
        "max_model_len": app.ready().map(|r| r.engine.info().max_seq_len),
    })
}

async fn models(State(app): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_card(&app)]}))
}

async fn model(State(app): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id == app.model_name {
        Json(model_card(&app)).into_response()
    } else {
        ApiError::model_not_found(&id, &app.model_name).into_response()
    }
}

fn rejection(r: BytesRejection) -> ApiError {
    let mut e = ApiError::invalid_json(r.body_text());
    e.status = r.status();
    if e.status == StatusCode::PAYLOAD_TOO_LARGE {
        e.code = Some("payload_too_large");
    }
    e
}

/// Common checks before a request reaches the engine.
fn admit(app: &AppState, body: Result<Bytes, BytesRejection>) -> Result<(&Ready, Bytes), ApiError> {
    if app.is_shutting_down() {
        return Err(ApiError::shutting_down());
    }
    let ready = app.ready().ok_or_else(ApiError::loading)?;
    Ok((ready, body.map_err(rejection)?))
}

fn check_model(app: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != app.model_name => Err(ApiError::model_not_found(m, &app.model_name)),
        _ => Ok(()),
    }
}

fn check_ids(engine: &Engine, param: &str, ids: &[u32]) -> Result<(), ApiError> {
    let vocab = engine.spec().vocab_size;
    match ids.iter().find(|&&id| id as usize >= vocab) {
        Some(bad) => Err(ApiError::invalid_value(param, format!("token id {bad} in '{param}' is not below the vocabulary size {vocab}"))),
        None => Ok(()),
    }
}

/// The request's sampling resolved by the engine (defaults, every check);
/// `default_max_tokens` (`rocket serve --default-max-tokens`) caps the
/// kind's default for requests that set no max_tokens.
fn engine_params(
    engine: &Engine,
    options: &SamplingOptions,
    kind: RequestKind,
    prompt_param: &str,
    prompt_tokens: usize,
    default_max_tokens: Option<usize>,
) -> Result<SamplingParams, ApiError> {
    let mut options = options.clone();
    if let (None, Some(cap)) = (options.max_tokens, default_max_tokens) {
        options.max_tokens = Some(engine.default_max_tokens(kind, prompt_tokens).min(cap));
    }
    engine.resolve(&options, kind, prompt_tokens).map_err(|e| ApiError::from_engine(&e, prompt_param))
}

/// A request handed to the scheduler: its events, and its handle, whose drop
/// (the response future or stream dropped when the client goes away) cancels it.
/// Its events are timed and counted here (TTFT, inter-token latency, tokens).
struct Submitted {
    rx: UnboundedReceiver<BatchEvent>,
    _handle: RequestHandle,
    log: Arc<RequestLog>,
    metrics: Arc<ServerMetrics>,
    last_token: Option<Instant>,
    tokens: usize,
    ended: bool,
}

impl Submitted {
    /// The next event, recorded; None when the channel closed.
    async fn next(&mut self) -> Option<BatchEvent> {
        let event = self.rx.recv().await;
        let now = Instant::now();
        match &event {
            Some(BatchEvent::Delta(_)) => {
                match self.last_token {
                    None => {
                        let ttft = now - self.log.arrived;
                        self.metrics.observe_ttft(ttft.as_secs_f64());
                        self.log.first_token(ttft);
                    }
                    Some(last) => self.metrics.observe_inter_token((now - last).as_secs_f64()),
                }
                self.last_token = Some(now);
                self.tokens += 1;
            }
            Some(BatchEvent::Finished(out)) => self.end(response::finish_reason(out), out.token_ids.len()),
            Some(BatchEvent::Failed(_)) | None => self.end("error", self.tokens),
        }
        event
    }

    fn end(&mut self, finish_reason: &'static str, tokens: usize) {
        if !self.ended {
            self.ended = true;
            self.metrics.add_generation_tokens(tokens);
            self.log.finished(finish_reason, tokens);
        }
    }
}

impl Drop for Submitted {
    /// Dropped before its last event: the client went away and the request is cancelled.
    fn drop(&mut self) {
        self.end("abort", self.tokens);
    }
}

/// Queue a request with the core scheduler; its events arrive on a tokio channel
/// (the sink never blocks the scheduler thread; a closed channel cancels).
fn submit(app: &AppState, ready: &Ready, log: &Arc<RequestLog>, request: EngineRequest, prompt_param: &str) -> Result<Submitted, ApiError> {
    let (tx, rx) = unbounded_channel();
    let (prompt, prompt_tokens) = (request.prompt.clone(), request.prompt_ids.len());
    let routed = ready
        .router
        .submit(request, Box::new(move |event| tx.send(event).is_ok()))
        .map_err(|e| ApiError::from_engine(&e, prompt_param))?;
    app.metrics.add_prompt_tokens(prompt_tokens);
    log.submitted(&prompt, prompt_tokens);
    Ok(Submitted { rx, _handle: routed.handle, log: log.clone(), metrics: app.metrics.clone(), last_token: None, tokens: 0, ended: false })
}

/// Wait for a request's result (non-streamed responses).
async fn collect(mut submitted: Submitted, prompt_param: &str) -> Result<RequestOutput, ApiError> {
    while let Some(event) = submitted.next().await {
        match event {
            BatchEvent::Delta(_) => {}
            BatchEvent::Finished(out) if out.finish_reason == FinishReason::Cancelled => {
                return Err(ApiError::shutting_down())
            }
            BatchEvent::Finished(out) => return Ok(out),
            BatchEvent::Failed(e) => return Err(ApiError::from_engine(&e, prompt_param)),
        }
    }
    Err(ApiError::internal("the request ended without a result"))
}

fn data(v: &Value) -> Result<Event, Infallible> {
    Ok(Event::default().data(v.to_string()))
}

/// Server-sent events for one request: chunks as tokens settle, then the
/// closing chunk, optional usage, and `data: [DONE]`. Dropping the stream (the
/// client went away) drops the request's handle, which cancels the generation.
fn sse_stream(
    engine: Arc<Engine>,
    submitted: Submitted,
    mut writer: ChunkWriter,
    echo: Option<String>,
    prompt_param: &'static str,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let first: Vec<Value> = writer.start(&TokenText::new(engine.tokenizer()), echo.as_deref());
    let head = stream::iter(first.iter().map(data).collect::<Vec<_>>());
    let body = stream::unfold(Some((submitted, writer)), move |state| {
        let engine = engine.clone();
        async move {
            let (mut submitted, mut writer) = state?;
            let tt = TokenText::new(engine.tokenizer());
            let mut events = Vec::new();
            let mut done = true;
            match submitted.next().await {
                Some(BatchEvent::Delta(d)) => {
                    done = false;
                    if let Some(chunk) = writer.token(&tt, d.token_id, d.logprob, &d.text) {
                        events.push(data(&chunk));
                    }
                }
                Some(BatchEvent::Finished(out)) if out.finish_reason == FinishReason::Cancelled => {
                    events.push(data(&ApiError::shutting_down().body()));
                }
                Some(BatchEvent::Finished(out)) => events.extend(writer.finish(&tt, &out).iter().map(data)),
                Some(BatchEvent::Failed(e)) => events.push(data(&ApiError::from_engine(&e, prompt_param).body())),
                None => events.push(data(&ApiError::internal("the request ended without a result").body())),
            }
            if done {
                events.push(Ok(Event::default().data("[DONE]")));
            }
            Some((stream::iter(events), (!done).then_some((submitted, writer))))
        }
    });
    head.chain(body.flatten())
}

fn sse_response(stream: impl Stream<Item = Result<Event, Infallible>> + Send + 'static) -> Response {
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(10))).into_response()
}

async fn completions(State(app): State<Arc<AppState>>, Extension(log): Extension<Arc<RequestLog>>, body: Result<Bytes, BytesRejection>) -> Response {
    completions_inner(&app, &log, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions_inner(app: &AppState, log: &Arc<RequestLog>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let (ready, body) = admit(app, body)?;
    let req = CompletionRequest::parse(&body)?;
    check_model(app, req.model.as_deref())?;
    let engine = &ready.engine;
    let (prompt, ids) = match req.prompt {
        Prompt::Text(text) => {
            if text.is_empty() {
                return Err(ApiError::invalid_value("prompt", "'prompt' must not be empty"));
            }
            let ids = engine.encode_prompt(&text).map_err(|e| ApiError::from_engine(&e, "prompt"))?;
            (text, ids)
        }
        Prompt::Ids(ids) => {
            if ids.is_empty() {
                return Err(ApiError::invalid_value("prompt", "'prompt' must not be empty"));
            }
            check_ids(engine, "prompt", &ids)?;
            let text = engine.tokenizer().decode(&ids, false).map_err(|e| ApiError::from_engine(&e, "prompt"))?;
            (text, ids)
        }
    };
    let params = engine_params(engine, &req.sampling, RequestKind::Completion, "prompt", ids.len(), app.default_max_tokens)?;
    let rx = submit(app, ready, log, EngineRequest { prompt: prompt.clone(), prompt_ids: ids, params }, "prompt")?;
    let meta = app.meta("cmpl", &log.id);
    if req.stream {
        let writer = ChunkWriter::new(meta, Endpoint::Completions, req.logprobs.is_some(), req.include_usage);
        let echo = req.echo.then_some(prompt);
        return Ok(sse_response(sse_stream(engine.clone(), rx, writer, echo, "prompt")));
    }
    let out = collect(rx, "prompt").await?;
    let tt = TokenText::new(engine.tokenizer());
    let logprobs = out.logprobs.as_ref().map(|items| response::completion_logprobs(&tt, items, &mut response::TextOffset::default()));
    let text = if req.echo { format!("{prompt}{}", out.text) } else { out.text.clone() };
    Ok(Json(response::completion_body(&meta, text, logprobs, &out)).into_response())
}

async fn chat_completions(State(app): State<Arc<AppState>>, Extension(log): Extension<Arc<RequestLog>>, body: Result<Bytes, BytesRejection>) -> Response {
    chat_inner(&app, &log, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn chat_inner(app: &AppState, log: &Arc<RequestLog>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let (ready, body) = admit(app, body)?;
    let req = ChatRequest::parse(&body)?;
    check_model(app, req.model.as_deref())?;
    let engine = &ready.engine;
    let prompt = engine.apply_chat_template(&req.messages, true).map_err(|e| ApiError::from_engine(&e, "messages"))?;
    let ids = engine.encode_prompt(&prompt).map_err(|e| ApiError::from_engine(&e, "messages"))?;
    let params = engine_params(engine, &req.sampling, RequestKind::Chat, "messages", ids.len(), app.default_max_tokens)?;
    let rx = submit(app, ready, log, EngineRequest { prompt, prompt_ids: ids, params }, "messages")?;
    let meta = app.meta("chatcmpl", &log.id);
    if req.stream {
        let writer = ChunkWriter::new(meta, Endpoint::Chat, req.logprobs, req.include_usage);
        return Ok(sse_response(sse_stream(engine.clone(), rx, writer, None, "messages")));
    }
    let out = collect(rx, "messages").await?;
    let tt = TokenText::new(engine.tokenizer());
    let logprobs = out.logprobs.as_ref().map(|items| response::chat_logprobs(&tt, items));
    Ok(Json(response::chat_body(&meta, logprobs, &out)).into_response())
}

#[cfg(test)]
mod tests {
    //! /health over two CPU engines standing in for GPUs (the router the server runs).

    use rocket_core::router::Router;
    use rocket_core::{Device, EngineOptions, Progress, SchedulerOptions};

    use super::super::auth::ApiKeys;
    use super::*;

    fn app_with_two_engines() -> Arc<AppState> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/parity/fixtures/tiny-llama");
        let engines: Vec<_> = (0..2)
            .map(|i| {
                let e = Engine::load(path, EngineOptions { device: Device::Cpu, progress: Progress::Off, ..EngineOptions::default() }).unwrap();
                (format!("cpu:{i}"), Arc::new(e))
            })
            .collect();
        let engine = engines[0].1.clone();
        let router = Router::new(engines, SchedulerOptions { max_batch: 2, max_queue: 4 }).unwrap();
        let app = Arc::new(AppState::new("tiny".into(), None, ApiKeys::default(), false));
        assert!(app.ready.set(Ready { engine, router }).is_ok());
        app
    }

    fn get_health(app: &Arc<AppState>) -> (StatusCode, Value) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let response = health(State(app.clone())).await;
            let status = response.status();
            let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
            (status, serde_json::from_slice(&body).unwrap())
        })
    }

    #[test]
    fn health_reports_each_device_and_turns_503_when_none_is_in_service() {
        let app = app_with_two_engines();
        let (status, body) = get_health(&app);
        assert_eq!((status, body["status"].as_str()), (StatusCode::OK, Some("ok")));
        let devices = body["devices"].as_array().unwrap();
        assert_eq!(devices.len(), 2);
        for (i, d) in devices.iter().enumerate() {
            assert_eq!(d["device"], json!(format!("cpu:{i}")));
            assert_eq!((d["in_service"].clone(), d["requests_in_flight"].clone(), d["running"].clone()), (json!(true), json!(0), json!(0)));
            assert_eq!((d["queued_prompt_tokens"].clone(), d["error"].clone()), (json!(0), Value::Null));
        }
        let router = &app.ready().unwrap().router;
        router.take_out_of_service(1, "a simulated lost device");
        let (status, body) = get_health(&app);
        assert_eq!((status, body["status"].as_str()), (StatusCode::OK, Some("degraded")));
        assert_eq!(body["devices"][0]["in_service"], json!(true));
        assert_eq!((body["devices"][1]["in_service"].clone(), body["devices"][1]["error"].clone()), (json!(false), json!("a simulated lost device")));
        router.take_out_of_service(0, "another");
        let (status, body) = get_health(&app);
        assert_eq!((status, body["status"].as_str()), (StatusCode::SERVICE_UNAVAILABLE, Some("failed")));
        let text = app.metrics.render(app.ready());
        for want in ["rocket_device_in_service{device=\"cpu:0\"} 0", "rocket_device_in_service{device=\"cpu:1\"} 0", "rocket_device_running_requests{device=\"cpu:1\"} 0"] {
            assert!(text.lines().any(|l| l == want), "no line {want:?} in\n{text}");
        }
    }
}
