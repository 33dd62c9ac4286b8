//! The engine's settings as types: how the GPU backend decodes, multiplies and
//! samples ([`GpuOptions`]) and whether loads draw a progress bar ([`Progress`]).
//! They exist in every build (a CPU-only build ignores the GPU ones), each with
//! one default. Every choice parses from the string the CLI flag, the Python
//! keyword and the environment variable share (`FromStr`, errors list the
//! accepted values), so the front ends have one parser. The core never reads
//! the environment: front ends hand their variables to
//! [`EngineOptions::apply_env`](crate::EngineOptions::apply_env).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::error::{Result, RocketError};

/// "a", "b" or "c", for error messages.
fn quoted_list(names: &[&str]) -> String {
    let q: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    match q.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        _ => q.concat(),
    }
}

/// A closed set of named choices: `NAMES` in declaration order, `FromStr`
/// taking exactly those names (the error names `$param` and lists them).
macro_rules! choice {
    ($(#[$meta:meta])* $name:ident, $param:literal { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// The accepted names, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl FromStr for $name {
            type Err = RocketError;
            fn from_str(s: &str) -> Result<Self> {
                match s {
                    $($text => Ok($name::$variant),)+
                    other => Err(RocketError::invalid_arg($param, other, format!("expected {}", quoted_list(Self::NAMES)))),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

choice! {
    /// How batch-1 decode runs on the GPU (`decode`).
    DecodePath, "decode" {
        /// The megakernel where the model's shapes have one (it measured faster
        /// than the CUDA-graph path on every fuel), else the graph path; also
        /// the graph path where the megakernel cannot load on this GPU.
        Auto = "auto",
        /// A kernel per op, replayed from CUDA graphs.
        Graph = "graph",
        /// The persistent megakernel where the model's shapes have one; loading
        /// fails for other shapes.
        Megakernel = "megakernel",
    }
}

choice! {
    /// Which kernel multiplies a pass's rows by the weights (`matmul`).
    MatmulPath, "matmul" {
        /// The tensor cores for passes of at least `TENSOR_CORE_MIN_ROWS` rows
        /// (prefill, large batches), the GEMV below; where cuBLASLt loads, prompt
        /// passes of `CUBLAS_F16_PROMPT_MIN_ROWS` (33) rows or more on its fp16
        /// products (as `cublas` runs them), and passes of `CUBLAS_MIN_ROWS`
        /// (128) rows or more on its products of the bf16 hi+lo split from
        /// `CUBLAS_AUTO_MIN_MACS` multiply-adds; decode passes below `CUBLAS_MIN_ROWS` rows stay on the tensor cores. A row's logits then depend (≈1e-3 relative) on how many
        /// rows share its pass; `gemv` or `tensor` make them batch-independent
        /// bit for bit (for `tensor`, in passes of up to 256 rows: longer ones
        /// do not split K).
        Auto = "auto",
        /// The GEMV (kernels/src/gemv.cu) for every pass.
        Gemv = "gemv",
        /// The tensor-core GEMM (kernels/src/gemm_tc.cu) for every pass.
        Tensor = "tensor",
        /// NVIDIA's cuBLASLt (loaded at run time) for passes of at least
        /// `CUBLAS_MIN_ROWS` (128) rows: prefill. Its products take fp16
        /// operands (an fp16 copy of the layers' matrices, made at the first
        /// pass that needs it), or,
        /// once a pass's activations leave fp16's range, the activations' bf16
        /// hi and lo parts (backend/cuda/cublas.rs). Shorter passes multiply as
        /// `auto` does. Loading fails where cuBLASLt is not found.
        Cublas = "cublas",
    }
}

choice! {
    /// Where the GPU backend picks sampled tokens (`sampler`).
    SamplerPlacement, "sampler" {
        /// On the GPU (kernels/src/sample.cu), the host sampler's choice bit for bit.
        Device = "device",
        /// Each logits row is copied back and sampled on the CPU.
        Host = "host",
    }
}

choice! {
    /// Whether a model load draws a progress bar on stderr (`progress`); never
    /// when stderr is not a terminal. `ROCKET_PROGRESS` also takes "0" for `off`
    /// (`apply_env`); the keyword and the flag take the names only.
    Progress, "progress" {
        /// Once a load has taken over a second.
        Auto = "auto",
        /// Never.
        Off = "off",
        /// From the start of the load.
        Always = "always",
    }
}

/// An on/off setting's accepted spellings (`parse_switch`).
pub const SWITCH_NAMES: &[&str] = &["on", "off", "1", "0", "true", "false"];

/// An on/off setting named `param`: "on", "1" or "true"; "off", "0" or "false".
pub fn parse_switch(param: &str, value: &str) -> Result<bool> {
    match value {
        "on" | "1" | "true" => Ok(true),
        "off" | "0" | "false" => Ok(false),
        other => Err(RocketError::invalid_arg(param, other, format!("expected {}", quoted_list(SWITCH_NAMES)))),
    }
}

/// The longest megakernel watchdog (an hour): longer waits are a hang, not a slow step.
pub const MAX_WATCHDOG: Duration = Duration::from_secs(3600);

/// A watchdog limit in whole milliseconds (1 ms up to `MAX_WATCHDOG`), named `param`.
pub fn parse_watchdog_ms(param: &str, value: &str) -> Result<Duration> {
    let max = MAX_WATCHDOG.as_millis();
    match value.parse::<u64>() {
        Ok(ms) if (1..=max as u64).contains(&ms) => Ok(Duration::from_millis(ms)),
        _ => Err(RocketError::invalid_arg(param, value, format!("expected whole milliseconds from 1 to {max}"))),
    }
}

/// A megakernel step number to trace, named `param`.
pub fn parse_trace_step(param: &str, value: &str) -> Result<usize> {
    value.parse::<usize>().map_err(|_| RocketError::invalid_arg(param, value, "expected a step number (0, 1, ...)"))
}

/// A size in bytes named `param`: a whole number, optionally with a binary
/// suffix K, M or G (also KiB, MiB, GiB): "0", "1073741824", "512M", "1GiB".
pub fn parse_bytes(param: &str, value: &str) -> Result<usize> {
    let bad = || RocketError::invalid_arg(param, value, "expected a whole number of bytes, optionally with K, M or G (e.g. 512M, 2G; 0 disables)");
    let v = value.trim();
    let digits = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (number, suffix) = v.split_at(digits);
    let unit: u64 = match suffix.trim() {
        "" => 1,
        "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        _ => return Err(bad()),
    };
    let n: u64 = number.parse().map_err(|_| bad())?;
    n.checked_mul(unit).and_then(|b| usize::try_from(b).ok()).ok_or_else(bad)
}

/// A prefix-cache block in tokens (at least 1), named `param`.
pub fn parse_prefix_block(param: &str, value: &str) -> Result<usize> {
    match value.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(RocketError::invalid_arg(param, value, "expected a whole number of tokens, at least 1")),
    }
}

/// What the CUDA backend does (ignored by the CPU backend). Tests and benches
/// pick paths here; `Default` is what users get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuOptions {
    /// How batch-1 decode runs. Default `Auto`.
    pub decode: DecodePath,
    /// Which kernel multiplies by the weights. Default `Auto`.
    pub matmul: MatmulPath,
    /// Replay decode steps from CUDA graphs (off: launch kernel by kernel, for
    /// profilers that time kernels one by one). Default on.
    pub cuda_graphs: bool,
    /// Prompt passes of up to 512 rows (prompt chunks alone, last-row logits or
    /// none, with `tc_attention`) run padded to a row bucket (2, 4, 8, 16, then
    /// multiples of 32) and, with `cuda_graphs`, replay a CUDA graph per pass
    /// shape (the bucket, the prompts in the pass, what it picks) instead of
    /// launching their kernels one by one; a shape records its graph at its
    /// second pass. The pad rows are a sequence of their own, so the prompt's
    /// rows get the bits of an unpadded pass of the bucket's length. Default on.
    pub prompt_graphs: bool,
    /// Where sampled tokens are picked. Default `Device`.
    pub sampler: SamplerPlacement,
    /// Top-k requests with k above 64 also run as megakernel token loops (one
    /// CTA samples while the other SMs wait: megakernel.cu `sample_token`);
    /// off, they decode with CUDA graphs. Every other request (greedy,
    /// temperature, top-k up to 64, top-p, min-p, penalties) is sampled by all
    /// SMs in the megakernel whatever this says (kernels/src/mk_race.cuh,
    /// `SamplingParams::races_on_all_sms`). Default off.
    pub loop_sampling: bool,
    /// Launch the forward pass's kernels as programmatic dependent launches, so
    /// each starts before the previous one ends (kernels.rs `Kernels::pdl`).
    /// Default on; off is for comparison.
    pub pdl: bool,
    /// Run RMSNorm and SiLU·mul inside the tensor-core GEMM (gemm_tc.cu's fused
    /// prologue and epilogue) instead of as their own kernels, and let the norm,
    /// SiLU·mul and the prompt attention write cuBLASLt's fp16 operands themselves
    /// instead of a separate rounding (the same bits). Default on; off is for
    /// comparison.
    pub fuse: bool,
    /// Prompt rows' attention on the tensor cores (attention_prefill.cu: 64 rows
    /// of a sequence share each staged key and value) instead of the split kernel
    /// that decode uses (every row streams its whole context). Default on; off is
    /// for comparison.
    pub tc_attention: bool,
    /// On Hopper (the sm_90a cubin) at head_dim 64 and 128, the prompt attention
    /// runs on warpgroup MMAs (attention_prefill_wg.cu); off, on the mma.sync
    /// kernel every other GPU runs (attention_prefill.cu). Both give the same
    /// figures; the wgmma one is faster on long prompts. Default on.
    pub wgmma_attention: bool,
    /// How long a megakernel wait on one dependency may last before the launch
    /// ends with an error (raise it under compute-sanitizer). Default 2 s.
    pub watchdog: Duration,
    /// A diagnostic: every megakernel decode launch of more than N steps stamps
    /// its step N and logs where the time went (at level info), the table
    /// `megakernel::Profile` prints. Default `None` (no tracing).
    pub trace_step: Option<usize>,
    /// Which CUDA device the engine runs on (0 is the first visible GPU).
    /// Default 0; `Engine::load_devices` sets it per engine from a [`Devices`].
    pub device_ordinal: usize,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            decode: DecodePath::Auto,
            matmul: MatmulPath::Auto,
            cuda_graphs: true,
            prompt_graphs: true,
            sampler: SamplerPlacement::Device,
            loop_sampling: false,
            pdl: true,
            fuse: true,
            tc_attention: true,
            wgmma_attention: true,
            watchdog: Duration::from_millis(2000),
            trace_step: None,
            device_ordinal: 0,
        }
    }
}

/// The GPUs a multi-engine load runs on, one engine each (`rocket serve
/// --devices`, Python `devices=`): `All` is every CUDA device this process
/// sees, `List` the given ordinals. Parses from `"all"` or `"0,1,..."`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Devices {
    All,
    List(Vec<usize>),
}

