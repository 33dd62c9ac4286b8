//! `rocket.LLM(...)`'s engine keywords → `rocket_core::EngineOptions`: the
//! environment's `ROCKET_*` settings first (Python hands `os.environ`'s pairs
//! over; the core parses them), then every keyword that is not None. Bad
//! values are `InvalidArgumentError`s naming the keyword or variable.

use std::str::FromStr;

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt, PyString};
use rocket_core::options::{parse_bytes, parse_prefix_block, parse_trace_step, parse_watchdog_ms};
use rocket_core::{EngineOptions, RocketError};

use crate::errors::to_py_err;

/// Validated engine options; made once per `rocket.LLM` before the model path
/// is resolved, so a bad keyword fails before any lookup or load.
#[pyclass(module = "rocket._rocket", name = "EngineOptions", frozen)]
pub struct EngineOptions_ {
    pub options: EngineOptions,
}

fn bad(name: &str, value: &Bound<'_, PyAny>, message: &str) -> RocketError {
    let shown = value.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
    RocketError::invalid_arg(name, shown, message)
}

/// A str keyword parsed by the core's `FromStr` (whose error names `name`).
fn choice<T: FromStr<Err = RocketError>>(name: &str, value: &Bound<'_, PyAny>) -> Result<T, RocketError> {
    let s = value.cast::<PyString>().map_err(|_| bad(name, value, "expected a str"))?;
    s.to_str().map_err(|_| bad(name, value, "expected a str"))?.parse()
}

fn switch(name: &str, value: &Bound<'_, PyAny>) -> Result<bool, RocketError> {
    as_bool(value).ok_or_else(|| bad(name, value, "expected True or False"))
}

/// True or False, or numpy's bool scalar (what comparisons of arrays give); never an int.
pub(crate) fn as_bool(value: &Bound<'_, PyAny>) -> Option<bool> {
    if let Ok(b) = value.cast::<PyBool>() {
        return Some(b.is_true());
    }
    let ty = value.get_type();
    let numpy_bool = ty.module().is_ok_and(|m| m.to_str().is_ok_and(|m| m == "numpy"))
        && ty.name().is_ok_and(|n| n.to_str().is_ok_and(|n| n == "bool" || n == "bool_"));
    if numpy_bool { value.is_truthy().ok() } else { None }
}

/// A whole number as text for the core's parsers: an int or what `operator.index`
/// takes (numpy's integers), but not a bool.
fn whole(name: &str, value: &Bound<'_, PyAny>) -> Result<String, RocketError> {
    let not_int = || bad(name, value, "expected an int");
    if value.is_instance_of::<PyBool>() {
        return Err(not_int());
    }
    let index = |v: &Bound<'_, PyAny>| -> PyResult<String> {
        let n = v.py().import("operator")?.call_method1("index", (v,))?;
        Ok(n.cast::<PyInt>()?.str()?.to_string())
    };
    index(value).map_err(|_| not_int())
}

