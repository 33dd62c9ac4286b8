//! `rocket serve`: an OpenAI-compatible HTTP server (axum on tokio).
//!
//! The port is bound first and the model loads in the background (`/health`
//! answers 503 until it is ready). The core scheduler's thread runs the engine's
//! continuous batcher; handlers validate requests, hand them over, and answer
//! JSON or server-sent events. SIGTERM / Ctrl-C stop accepting connections and
//! let in-flight requests finish for `--shutdown-timeout` seconds (a second
//! signal, or the timeout, cancels them), then the process exits.

mod access;
mod auth;
mod errors;
mod metrics;
mod response;
mod routes;
mod schema;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use rocket_core::router::Router;
use rocket_core::{Devices, Engine, SchedulerOptions};
use tokio::sync::watch;

use crate::ModelArgs;
use auth::ApiKeys;
use metrics::ServerMetrics;
use response::Meta;

fn positive(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("must be an integer >= 1, got {s:?}")),
    }
}

/// A model name clients can send: not empty, no surrounding whitespace.
fn model_name(s: &str) -> Result<String, String> {
    if s.is_empty() || s.trim() != s {
        return Err(format!("must be a non-empty name without surrounding spaces, got {s:?}"));
    }
    Ok(s.to_string())
}

fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 => Ok(x),
        _ => Err(format!("must be a number of seconds >= 0, got {s:?}")),
    }
}

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one; the address is printed)
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients send and /v1/models lists [default: the model's file or folder name]
    #[arg(long, value_parser = model_name)]
    served_model_name: Option<String>,
    /// Most requests decoded together in one forward pass
    #[arg(long, default_value = "16", value_parser = positive)]
    max_batch: usize,
    /// Most requests admitted at once (running + waiting); beyond it requests get 429
    #[arg(long, default_value = "64", value_parser = positive)]
    max_queue: usize,
    /// Cap on max_tokens for requests that set none (their default is 16 for a
    /// completion, the context left for a chat) [default: no cap]
    #[arg(long, value_parser = positive)]
    default_max_tokens: Option<usize>,
    /// Seconds in-flight requests may run after SIGTERM/Ctrl-C before they are cancelled
    #[arg(long, default_value = "30", value_parser = seconds)]
    shutdown_timeout: f64,
    /// API key clients must send as 'Authorization: Bearer KEY' to use /v1/* (repeatable;
    /// /health and /metrics stay open) [default: ROCKET_API_KEY if no --api-key or
    /// --api-key-file is given, else no key: anyone who reaches the port may use it]
    #[arg(long = "api-key", value_name = "KEY")]
    api_keys: Vec<String>,
    /// File of API keys, one per line (blank lines and lines starting with # are skipped);
    /// keeps keys out of the process list
    #[arg(long, value_name = "PATH")]
    api_key_file: Option<PathBuf>,
    /// Run one engine per GPU: "all" or ordinals like "0,1" (each GPU gets its own
    /// weights, KV cache and scheduler; requests go to the least-loaded) [default: one engine on --device]
    #[arg(long, value_name = "all|0,1,...", value_parser = |v: &str| v.parse::<Devices>().map_err(|e| e.to_string()))]
    devices: Option<Devices>,
    /// Include each request's prompt text in its log line (ROCKET_LOG=info) [default: prompts are not logged]
    #[arg(long)]
    log_prompts: bool,
}

/// What exists once the model has loaded.
pub struct Ready {
    /// The first engine: tokenizer, chat template and request checks (every engine loads the same model).
    pub engine: Arc<Engine>,
    /// One engine per device, each with its scheduler; requests go to the least-loaded.
    pub router: Router,
}

/// State shared by every handler.
pub struct AppState {
    pub model_name: String,
    /// `--default-max-tokens`: caps the default max_tokens of requests that set none.
    pub default_max_tokens: Option<usize>,
    /// Unix time the server started (the model card's `created`).
    pub created: u64,
    /// Keys `/v1/*` requires (none: open).
    pub api_keys: ApiKeys,
    /// `--log-prompts`: request log lines carry the prompt text.
    pub log_prompts: bool,
    pub metrics: Arc<ServerMetrics>,
    ready: OnceLock<Ready>,
    shutting_down: AtomicBool,
    id_salt: u64,
    next_id: AtomicU64,
}

impl AppState {
    fn new(model_name: String, default_max_tokens: Option<usize>, api_keys: ApiKeys, log_prompts: bool) -> Self {
        AppState {
            model_name,
            default_max_tokens,
            created: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            api_keys,
            log_prompts,
            metrics: Arc::new(ServerMetrics::new()),
            ready: OnceLock::new(),
            shutting_down: AtomicBool::new(false),
            id_salt: rocket_core::sampling::fresh_seed(),
            next_id: AtomicU64::new(0),
        }
    }

    pub fn ready(&self) -> Option<&Ready> {
        self.ready.get()
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    /// A request id for a request that brought none (unique within this process).
    pub fn new_request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}{n:08x}", self.id_salt)
    }

    /// The response's id (`cmpl-…`, `chatcmpl-…`, after the request id) with the model name and time.
    pub fn meta(&self, prefix: &str, request_id: &str) -> Meta {
        Meta {
            id: format!("{prefix}-{request_id}"),
            created: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            model: self.model_name.clone(),
        }
    }
}