impl std::str::FromStr for Devices {
    type Err = RocketError;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if s == "all" {
            return Ok(Devices::All);
        }
        let mut ordinals = Vec::new();
        for part in s.split(',') {
            let n = part.trim().parse::<usize>().map_err(|_| {
                RocketError::invalid_arg("devices", s, "expected \"all\" or GPU ordinals separated by commas, like \"0,1\"")
            })?;
            if ordinals.contains(&n) {
                return Err(RocketError::invalid_arg("devices", s, format!("GPU {n} is listed twice")));
            }
            ordinals.push(n);
        }
        Ok(Devices::List(ordinals))
    }
}

impl Devices {
    /// The ordinals, given how many CUDA devices exist (`count`): `All` is
    /// `0..count`; a listed ordinal must be below `count`.
    pub fn ordinals(&self, count: usize) -> Result<Vec<usize>> {
        let list = match self {
            Devices::All => (0..count).collect::<Vec<_>>(),
            Devices::List(l) => l.clone(),
        };
        if list.is_empty() {
            return Err(RocketError::Device("no CUDA device found".into()));
        }
        if let Some(bad) = list.iter().find(|&&n| n >= count) {
            return Err(RocketError::invalid_arg("devices", bad, format!("this machine has {count} CUDA device(s)")));
        }
        Ok(list)
    }
}

