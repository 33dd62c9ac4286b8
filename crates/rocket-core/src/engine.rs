//! The engine: loads a model, picks a backend, and turns prompts into outputs.
//! Generation policy (limits, stopping, detokenisation) lives here, above the
//! backends, so every backend inherits it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, Chunk, Device, Logits, SharedRows};
use crate::batch::{BatchEvent, BatchModel, Batcher, KvPrefixCache, PREFIX_BLOCK};
use crate::error::{Result, RocketError};
use crate::model::{Format, GenerationConfig, ModelSource, ModelSpec, ModelWeights};
use crate::options::{Devices, GpuOptions, Progress};
use crate::output::{RequestOutput, StreamDelta};
use crate::prefix_cache::{PrefixCache, PrefixCacheStats};
use crate::progress::LoadProgress;
use crate::request::EngineRequest;
use crate::sampling::SamplingParams;
use crate::weights::DType;
use crate::sampling_options::{RequestKind, SamplingOptions, DEFAULT_COMPLETION_MAX_TOKENS};
use crate::text::{ChatMessage, ChatTemplate, Tokenizer};

/// Most requests `generate_many` runs in one pass.
pub const MAX_BATCH: usize = 64;

#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub device: Device,
    /// Context limit (prompt + generated tokens); defaults to the model's
    /// trained maximum. The KV cache is sized per request, not to this.
    pub max_seq_len: Option<usize>,
    /// Whether loads draw a progress bar on stderr (only on a terminal). Default `Auto`.
    pub progress: Progress,
    /// What the CUDA backend does (ignored on the CPU). Default `GpuOptions::default()`.
    pub gpu: GpuOptions,
    /// Memory (bytes; device memory on a GPU) the prefix cache may hold: KV of
    /// earlier prompts, reused by later prompts that start with the same whole
    /// blocks of tokens (least recently used dropped first). 0 disables reuse.
    /// Default [`DEFAULT_PREFIX_CACHE_BYTES`] (1 GiB).
    pub prefix_cache_bytes: usize,
    /// The prefix cache's block in tokens: prompts are cached and reused in
    /// whole blocks from their start, leaving a request at least the backend's
    /// `pass_shared_rows().later` tokens to compute, so outputs are the same bit
    /// for bit with or without reuse (`batch::chunk_end`). Prefill passes do not
    /// depend on it: a smaller block reuses more of a prompt that diverges
    /// mid-block or that grows by a chat turn, at the cost of more, smaller cache
    /// entries' lookups. Default [`PREFIX_BLOCK`] (128).
    pub prefix_block: usize,
}

/// The prefix cache's default budget: 1 GiB, e.g. 32K tokens of Llama-3.2-1B's
/// bf16 KV on the GPU, or 23K tokens of SmolLM2-135M's f32 KV on the CPU.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 1 << 30;

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            device: Device::Auto,
            max_seq_len: None,
            progress: Progress::Auto,
            gpu: GpuOptions::default(),
            prefix_cache_bytes: DEFAULT_PREFIX_CACHE_BYTES,
            prefix_block: PREFIX_BLOCK,
        }
    }
}

/// Information about the loaded model, for `inspect` and callers.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub path: PathBuf,
    pub format: Format,
    pub spec: ModelSpec,
    pub dtype_groups: Vec<(&'static str, String)>,
    pub bytes_per_decode_step: usize,
    pub tokenizer_size: usize,
    pub has_chat_template: bool,
    pub eos_token_ids: Vec<u32>,
    pub load_seconds: f64,
    pub max_seq_len: usize,
    pub backend: &'static str,
}

pub struct Engine {
    backend: Box<dyn Backend>,
    tokenizer: Arc<Tokenizer>,
    chat: Option<ChatTemplate>,
    generation: GenerationConfig,
    info: ModelInfo,
    prefix_block: usize,
    /// None when `prefix_cache_bytes` is 0.
    prefix_cache: Option<Mutex<KvPrefixCache>>,
}