#[pymethods]
impl EngineOptions_ {
    #[new]
    #[pyo3(signature = (*, device=None, max_seq_len=None, progress=None, decode=None, matmul=None, sampler=None, cuda_graphs=None, prompt_graphs=None, loop_sampling=None, pdl=None, fuse=None, tc_attention=None, wgmma_attention=None, watchdog_ms=None, trace_step=None, prefix_cache_bytes=None, prefix_block=None, env=Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        device: Option<Bound<'_, PyAny>>,
        max_seq_len: Option<Bound<'_, PyAny>>,
        progress: Option<Bound<'_, PyAny>>,
        decode: Option<Bound<'_, PyAny>>,
        matmul: Option<Bound<'_, PyAny>>,
        sampler: Option<Bound<'_, PyAny>>,
        cuda_graphs: Option<Bound<'_, PyAny>>,
        prompt_graphs: Option<Bound<'_, PyAny>>,
        loop_sampling: Option<Bound<'_, PyAny>>,
        pdl: Option<Bound<'_, PyAny>>,
        fuse: Option<Bound<'_, PyAny>>,
        tc_attention: Option<Bound<'_, PyAny>>,
        wgmma_attention: Option<Bound<'_, PyAny>>,
        watchdog_ms: Option<Bound<'_, PyAny>>,
        trace_step: Option<Bound<'_, PyAny>>,
        prefix_cache_bytes: Option<Bound<'_, PyAny>>,
        prefix_block: Option<Bound<'_, PyAny>>,
        env: Vec<(String, String)>,
    ) -> PyResult<Self> {
        let build = || -> Result<EngineOptions, RocketError> {
            let mut o = EngineOptions::default();
            // A keyword given wins even over a bad variable of the same option.
            let given = [
                ("decode", decode.is_some()),
                ("matmul", matmul.is_some()),
                ("sampler", sampler.is_some()),
                ("cuda_graphs", cuda_graphs.is_some()),
                ("prompt_graphs", prompt_graphs.is_some()),
                ("loop_sampling", loop_sampling.is_some()),
                ("pdl", pdl.is_some()),
                ("fuse", fuse.is_some()),
                ("tc_attention", tc_attention.is_some()),
                ("wgmma_attention", wgmma_attention.is_some()),
                ("watchdog_ms", watchdog_ms.is_some()),
                ("trace_step", trace_step.is_some()),
                ("progress", progress.is_some()),
                ("prefix_cache_bytes", prefix_cache_bytes.is_some()),
                ("prefix_block", prefix_block.is_some()),
            ];
            let explicit: Vec<&str> = given.into_iter().filter_map(|(name, set)| set.then_some(name)).collect();
            o.apply_env_except(env, &explicit)?;
            if let Some(v) = &device {
                o.device = choice("device", v)?;
            }
            if let Some(v) = &max_seq_len {
                let n: i64 = whole("max_seq_len", v)?.parse().map_err(|_| bad("max_seq_len", v, "out of range"))?;
                if n < 1 {
                    return Err(RocketError::invalid_arg("max_seq_len", n, "must be at least 1"));
                }
                o.max_seq_len = Some(n as usize);
            }
            if let Some(v) = &progress {
                o.progress = choice("progress", v)?;
            }
            if let Some(v) = &prefix_cache_bytes {
                o.prefix_cache_bytes = parse_bytes("prefix_cache_bytes", &whole("prefix_cache_bytes", v)?)?;
            }
            if let Some(v) = &prefix_block {
                o.prefix_block = parse_prefix_block("prefix_block", &whole("prefix_block", v)?)?;
            }
            let g = &mut o.gpu;
            if let Some(v) = &decode {
                g.decode = choice("decode", v)?;
            }
            if let Some(v) = &matmul {
                g.matmul = choice("matmul", v)?;
            }
            if let Some(v) = &sampler {
                g.sampler = choice("sampler", v)?;
            }
            for (name, value, field) in [
                ("cuda_graphs", &cuda_graphs, &mut g.cuda_graphs),
                ("prompt_graphs", &prompt_graphs, &mut g.prompt_graphs),
                ("loop_sampling", &loop_sampling, &mut g.loop_sampling),
                ("pdl", &pdl, &mut g.pdl),
                ("fuse", &fuse, &mut g.fuse),
                ("tc_attention", &tc_attention, &mut g.tc_attention),
                ("wgmma_attention", &wgmma_attention, &mut g.wgmma_attention),
            ] {
                if let Some(v) = value {
                    *field = switch(name, v)?;
                }
            }
            if let Some(v) = &watchdog_ms {
                g.watchdog = parse_watchdog_ms("watchdog_ms", &whole("watchdog_ms", v)?)?;
            }
            if let Some(v) = &trace_step {
                g.trace_step = Some(parse_trace_step("trace_step", &whole("trace_step", v)?)?);
            }
            Ok(o)
        };
        build().map(|options| EngineOptions_ { options }).map_err(|e| to_py_err(py, e))
    }

    fn __repr__(&self) -> String {
        format!("{:?}", self.options)
    }
}