/// The environment variables front ends may pass to `EngineOptions::apply_env`,
/// with the option each sets (README's settings table lists the same).
pub const ENV_SETTINGS: &[(&str, &str)] = &[
    ("ROCKET_DECODE", "decode"),
    ("ROCKET_MATMUL", "matmul"),
    ("ROCKET_CUDA_GRAPHS", "cuda_graphs"),
    ("ROCKET_PROMPT_GRAPHS", "prompt_graphs"),
    ("ROCKET_SAMPLER", "sampler"),
    ("ROCKET_LOOP_SAMPLING", "loop_sampling"),
    ("ROCKET_PDL", "pdl"),
    ("ROCKET_FUSE", "fuse"),
    ("ROCKET_TC_ATTENTION", "tc_attention"),
    ("ROCKET_WGMMA_ATTENTION", "wgmma_attention"),
    ("ROCKET_WATCHDOG_MS", "watchdog_ms"),
    ("ROCKET_MK_TRACE_STEP", "trace_step"),
    ("ROCKET_PROGRESS", "progress"),
    ("ROCKET_PREFIX_CACHE_BYTES", "prefix_cache_bytes"),
    ("ROCKET_PREFIX_BLOCK", "prefix_block"),
];

/// `value` parsed as `T`, an error naming `name` (the variable or flag that carried it).
fn named<T: FromStr<Err = RocketError>>(name: &str, value: &str) -> Result<T> {
    value.parse().map_err(|e| match e {
        RocketError::InvalidArgument { value, message, .. } => RocketError::InvalidArgument { parameter: name.to_string(), value, message },
        other => other,
    })
}