/// The backend `device` asks for. `Auto` takes CUDA when this build has it and a
/// usable GPU is present, else the CPU; `Cuda` fails with the reason instead.
fn select_backend(device: Device, gpu: &GpuOptions, spec: &ModelSpec, weights: Arc<ModelWeights>, progress: &LoadProgress) -> Result<Box<dyn Backend>> {
    #[cfg(feature = "cuda")]
    if device != Device::Cpu {
        match crate::backend::cuda::CudaBackend::with_options(spec.clone(), &weights, progress, gpu.clone()) {
            Ok(b) => return Ok(Box::new(b)),
            Err(e) if device == Device::Cuda => return Err(e),
            Err(e) => tracing::info!("CUDA not used ({e}); running on the CPU"),
        }
    }
    #[cfg(not(feature = "cuda"))]
    if device == Device::Cuda {
        let _ = (gpu, progress);
        return Err(RocketError::Device("this build of rocket has no CUDA backend; use device=\"cpu\" or \"auto\"".into()));
    }
    Ok(Box::new(CpuBackend::new(spec.clone(), weights)))
}

/// What quantized GGUF tensors become: f32 where the CPU reference will compute
/// (exact), bf16 where a GPU will take them (half the host memory; its kernels
/// read bf16). `auto` asks the driver, so a machine with no GPU computes on the
/// exact weights.
fn quantized_dtype(device: Device, several_gpus: bool) -> DType {
    let gpu = match device {
        Device::Cpu => false,
        Device::Cuda => cfg!(feature = "cuda"),
        Device::Auto => several_gpus || cuda_device_count().is_ok_and(|n| n > 0),
    };
    if gpu {
        DType::BF16
    } else {
        DType::F32
    }
}

/// How many CUDA devices this process sees.
pub(crate) fn cuda_device_count() -> Result<usize> {
    #[cfg(feature = "cuda")]
    return crate::backend::cuda::device_count();
    #[cfg(not(feature = "cuda"))]
    Err(RocketError::Device("this build of rocket has no CUDA backend; a list of devices needs one".into()))
}

/// A list of GPUs with `device` "cpu" is a contradiction, refused before anything loads.
pub fn check_devices_device(device: Device, devices: &Devices) -> Result<()> {
    if device == Device::Cpu {
        let shown = match devices {
            Devices::All => "all".to_string(),
            Devices::List(l) => l.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(","),
        };
        return Err(RocketError::invalid_arg("devices", shown, "a list of GPUs needs device \"cuda\" or \"auto\", not \"cpu\""));
    }
    Ok(())
}

impl Engine {
    pub fn load(path: impl AsRef<Path>, options: EngineOptions) -> Result<Self> {
        let mut engines = Self::load_on(path.as_ref(), options, None)?;
        Ok(engines.pop().expect("one engine per backend"))
    }

    /// One engine per GPU of `devices` (`rocket serve --devices`), each with
    /// its own backend (weights on its device, KV cache, megakernel); the file
    /// is opened and read once (memory-mapped), and the weights are uploaded
    /// to the GPUs in parallel, one thread each. Engines come in the order of
    /// `devices`; `options.device` must not be `Cpu`, and `gpu.device_ordinal`
    /// is set per engine. Any device failing to load fails the whole load.
    pub fn load_devices(path: impl AsRef<Path>, options: EngineOptions, devices: &Devices) -> Result<Vec<Self>> {
        check_devices_device(options.device, devices)?;
        let ordinals = devices.ordinals(cuda_device_count()?)?;
        Self::load_on(path.as_ref(), options, Some(&ordinals))
    }