fn default_name(path: &std::path::Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string())
}

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    // Keys first: a server that would start open by mistake must not start at all.
    let keys = ApiKeys::load(&args.api_keys, args.api_key_file.as_deref(), crate::environment().api_key.as_deref())?;
    let path = args.model.path()?;
    let options = args.model.engine_options()?;
    // --devices against --device before the port opens (loading would find it later).
    if let Some(devices) = &args.devices {
        rocket_core::engine::check_devices_device(options.device, devices)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("rocket-http")
        .build()
        .context("starting the async runtime")?;
    let result = runtime.block_on(serve(args, path, options, keys));
    // A model still loading when a signal came is not waited for.
    runtime.shutdown_timeout(Duration::from_millis(200));
    result
}

/// Resolves on SIGTERM or Ctrl-C (SIGINT).
async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

async fn serve(args: &ServeArgs, path: PathBuf, options: rocket_core::EngineOptions, keys: ApiKeys) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("cannot listen on {}:{}", args.host, args.port))?;
    let addr: SocketAddr = listener.local_addr()?;
    let name = args.served_model_name.clone().unwrap_or_else(|| default_name(&path));
    if let Some(warning) = auth::exposure_warning(addr, &keys) {
        note!("{warning}");
    }
    let key_note = if keys.is_empty() { String::new() } else { format!("; {} API key(s) required on /v1", keys.len()) };
    let app = Arc::new(AppState::new(name, args.default_max_tokens, keys, args.log_prompts));
    note!("rocket serve: listening on http://{addr} (loading {}{key_note})", path.display());

    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let load_error: Arc<Mutex<Option<anyhow::Error>>> = Arc::default();

    // Load in the background; the port already answers /health with 503.
    {
        let (app, stop_tx, load_error) = (app.clone(), stop_tx.clone(), load_error.clone());
        let (max_batch, max_queue) = (args.max_batch, args.max_queue);
        let path = path.clone();
        let devices = args.devices.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let loaded = tokio::task::spawn_blocking(move || Router::load(path, options, devices.as_ref(), SchedulerOptions { max_batch, max_queue }))
            .await;
            let failure = match loaded {
                Ok(Ok(router)) if !app.is_shutting_down() => {
                    let engine = router.engine().clone();
                    let names = (0..router.len()).map(|i| router.name(i)).collect::<Vec<_>>().join(", ");
                    let info = engine.info();
                    note!(
                        "rocket serve: ready — {} ({} backend on {names}, context {} tokens, max batch {max_batch}, max queue {max_queue} per device) loaded in {:.1} s",
                        app.model_name,
                        info.backend,
                        info.max_seq_len,
                        started.elapsed().as_secs_f64()
                    );
                    let _ = app.ready.set(Ready { engine, router });
                    None
                }
                Ok(Ok(_)) => None,
                Ok(Err(e)) => Some(anyhow::Error::new(e)),
                Err(e) => Some(anyhow::anyhow!("loading the model panicked: {e}")),
            };
            if let Some(e) = failure {
                *load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                let _ = stop_tx.send(true);
            }
        });
    }

    // First signal: drain; the timeout or a second signal: cancel what is left.
    let drain = Duration::from_secs_f64(args.shutdown_timeout);
    {
        let (app, stop_tx) = (app.clone(), stop_tx.clone());
        let stop_rx = stop_rx.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = signal() => {}
                _ = stopped(stop_rx) => return,
            }
            app.shutting_down.store(true, Ordering::SeqCst);
            let in_flight = app.ready().map_or(0, |r| r.router.in_flight());
            note!(
                "rocket serve: shutting down; letting {in_flight} in-flight request(s) finish (up to {:.0} s; signal again to cancel them)",
                drain.as_secs_f64()
            );
            let _ = stop_tx.send(true);
            tokio::select! {
                _ = tokio::time::sleep(drain) => {}
                _ = signal() => {}
            }
            if let Some(r) = app.ready() {
                if r.router.in_flight() > 0 {
                    note!("rocket serve: cancelling {} request(s)", r.router.in_flight());
                }
                r.router.cancel_all();
            }
        });
    }

    let server = axum::serve(listener, routes::router(app.clone())).with_graceful_shutdown(stopped(stop_rx.clone()));
    let deadline = async {
        stopped(stop_rx.clone()).await;
        // Cancelled requests end their streams at once; this only guards against a stuck client.
        tokio::time::sleep(drain + Duration::from_secs(5)).await;
    };
    tokio::select! {
        r = server => r.context("the HTTP server failed")?,
        _ = deadline => note!("rocket serve: connections still open after the drain; closing them"),
    }
    if let Some(r) = app.ready() {
        r.router.cancel_all();
        r.router.shutdown();
    }
    if let Some(e) = load_error.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    note!("rocket serve: stopped");
    Ok(())
}