impl crate::EngineOptions {
    /// Sets what the variables of `ENV_SETTINGS` among `vars` ask for; other
    /// names are ignored and empty values leave a setting as it is. A bad value
    /// is an error naming its variable. Front ends pass their environment's
    /// (name, value) pairs here, then apply their explicit flags or keywords,
    /// which so win over the variables.
    /// `apply_env` without the variables of the options in `explicit` (their
    /// `ENV_SETTINGS` names, e.g. "decode"): a front end sets those from its flags
    /// or keywords, which win even over a variable whose value is bad.
    pub fn apply_env_except<K: AsRef<str>, V: AsRef<str>>(&mut self, vars: impl IntoIterator<Item = (K, V)>, explicit: &[&str]) -> Result<()> {
        let overridden = |name: &str| ENV_SETTINGS.iter().any(|(n, option)| *n == name && explicit.contains(option));
        self.apply_env(vars.into_iter().filter(|(name, _)| !overridden(name.as_ref())))
    }

    pub fn apply_env<K: AsRef<str>, V: AsRef<str>>(&mut self, vars: impl IntoIterator<Item = (K, V)>) -> Result<()> {
        for (name, value) in vars {
            let (name, v) = (name.as_ref(), value.as_ref());
            if v.is_empty() {
                continue;
            }
            let gpu = &mut self.gpu;
            match name {
                "ROCKET_DECODE" => gpu.decode = named(name, v)?,
                "ROCKET_MATMUL" => gpu.matmul = named(name, v)?,
                "ROCKET_CUDA_GRAPHS" => gpu.cuda_graphs = parse_switch(name, v)?,
                "ROCKET_PROMPT_GRAPHS" => gpu.prompt_graphs = parse_switch(name, v)?,
                "ROCKET_SAMPLER" => gpu.sampler = named(name, v)?,
                "ROCKET_LOOP_SAMPLING" => gpu.loop_sampling = parse_switch(name, v)?,
                "ROCKET_PDL" => gpu.pdl = parse_switch(name, v)?,
                "ROCKET_FUSE" => gpu.fuse = parse_switch(name, v)?,
                "ROCKET_TC_ATTENTION" => gpu.tc_attention = parse_switch(name, v)?,
                "ROCKET_WGMMA_ATTENTION" => gpu.wgmma_attention = parse_switch(name, v)?,
                "ROCKET_WATCHDOG_MS" => gpu.watchdog = parse_watchdog_ms(name, v)?,
                "ROCKET_MK_TRACE_STEP" => gpu.trace_step = Some(parse_trace_step(name, v)?),
                "ROCKET_PROGRESS" => self.progress = if v == "0" { Progress::Off } else { named(name, v)? },
                "ROCKET_PREFIX_CACHE_BYTES" => self.prefix_cache_bytes = parse_bytes(name, v)?,
                "ROCKET_PREFIX_BLOCK" => self.prefix_block = parse_prefix_block(name, v)?,
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineOptions;

    fn message(e: RocketError) -> String {
        e.to_string()
    }

    #[test]
    fn devices_parse_all_or_ordinals_and_check_them_against_the_count() {
        assert_eq!("all".parse::<Devices>().unwrap(), Devices::All);
        assert_eq!(" 1, 0 ".parse::<Devices>().unwrap(), Devices::List(vec![1, 0]));
        for bad in ["", "0,,1", "gpu0", "-1", "0,0"] {
            let e = message(bad.parse::<Devices>().unwrap_err());
            assert!(e.contains("devices"), "{bad:?}: {e}");
        }
        assert_eq!(Devices::All.ordinals(3).unwrap(), vec![0, 1, 2]);
        assert_eq!(Devices::List(vec![1]).ordinals(2).unwrap(), vec![1]);
        let e = message(Devices::List(vec![0, 2]).ordinals(2).unwrap_err());
        assert!(e.contains("devices") && e.contains('2'), "{e}");
        assert!(Devices::All.ordinals(0).is_err());
    }

    #[test]
    fn choices_parse_their_names_and_list_them_when_wrong() {
        for (i, name) in DecodePath::NAMES.iter().enumerate() {
            let d: DecodePath = name.parse().unwrap();
            assert_eq!(d.as_str(), *name);
            assert_eq!(DecodePath::NAMES[i], d.to_string());
        }
        assert_eq!("megakernel".parse::<DecodePath>().unwrap(), DecodePath::Megakernel);
        assert_eq!("graph".parse::<DecodePath>().unwrap(), DecodePath::Graph);
        assert_eq!("tensor".parse::<MatmulPath>().unwrap(), MatmulPath::Tensor);
        assert_eq!("gemv".parse::<MatmulPath>().unwrap(), MatmulPath::Gemv);
        assert_eq!("cublas".parse::<MatmulPath>().unwrap(), MatmulPath::Cublas);
        assert_eq!("host".parse::<SamplerPlacement>().unwrap(), SamplerPlacement::Host);
        assert_eq!("always".parse::<Progress>().unwrap(), Progress::Always);
        let e = message("bogus".parse::<DecodePath>().unwrap_err());
        assert_eq!(e, "invalid value for decode: bogus (expected \"auto\", \"graph\" or \"megakernel\")");
        let e = message("Graph".parse::<DecodePath>().unwrap_err());
        assert!(e.contains("decode"), "{e}");
        let e = message("".parse::<MatmulPath>().unwrap_err());
        assert_eq!(e, "invalid value for matmul:  (expected \"auto\", \"gemv\", \"tensor\" or \"cublas\")");
        let e = message("gpu".parse::<SamplerPlacement>().unwrap_err());
        assert_eq!(e, "invalid value for sampler: gpu (expected \"device\" or \"host\")");
        assert!(message("0".parse::<Progress>().unwrap_err()).contains("\"auto\", \"off\" or \"always\""));
    }

    #[test]
    fn switches_and_numbers_take_their_documented_forms() {
        for on in ["on", "1", "true"] {
            assert!(parse_switch("pdl", on).unwrap());
        }
        for off in ["off", "0", "false"] {
            assert!(!parse_switch("pdl", off).unwrap());
        }
        for bad in ["", "yes", "2", "ON"] {
            let e = message(parse_switch("pdl", bad).unwrap_err());
            assert!(e.starts_with("invalid value for pdl") && e.contains("\"on\", \"off\""), "{bad}: {e}");
        }
        assert_eq!(parse_watchdog_ms("watchdog_ms", "1").unwrap(), Duration::from_millis(1));
        assert_eq!(parse_watchdog_ms("watchdog_ms", "120000").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_watchdog_ms("watchdog_ms", "3600000").unwrap(), MAX_WATCHDOG);
        for bad in ["0", "-5", "2.5", "x", "", "3600001"] {
            let e = message(parse_watchdog_ms("watchdog_ms", bad).unwrap_err());
            assert!(e.contains("watchdog_ms") && e.contains("from 1 to 3600000"), "{bad}: {e}");
        }
        assert_eq!(parse_trace_step("trace_step", "100").unwrap(), 100);
        for (text, bytes) in [("0", 0), ("1073741824", 1 << 30), ("512M", 512 << 20), ("2G", 2 << 30), ("64KiB", 64 << 10), ("3 GiB", 3 << 30)] {
            assert_eq!(parse_bytes("prefix_cache_bytes", text).unwrap(), bytes, "{text}");
        }
        for bad in ["", "-1", "1.5G", "12T", "G", "1e9", "99999999999999999999"] {
            let e = message(parse_bytes("prefix_cache_bytes", bad).unwrap_err());
            assert!(e.contains("prefix_cache_bytes") && e.contains("K, M or G"), "{bad}: {e}");
        }
        assert_eq!(parse_prefix_block("prefix_block", "256").unwrap(), 256);
        for bad in ["0", "-4", "x", ""] {
            assert!(message(parse_prefix_block("prefix_block", bad).unwrap_err()).contains("at least 1"), "{bad}");
        }
        assert!(parse_trace_step("trace_step", "-1").is_err());
    }

    #[test]
    fn an_explicit_option_wins_over_a_bad_variable() {
        let mut o = EngineOptions::default();
        o.apply_env_except([("ROCKET_DECODE", "fast"), ("ROCKET_PDL", "off")], &["decode"]).unwrap();
        assert!(!o.gpu.pdl, "the other variables still apply");
        let e = EngineOptions::default().apply_env_except([("ROCKET_DECODE", "fast")], &["matmul"]).unwrap_err().to_string();
        assert!(e.contains("ROCKET_DECODE"), "{e}");
    }

    #[test]
    fn the_environment_sets_options_and_bad_values_name_the_variable() {
        let mut o = EngineOptions::default();
        assert_eq!(o.gpu, GpuOptions::default());
        o.apply_env([
            ("ROCKET_DECODE", "megakernel"),
            ("ROCKET_MATMUL", "gemv"),
            ("ROCKET_CUDA_GRAPHS", "0"),
            ("ROCKET_PROMPT_GRAPHS", "off"),
            ("ROCKET_SAMPLER", "host"),
            ("ROCKET_LOOP_SAMPLING", "1"),
            ("ROCKET_PDL", "0"),
            ("ROCKET_FUSE", "off"),
            ("ROCKET_TC_ATTENTION", "off"),
            ("ROCKET_WGMMA_ATTENTION", "off"),
            ("ROCKET_WATCHDOG_MS", "120000"),
            ("ROCKET_MK_TRACE_STEP", "100"),
            ("ROCKET_PROGRESS", "0"),
            ("ROCKET_PREFIX_CACHE_BYTES", "64M"),
            ("ROCKET_PREFIX_BLOCK", "256"),
            ("ROCKET_MK_HOLD", "not a setting any more: ignored"),
            ("PATH", "/bin"),
        ])
        .unwrap();
        let want = GpuOptions {
            decode: DecodePath::Megakernel,
            matmul: MatmulPath::Gemv,
            cuda_graphs: false,
            prompt_graphs: false,
            sampler: SamplerPlacement::Host,
            loop_sampling: true,
            pdl: false,
            fuse: false,
            tc_attention: false,
            wgmma_attention: false,
            watchdog: Duration::from_secs(120),
            trace_step: Some(100),
            device_ordinal: 0,
        };
        assert_eq!(o.gpu, want);
        assert_eq!(o.progress, Progress::Off);
        assert_eq!((o.prefix_cache_bytes, o.prefix_block), (64 << 20, 256));
        // Empty values leave settings as they are.
        o.apply_env([("ROCKET_DECODE", ""), ("ROCKET_PROGRESS", "")]).unwrap();
        assert_eq!((o.gpu.decode, o.progress), (DecodePath::Megakernel, Progress::Off));
        for (var, bad) in [
            ("ROCKET_DECODE", "bogus"),
            ("ROCKET_MATMUL", "blas"),
            ("ROCKET_CUDA_GRAPHS", "no"),
            ("ROCKET_PROMPT_GRAPHS", "sure"),
            ("ROCKET_SAMPLER", "gpu"),
            ("ROCKET_LOOP_SAMPLING", "2"),
            ("ROCKET_PDL", "x"),
            ("ROCKET_FUSE", "yes"),
            ("ROCKET_TC_ATTENTION", "maybe"),
            ("ROCKET_WGMMA_ATTENTION", "perhaps"),
            ("ROCKET_WATCHDOG_MS", "0"),
            ("ROCKET_MK_TRACE_STEP", "last"),
            ("ROCKET_PROGRESS", "sometimes"),
            ("ROCKET_PREFIX_CACHE_BYTES", "lots"),
            ("ROCKET_PREFIX_BLOCK", "0"),
        ] {
            let e = EngineOptions::default().apply_env([(var, bad)]).unwrap_err();
            match e {
                RocketError::InvalidArgument { ref parameter, ref value, .. } => {
                    assert_eq!((parameter.as_str(), value.as_str()), (var, bad), "{e}");
                }
                other => panic!("{var}={bad}: {other}"),
            }
        }
        // Every documented variable is handled (a bad value must fail, not be ignored).
        for (var, _) in ENV_SETTINGS {
            assert!(EngineOptions::default().apply_env([(*var, "?bad?")]).is_err(), "{var}");
        }
    }
}