    /// `ordinals`: None for one engine on `options.device`; else a CUDA engine per ordinal.
    fn load_on(path: &Path, options: EngineOptions, ordinals: Option<&[usize]>) -> Result<Vec<Self>> {
        let start = Instant::now();
        let progress = LoadProgress::new(options.progress);
        let quantized_as = quantized_dtype(options.device, ordinals.is_some());
        if options.prefix_block == 0 {
            return Err(RocketError::invalid_arg("prefix_block", 0, "must be at least 1 token"));
        }
        let source = ModelSource::open_with_progress(path, quantized_as, &progress)?;
        let spec = source.spec.clone();
        let max_seq_len = match options.max_seq_len {
            None => spec.max_position_embeddings,
            Some(0) => return Err(RocketError::invalid_arg("max_seq_len", 0, "must be at least 1")),
            Some(n) if n > spec.max_position_embeddings => {
                return Err(RocketError::invalid_arg(
                    "max_seq_len",
                    n,
                    format!("must be at most the model's max_position_embeddings ({})", spec.max_position_embeddings),
                ))
            }
            Some(n) => n,
        };
        let weights = Arc::new(ModelWeights::from_weights(&spec, source.weights)?);
        let dtype_groups = weights.dtype_groups();
        let bytes_per_decode_step = weights.bytes_per_decode_step();
        let backends = match ordinals {
            None => vec![select_backend(options.device, &options.gpu, &spec, weights, &progress)?],
            Some(ordinals) => {
                // One upload thread per GPU; only the first draws the progress bar.
                let quiet = LoadProgress::new(Progress::Off);
                std::thread::scope(|scope| {
                    let loads: Vec<_> = ordinals
                        .iter()
                        .enumerate()
                        .map(|(i, &ordinal)| {
                            let gpu = GpuOptions { device_ordinal: ordinal, ..options.gpu.clone() };
                            let (spec, weights, progress) = (&spec, weights.clone(), if i == 0 { &progress } else { &quiet });
                            scope.spawn(move || select_backend(Device::Cuda, &gpu, spec, weights, progress))
                        })
                        .collect();
                    loads
                        .into_iter()
                        .zip(ordinals)
                        .map(|(load, ordinal)| match load.join() {
                            Ok(Ok(backend)) => Ok(backend),
                            Ok(Err(e)) => Err(RocketError::Device(format!("loading on cuda:{ordinal}: {e}"))),
                            Err(_) => Err(RocketError::Internal(format!("loading on cuda:{ordinal} panicked"))),
                        })
                        .collect::<Result<Vec<_>>>()
                })?
            }
        };
        let chat_template = || {
            source
                .chat_template
                .as_deref()
                .map(|t| ChatTemplate::new(t, &source.special.bos_token, &source.special.eos_token))
                .transpose()
        };
        let tokenizer = Arc::new(source.tokenizer);
        let load_seconds = start.elapsed().as_secs_f64();
        backends
            .into_iter()
            .map(|backend| {
                let chat = chat_template()?;
                let info = ModelInfo {
                    path: source.path.clone(),
                    format: source.format,
                    spec: spec.clone(),
                    dtype_groups: dtype_groups.clone(),
                    bytes_per_decode_step,
                    tokenizer_size: tokenizer.vocab_size(),
                    has_chat_template: chat.is_some(),
                    eos_token_ids: source.generation.eos_token_ids.clone(),
                    load_seconds,
                    max_seq_len,
                    backend: backend.name(),
                };
                // Each engine keeps its own prefix cache: cached KV lives on its device.
                let prefix_cache = (options.prefix_cache_bytes > 0).then(|| Mutex::new(PrefixCache::new(options.prefix_cache_bytes, options.prefix_block)));
                Ok(Engine {
                    backend,
                    tokenizer: tokenizer.clone(),
                    chat,
                    generation: source.generation.clone(),
                    info,
                    prefix_block: options.prefix_block,
                    prefix_cache,
                })
            })
            .collect()
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.info.spec
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    pub fn generation_config(&self) -> &GenerationConfig {
        &self.generation
    }

    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let chat = self
            .chat
            .as_ref()
            .ok_or_else(|| RocketError::ChatTemplate("this model has no chat template".into()))?;
        chat.render(messages, add_generation_prompt)
    }

    /// Tokenise a prompt the way generation does (with the tokenizer's special-token rules).
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>> {
        if prompt.is_empty() {
            return Err(RocketError::EmptyPrompt);
        }
        let ids = self.tokenizer.encode(prompt, true)?;
        if ids.is_empty() {
            return Err(RocketError::EmptyPrompt);
        }
        Ok(ids)
    }

    /// `max_tokens` for a request of `kind` with `prompt_tokens` that sets none:
    /// [`DEFAULT_COMPLETION_MAX_TOKENS`] for a completion, the room the context
    /// has left (at least 1) for a chat turn.
    pub fn default_max_tokens(&self, kind: RequestKind, prompt_tokens: usize) -> usize {
        match kind {
            RequestKind::Completion => DEFAULT_COMPLETION_MAX_TOKENS,
            RequestKind::Chat => self.info.max_seq_len.saturating_sub(prompt_tokens).max(1),
        }
    }

    /// The one place a request's sampling is settled: unset fields from the
    /// model's generation_config and the `max_tokens` default of `kind` (see
    /// [`crate::sampling_options`]), then every check, each error naming the
    /// field: ranges, `stop_token_ids` within the vocabulary, and prompt +
    /// max_tokens within the context (`ContextOverflow`).
    pub fn resolve(&self, options: &SamplingOptions, kind: RequestKind, prompt_tokens: usize) -> Result<SamplingParams> {
        let params = options.fill(&self.generation, self.default_max_tokens(kind, prompt_tokens));
        params.validate()?;
        let vocab = self.info.spec.vocab_size;
        if let Some(&id) = params.stop_token_ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(RocketError::invalid_arg("stop_token_ids", id, format!("token ids must be below the vocabulary size ({vocab})")));
        }
        self.batch_model().check_fits(prompt_tokens, params.max_tokens)?;
        Ok(params)
    }

    /// Continue `prompt` (a completion: unset `max_tokens` means 16; sampling
    /// defaults from the model's generation_config). Takes `&SamplingOptions`,
    /// or a `&SamplingParams` with every field set.
    pub fn generate(&self, prompt: &str, options: impl Into<SamplingOptions>) -> Result<RequestOutput> {
        let ids = self.encode_prompt(prompt)?;
        let params = self.resolve(&options.into(), RequestKind::Completion, ids.len())?;
        self.generate_ids(prompt.to_string(), ids, &params, &mut |_| true)
    }

    /// Requests run as one continuous batch; outputs in input order, each
    /// identical to what the request gives alone. Every request is checked
    /// before any runs.
    pub fn generate_many(&self, requests: Vec<EngineRequest>) -> Result<Vec<RequestOutput>> {
        let n = requests.len();
        let results: Vec<std::cell::RefCell<Option<Result<RequestOutput>>>> = (0..n).map(|_| Default::default()).collect();
        for r in &requests {
            self.check_request(r)?;
        }
        let mut batcher = Batcher::new(self, MAX_BATCH);
        for (request, slot) in requests.into_iter().zip(&results) {
            batcher.add(request, Box::new(move |event| {
                match event {
                    BatchEvent::Delta(_) => {}
                    BatchEvent::Finished(out) => *slot.borrow_mut() = Some(Ok(out)),
                    BatchEvent::Failed(e) => *slot.borrow_mut() = Some(Err(e)),
                }
                true
            }))?;
        }
        batcher.run_to_completion()?;
        drop(batcher);
        results
            .into_iter()
            .map(|r| r.into_inner().unwrap_or_else(|| Err(RocketError::Internal("a batched request never finished".into()))))
            .collect()
    }

    /// Whether `request` can run here (params, prompt ids, context fit);
    /// the batcher and the scheduler check the same before queueing it.
    pub fn check_request(&self, request: &EngineRequest) -> Result<()> {
        self.batch_model().check(request)
    }

    /// What the batcher needs of this engine.
    pub fn batch_model(&self) -> BatchModel<'_> {
        BatchModel {
            backend: self.backend.as_ref(),
            tokenizer: &self.tokenizer,
            eos_ids: &self.info.eos_token_ids,
            vocab_size: self.info.spec.vocab_size,
            max_seq_len: self.info.max_seq_len,
            prefix_cache: self.prefix_cache.as_ref(),
            row_cost: crate::batch::RowCost { matmul_macs: self.info.spec.layer_matmul_macs(), pair_macs: 2 * (self.info.spec.q_dim() * self.info.spec.num_layers) as u64 },
        }
    }

    /// What the prefix cache has done and holds (all zero when it is disabled).
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.prefix_cache.as_ref().map(|c| c.lock().unwrap_or_else(|p| p.into_inner()).stats()).unwrap_or_default()
    }

    /// The prefix cache's byte budget (0: disabled) and block in tokens.
    pub fn prefix_cache_limits(&self) -> (usize, usize) {
        (self.prefix_cache.as_ref().map_or(0, |c| c.lock().unwrap_or_else(|p| p.into_inner()).max_bytes()), self.prefix_block)
    }

    /// The shortest prompt that is cached or reuses a cached prefix (`first`) and the
    /// fewest prompt tokens a request computes itself when it reuses one (`later`): prompt
    /// passes of that many rows or more give each row the same bits (the backend's
    /// `pass_shared_rows`; 512 and 128 on the GPU, 1 and 1 on the CPU).
    pub fn prefix_reuse_rows(&self) -> SharedRows {
        self.backend.pass_shared_rows()
    }

    /// Drops every cached prefix (the memory returns to the backend).
    pub fn clear_prefix_cache(&self) {
        if let Some(c) = &self.prefix_cache {
            let mut c = c.lock().unwrap_or_else(|p| p.into_inner());
            while c.evict_one() {}
        }
    }

    /// Generate from token ids with resolved params (see [`Engine::resolve`]). `on_delta` receives every generated token with the
    /// text it completes; the deltas' text concatenates to the output's `text`.
    /// Text that could still turn into a stop string, or an incomplete UTF-8
    /// sequence, is held back until it is settled. Returning false from
    /// `on_delta` cancels the request (finish_reason `Cancelled`).
    pub fn generate_ids(
        &self,
        prompt: String,
        prompt_ids: Vec<u32>,
        params: &SamplingParams,
        on_delta: &mut dyn FnMut(&StreamDelta) -> bool,
    ) -> Result<RequestOutput> {
        let mut result = None;
        let mut batcher = Batcher::new(self, 1);
        batcher.add(EngineRequest { prompt, prompt_ids, params: params.clone() }, Box::new(|event| match event {
            BatchEvent::Delta(d) => on_delta(&d),
            BatchEvent::Finished(out) => {
                result = Some(Ok(out));
                true
            }
            BatchEvent::Failed(e) => {
                result = Some(Err(e));
                true
            }
        }))?;
        batcher.run_to_completion()?;
        drop(batcher);
        result.unwrap_or_else(|| Err(RocketError::Internal("the request never finished".into())))
    }

    /// Logits at every position of `ids` in one pass ([len][vocab], row-major).
    pub fn teacher_forced_logits(&self, ids: &[u32]) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(RocketError::EmptyPrompt);
        }
        self.batch_model().check_fits(ids.len(), 0)?;
        let mut session = self.backend.new_session(ids.len())?;
        self.backend.forward(&mut [Chunk { session: session.as_mut(), tokens: ids }], Logits::All)
    }

    /// What the engine runs on, in words.
    pub fn device_description(&self) -> String {
        self.backend.device_description()
    }

    /// How a decode step of `batch` sequences sampled with `params` runs
    /// ("megakernel", "cuda-graph", "forward passes"), for benchmarks.
    pub fn decode_path(&self, batch: usize, params: &SamplingParams) -> &'static str {
        self.backend.decode_path(batch, params)
    }

    /// The backend's event counts since load (megakernel launches, watchdog
    /// events); lock-free, so monitoring may read them during a pass.
    pub fn backend_counters(&self) -> crate::backend::BackendCounters {
        self.backend.counters()
    }

    /// The device's measured copy bandwidth in GB/s (None on the CPU backend).
    pub fn copy_bandwidth_gbs(&self) -> Result<Option<f64>> {
        self.backend.copy_bandwidth_gbs()
    }

    /// Breaks this engine's device for good, as a lost GPU would (feature
    /// `diagnostics`; `Backend::inject_device_fault`): its next pass fails with
    /// a device error, and so does every one after it. Returns the device's error.
    #[cfg(feature = "diagnostics")]
    pub fn inject_device_fault(&self) -> Result<String> {
        self.backend.inject_device_fault()
    }

    /// Wraps the backend (tests put a backend with a device loop around the CPU one).
    #[cfg(test)]
    pub(crate) fn wrap_backend(mut self, wrap: impl FnOnce(Box<dyn Backend>) -> Box<dyn Backend>) -> Self {
        self.backend = wrap(self.backend);
        self
    }

    /// Replaces the model's generation_config (tests of the defaults).
    #[cfg(test)]
    pub(crate) fn with_generation_config(mut self, generation: GenerationConfig) -> Self {
        self.generation = generation;
        self
    }
}

impl<'a> From<&'a Engine> for BatchModel<'a> {
    fn from(engine: &'a Engine) -> Self {
        engine.batch_model()
    }
}
