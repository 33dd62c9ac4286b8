//! The CUDA backend (feature `cuda`): rocket's own kernels (kernels/src), the
//! weights in one device arena, a bf16 KV cache per sequence sized to its
//! request, and decode steps replayed as CUDA graphs. Every pass covers all
//! sequences of a batch; with `forward_argmax` only token ids reach the host.
//!
//! The driver is loaded at run time (cudarc dynamic loading), so builds need no
//! CUDA install and machines without a GPU get a clear error, never a panic.

mod cublas;
#[cfg(feature = "diagnostics")]
mod diagnostics;
#[cfg(feature = "diagnostics")]
pub use diagnostics::{FusedF16, FusedF16Check, SampledLoop};
mod driver;
mod f16_weights;
mod gemm_f16;
#[cfg(feature = "diagnostics")]
mod handoff_probe;
#[cfg(feature = "diagnostics")]
pub use handoff_probe::{HandoffCost, HandoffMode};
mod kernels;
#[cfg(feature = "diagnostics")]
mod matmul_check;
#[cfg(feature = "diagnostics")]
pub use matmul_check::{MatmulCheck, MatmulFusion, MatmulKernel};
pub mod megakernel;
mod poll_pacer;
#[cfg(feature = "diagnostics")]
mod probe;
mod prompt_graphs;
#[cfg(feature = "diagnostics")]
mod row_bits;
#[cfg(feature = "diagnostics")]
pub use row_bits::{RowBits, RowBitsKernel};
#[cfg(feature = "diagnostics")]
pub use probe::{FenceCost, L2Latency, StreamRate};
mod sampler;
mod split_k;
mod weights;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::{check_chunks, check_copy, own_session, Backend, BackendCounters, Chunk, Logits, LoopOutcome, LoopRequest, SampleRequest, Session};
use crate::batch::{LATER_PASS_SHARED_ROWS, PASS_SHARED_ROWS};
use crate::error::{Result, RocketError};
use crate::megakernel::{MegakernelError, Profile};
use crate::model::{ModelSpec, ModelWeights};
use crate::output::TokenLogprob;
use crate::options::{DecodePath, GpuOptions, MatmulPath, SamplerPlacement};
use crate::progress::LoadProgress;
use crate::sampling::SamplingParams;
use cublas::AlgoChoice;
use driver::{Context, DeviceBuffer, Graph, PinnedBuffer, Stream};
use f16_weights::F16Weights;
use gemm_f16::{GEMM_F16_IN_FORWARD, GEMM_F16_MAX_ROWS};
use kernels::{argmax_state_bytes, prefill_group_tiles, prefill_partial_floats, prefill_splits, GemmFusion, GemmPlan, GemmScratch, Kernels, PREFILL_TILE};
use megakernel::{Launch, Megakernel, MAX_END_IDS, MAX_LOOP_STEPS};
use prompt_graphs::{GraphCache, PAD_POSITIONS};
use sampler::DeviceSampler;
use weights::DeviceWeights;

/// Positions per attention split (16 per warp): a context of n positions runs
/// n/64 blocks per head, so decode attention spreads over the SMs.
const ATTN_CHUNK: usize = 64;
/// Splits per head at most in a prefill pass, where every row already brings its
/// own blocks: longer contexts take longer splits, which keeps the partials'
/// scratch (rows x heads x splits) bounded.
const PREFILL_SPLITS: usize = 32;

/// What the CUDA backend found and did at load, for `inspect`, benches and logs.
#[derive(Debug, Clone)]
pub struct CudaInfo {
    pub device_name: String,
    pub compute_capability: (i32, i32),
    pub sm_count: i32,
    pub driver_version: i32,
    /// Which kernel image was loaded ("sm_90a cubin" or "sm_90 PTX (JIT)").
    pub kernel_image: &'static str,
    pub module_load_seconds: f64,
    pub upload_seconds: f64,
    pub weight_bytes: usize,
    /// Whether cuBLASLt loaded (`matmul cublas`, or `auto` where it is found).
    pub cublas_loaded: bool,
}

/// The fp16 copy of the layers' matrices that cuBLASLt's products read
/// (cublas.rs): made at the first pass that has a product on cuBLASLt, so a
/// model whose passes never reach it (short prompts, a small fuel under `auto`)
/// keeps the memory, and the megakernel and KV caches get theirs first.
enum F16Copy {
    NotYet,
    Ready(F16Weights),
    /// For good: a weight or a pass's activations past fp16's range, or no room;
    /// cuBLASLt multiplies on bf16 hi+lo parts.
    Off,
}

impl F16Copy {
    fn ready(&self) -> Option<&F16Weights> {
        match self {
            F16Copy::Ready(copy) => Some(copy),
            F16Copy::NotYet | F16Copy::Off => None,
        }
    }
}

/// Measured on the H200 with each kernel forced on the graph path: from 2 rows
/// the tensor cores' decode step is faster (it streams the weights once whatever
/// the row count, the GEMV's time grows with every row); at 1 row the GEMV's is.
pub const TENSOR_CORE_MIN_ROWS: usize = 2;

/// Passes of at least this many rows take cuBLASLt under `MatmulPath::Cublas`.
/// Measured on the H200 (matmul check, each fuel's products): cuBLASLt on hi and
/// lo parts costs ~25 µs a product at 2-17 rows, where the tensor-core GEMM takes
/// 6-25 µs (a batch-16 Llama-3.2-1B decode step: 2.21 ms against 1.46); from
/// 128 rows it is as fast or faster on the 1B-class products (gate|up at 512
/// rows: 115 µs against 318), and prefill passes are that long.
pub const CUBLAS_MIN_ROWS: usize = 128;

/// Prompt passes (any row of a prompt) of at least this many rows take
/// cuBLASLt's fp16 products under `MatmulPath::Auto`. Measured on the H100
/// (matmul check, every fuel's four layer products summed): at 48 rows and up
/// cuBLASLt takes 0.45-0.67x the tensor-core GEMM's time (Llama-3.2-1B 79 µs a
/// layer against 137 at 48 rows, 85 against 235 at 96), at 32 it is even (76
/// against 85, SmolLM2 50 against 40), at 17 and below the GEMM is faster.
/// Decode passes keep `CUBLAS_MIN_ROWS` (their graphs stay on the tensor cores'
/// products, whatever the batch).
pub const CUBLAS_F16_PROMPT_MIN_ROWS: usize = 33;

/// Under `MatmulPath::Auto` with cuBLASLt loaded, a product on the bf16 hi+lo
/// split (`CublasOffer::Split`) of `rows` rows by an n x k weight takes it from
/// this many multiply-adds (rows * n * k) and `CUBLAS_MIN_ROWS` rows. Measured on
/// the H200 (matmul check, every fuel's products at 128, 512 and 4,096 rows): every
/// product of 2^30 or more was faster on cuBLASLt (hi+lo), by 1.5-3x; below it,
/// some were and some were not (SmolLM2's qkv at 512 rows: 24 µs against 14).
/// Products on fp16 operands take no threshold: on the H100 every fuel's product
/// at 128, 512 and 4,096 rows was faster there (rounding included) than on the
/// tensor-core GEMM, by 1.5-5.6x, but two of SmolLM2's, within 3 µs (o at 128 rows
/// 20.4 against 20.0, qkv at 512 rows 16.2 against 13.6).
pub const CUBLAS_AUTO_MIN_MACS: usize = 1 << 30;

/// What cuBLASLt offers one product under `MatmulPath::Auto`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CublasOffer {
    /// Not loaded.
    None,
    /// Products on the bf16 hi+lo split (two each): from `CUBLAS_AUTO_MIN_MACS`.
    Split,
    /// Products on fp16 operands (the matrix has an fp16 copy, or gets one at
    /// this pass): every pass of `CUBLAS_F16_PROMPT_MIN_ROWS` rows or more (a
    /// decode pass is offered none below `CUBLAS_MIN_ROWS`: `PassShape::fp16`).
    F16,
}

/// Which kernel multiplies one product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProductKernel {
    Gemv,
    Tensor,
    Cublas,
}

/// The kernel for a product of `rows` rows by an n x k weight under `matmul`,
/// with what cuBLASLt offers it (`MatmulPath::Cublas` always loads it).
fn matmul_kernel(matmul: MatmulPath, offer: CublasOffer, rows: usize, n: usize, k: usize) -> ProductKernel {
    let below_cublas = if rows >= TENSOR_CORE_MIN_ROWS { ProductKernel::Tensor } else { ProductKernel::Gemv };
    let auto_takes = match offer {
        CublasOffer::None => false,
        CublasOffer::Split => rows * n * k >= CUBLAS_AUTO_MIN_MACS && rows >= CUBLAS_MIN_ROWS,
        CublasOffer::F16 => rows >= CUBLAS_F16_PROMPT_MIN_ROWS,
    };
    match matmul {
        MatmulPath::Gemv => ProductKernel::Gemv,
        MatmulPath::Tensor => ProductKernel::Tensor,
        MatmulPath::Cublas if rows >= CUBLAS_MIN_ROWS => ProductKernel::Cublas,
        MatmulPath::Auto if auto_takes => ProductKernel::Cublas,
        MatmulPath::Cublas | MatmulPath::Auto => below_cublas,
    }
}

/// Whether a pass's layer products may take their matrices' fp16 copies: a
/// prompt pass (of any rows; `matmul_kernel` takes it from 33), or a decode
/// pass of `CUBLAS_MIN_ROWS` rows or more. Smaller decode batches stay on the
/// tensor cores: their graphs, and a decode row's bits, as those batch sizes had them.
fn fp16_offered(decode: bool, rows: usize) -> bool {
    !decode || rows >= CUBLAS_MIN_ROWS
}

/// What cuBLASLt offers a product by a matrix with or without an fp16 copy.
fn cublas_offer(kernels: &Kernels, has_f16: bool) -> CublasOffer {
    match (&kernels.cublas, has_f16) {
        (None, _) => CublasOffer::None,
        (Some(_), false) => CublasOffer::Split,
        (Some(_), true) => CublasOffer::F16,
    }
}

pub struct CudaBackend {
    spec: ModelSpec,
    info: CudaInfo,
    inner: Mutex<Inner>,
    options: GpuOptions,
    /// Outside `inner`: monitoring reads them while a pass holds the lock.
    megakernel_launches: AtomicU64,
    watchdog_events: AtomicU64,
}

struct Inner {
    // Field order is drop order: everything on the device before the context.
    megakernel: Option<Megakernel>,
    graphs: HashMap<(usize, usize, bool, usize), Graph>,
    /// Padded prompt passes' graphs, by shape (prompt_graphs.rs).
    prompt_graphs: GraphCache<PassShape, Graph>,
    scratch: Option<Scratch>,
    /// The prefill attention's split partials, grown to the largest prompt pass
    /// (apart from `scratch`: no decode graph reads them, so growing them keeps
    /// the decode graphs).
    prefill_partials: Option<PrefillPartials>,
    /// The KV cache of prompt passes' pad rows (`PAD_POSITIONS` positions),
    /// made at the first padded pass.
    pad_kv: Option<DeviceBuffer>,
    sampler: DeviceSampler,
    f16: F16Copy,
    weights: DeviceWeights,
    kernels: Kernels,
    host_inputs: PinnedBuffer,
    stream: Stream,
    ctx: Arc<Context>,
}

/// A bf16 KV cache of `positions` positions ([positions][layers][k|v][kv_dim]),
/// NaN until written: attention over a position never stored shows up in tests.
/// The poison is queued on the stream every pass uses, so nothing waits here.
fn kv_cache(ctx: &Context, stream: &Stream, s: &ModelSpec, positions: usize, what: &str) -> Result<DeviceBuffer> {
    let kv = DeviceBuffer::alloc(ctx, positions * s.num_layers * 2 * s.kv_dim() * 2, what)?;
    kv.fill_u8(stream, 0xff)?;
    Ok(kv)
}

/// Room for `items` (tile, split) pairs of the tensor-core prefill attention's
/// partials, every head's (kernels.rs `prefill_partial_floats`).
struct PrefillPartials {
    items: usize,
    o: DeviceBuffer,
    ml: DeviceBuffer,
}

impl PrefillPartials {
    /// Poisoned: a partial the merge reads before a split wrote it shows as NaN.
    fn new(ctx: &Context, st: &Stream, s: &ModelSpec, items: usize) -> Result<Self> {
        let (o, ml) = prefill_partial_floats(items, s.num_heads, 1, s.head_dim);
        let what = "prefill attention partials";
        let partials = PrefillPartials { items, o: DeviceBuffer::alloc(ctx, o * 4, what)?, ml: DeviceBuffer::alloc(ctx, ml * 4, what)? };
        partials.o.fill_u8(st, 0xff)?;
        partials.ml.fill_u8(st, 0xff)?;
        Ok(partials)
    }
}

/// Per-row data the kernels read (kernels/src/common.cuh `RowMeta`).
#[repr(C)]
#[derive(Clone, Copy)]
struct RowMeta {
    position: i32,
    context: i32,
    kv_base: u64,
}

// The kernels read RowMeta as 16 packed bytes.
const _: () = assert!(std::mem::size_of::<RowMeta>() == 16);

/// Up to `PREFILL_TILE` consecutive rows of one sequence for the tensor-core
/// prefill attention (kernels/src/attention_prefill.cu `PrefillTile`).
#[repr(C)]
#[derive(Clone, Copy)]
struct PrefillTile {
    first_row: i32,
    rows: i32,
}

/// What a pass picks from its last rows' logits.
#[derive(Clone, Copy)]
enum Pick<'r> {
    /// Nothing: the logits themselves go to the host.
    Logits,
    /// The greedy token (inside the pass, so graphs capture it).
    Argmax,
    /// The sampler's token per request (after the pass).
    Sample(&'r [SampleRequest<'r>]),
}

/// What one pass returns to the host.
enum PassOutput {
    /// One greedy token per output row (`forward_argmax`).
    Tokens(Vec<u32>),
    /// `vocab` logits per output row.
    Logits(Vec<f32>),
}

/// Writes `value`'s bytes into the staging buffer at byte offset `at`.
fn put<T: Copy>(bytes: &mut [u8], at: usize, value: T) {
    let n = std::mem::size_of::<T>();
    assert!(at + n <= bytes.len(), "staging write out of bounds");
    // SAFETY: bounds checked; T is plain data (u32, i32, RowMeta) and may sit unaligned.
    unsafe { std::ptr::write_unaligned(bytes[at..].as_mut_ptr() as *mut T, value) };
}

/// Activation buffers for passes of up to `rows` rows and `splits` attention splits.
struct Scratch {
    rows: usize,
    splits: usize,
    x: DeviceBuffer,
    h: DeviceBuffer,
    qkv: DeviceBuffer,
    attn: DeviceBuffer,
    gu: DeviceBuffer,
    act: DeviceBuffer,
    normed: DeviceBuffer,
    logits: DeviceBuffer,
    part_o: DeviceBuffer,
    part_ml: DeviceBuffer,
    /// tokens [rows] u32 | meta [rows] RowMeta | row_map [rows] i32 | split_rows [rows] i32 |
    /// prefill_tiles [rows] PrefillTile, uploaded together.
    inputs: DeviceBuffer,
    argmax: DeviceBuffer,
    /// argmax.cu's per-row keys and counters: zeroed once, left zero by every
    /// launch, so never poisoned.
    argmax_state: DeviceBuffer,
    gemm: GemmScratch,
    /// A pass's matmul input as cuBLASLt takes it: fp16, or bf16 hi and lo parts
    /// (None where no pass this long takes cuBLASLt).
    bf16: Option<DeviceBuffer>,
    /// Set by to_f16.cu when an activation leaves fp16's range (with `bf16`).
    f16_overflow: Option<DeviceBuffer>,
}

impl Scratch {
    fn new(ctx: &Context, st: &Stream, s: &ModelSpec, rows: usize, splits: usize, bf16_inputs: bool) -> Result<Self> {
        let f = |n: usize| n * 4;
        let a = |n: usize, what: &str| DeviceBuffer::alloc(ctx, n, what);
        let what = "activations";
        let (ws_floats, counters) = GemmPlan::scratch_needs(&Self::matmul_shapes(s), rows, ctx.sm_count as usize);
        Ok(Scratch {
            gemm: GemmScratch::alloc(ctx, st, ws_floats, counters)?,
            rows,
            splits,
            x: a(f(rows * s.hidden_size), what)?,
            h: a(f(rows * s.hidden_size), what)?,
            qkv: a(f(rows * (s.q_dim() + 2 * s.kv_dim())), what)?,
            attn: a(f(rows * s.q_dim()), what)?,
            gu: a(f(rows * 2 * s.intermediate_size), what)?,
            act: a(f(rows * s.intermediate_size), what)?,
            normed: a(f(rows * s.hidden_size), what)?,
            logits: a(f(rows * s.vocab_size), "logits")?,
            part_o: a(f(rows * s.num_heads * splits * s.head_dim), what)?,
            part_ml: a(f(rows * s.num_heads * splits * 2), what)?,
            inputs: a(Self::inputs_bytes(rows), what)?,
            argmax: a(rows * 4, what)?,
            argmax_state: {
                let b = a(argmax_state_bytes(rows), what)?;
                b.fill_u8(st, 0)?;
                b
            },
            bf16: match bf16_inputs {
                // hi then lo parts, bf16 each (an fp16 input takes the first half).
                true => Some(a(2 * 2 * rows * Self::matmul_shapes(s).iter().map(|&(_, k)| k).max().unwrap_or(0), what)?),
                false => None,
            },
            f16_overflow: match bf16_inputs {
                true => {
                    let flag = a(4, what)?;
                    flag.fill_u8(st, 0)?;
                    Some(flag)
                }
                false => None,
            },
        })
    }

    /// Every (n, k) product of a pass: qkv, O, gate|up, down, LM head.
    fn matmul_shapes(s: &ModelSpec) -> [(usize, usize); 5] {
        let (d, ff) = (s.hidden_size, s.intermediate_size);
        [(s.q_dim() + 2 * s.kv_dim(), d), (d, s.q_dim()), (2 * ff, d), (d, ff), (s.vocab_size, d)]
    }

    /// Fills every buffer with NaN bytes, so a value read before it was written
    /// shows (not the GEMM counters, which must stay zero).
    fn poison(&self, st: &Stream) -> Result<()> {
        for b in [&self.x, &self.h, &self.qkv, &self.attn, &self.gu, &self.act, &self.normed, &self.logits, &self.part_o, &self.part_ml, &self.argmax, &self.gemm.workspace] {
            b.fill_u8(st, 0xff)?;
        }
        Ok(())
    }

    fn meta_offset(rows: usize) -> usize {
        (rows * 4).next_multiple_of(16)
    }

    fn row_map_offset(rows: usize) -> usize {
        Self::meta_offset(rows) + rows * std::mem::size_of::<RowMeta>()
    }

    /// The rows the split attention kernel takes in a pass whose prompt rows go to
    /// the tensor-core prefill kernel.
    fn split_rows_offset(rows: usize) -> usize {
        Self::row_map_offset(rows) + rows * 4
    }

    fn tiles_offset(rows: usize) -> usize {
        (Self::split_rows_offset(rows) + rows * 4).next_multiple_of(8)
    }

    fn inputs_bytes(rows: usize) -> usize {
        Self::tiles_offset(rows) + rows * std::mem::size_of::<PrefillTile>()
    }
}

/// One sequence's KV cache on the device: [capacity][layers][k|v][kv_dim] bf16.
pub struct CudaSession {
    kv: DeviceBuffer,
    len: usize,
    capacity: usize,
}

impl Session for CudaSession {
    fn len(&self) -> usize {
        self.len
    }
    fn capacity(&self) -> usize {
        self.capacity
    }
    fn kv_bytes(&self) -> usize {
        self.kv.bytes
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// How a pass was launched (keys the prompt graphs).
#[derive(Clone, PartialEq, Eq, Hash)]
struct PassShape {
    rows: usize,
    out_rows: usize,
    splits: usize,
    /// Positions per attention split.
    attn_chunk: usize,
    /// Rows the split attention kernel takes: all of them (decode, or no prompt rows
    /// on the tensor cores), or those listed in the inputs' split_rows.
    split_rows: usize,
    split_listed: bool,
    /// Tiles of prompt rows for the tensor-core prefill attention (0: none).
    prefill_tiles: usize,
    /// Most context splits of one of those tiles (kernels.rs `prefill_splits`).
    prefill_splits: usize,
    gather_last: bool,
    argmax: bool,
    /// Whether the layer products may take their matrices' fp16 copies: a prompt
    /// pass, or a decode pass of `CUBLAS_MIN_ROWS` rows or more.
    fp16: bool,
    /// Which of cuBLASLt's algorithms the products run (`pass_algo`).
    algo: AlgoChoice,
}

/// The cuBLASLt algorithm a pass's products run. A pass of prompt pieces alone
/// that continues a session (after a reused prefix) must give its rows the bits a
/// pass of any other length gives them: below `PASS_SHARED_ROWS` rows it takes
/// cuBLASLt's pick for `PASS_SHARED_ROWS` rows, whose rows keep their bits at every
/// count from `LATER_PASS_SHARED_ROWS` up, where a count's own pick need not
/// (Llama-3.2-1B's down product splits K at 128 rows). Every other pass keeps its
/// own count's pick, faster below 512 rows: prompts' first rows alone (such
/// prompts are not cached below `PASS_SHARED_ROWS`), and any pass with decode rows
/// (`beside_decode`), whose prompt pieces keep no promise of their bits: the
/// pinned pick there made a 16K-token prompt beside 8 decoding streams 16% slower
/// and their steps ~0.4 ms longer on the H100.
fn pass_algo(beside_decode: bool, continues: bool, rows: usize) -> AlgoChoice {
    if !beside_decode && continues && rows < PASS_SHARED_ROWS {
        AlgoChoice { rows: Some(PASS_SHARED_ROWS), candidate: 0 }
    } else {
        AlgoChoice::FIRST
    }
}

impl CudaBackend {
    /// Opens device 0 with the default options, loads the kernels and uploads the weights.
    pub fn new(spec: ModelSpec, weights: &ModelWeights, progress: &LoadProgress) -> Result<Self> {
        Self::with_options(spec, weights, progress, GpuOptions::default())
    }

    /// Opens device `options.device_ordinal` with `options` (`EngineOptions::gpu`; tests compare paths side by side).
    pub fn with_options(spec: ModelSpec, weights: &ModelWeights, progress: &LoadProgress, options: GpuOptions) -> Result<Self> {
        check_shapes(&spec)?;
        let ctx = Arc::new(Context::open(options.device_ordinal)?);
        let stream = Stream::new()?;
        let mut kernels = Kernels::load(&ctx, spec.head_dim, options.wgmma_attention)?;
        kernels.pdl = options.pdl;
        match options.matmul {
            MatmulPath::Cublas => kernels.cublas = Some(cublas::Cublas::new(&ctx)?),
            // `auto` takes cuBLASLt for large prefill products where the library loads
            // and runs a check product (cudarc panics on a symbol an old library lacks).
            MatmulPath::Auto => {
                let load = || cublas::Cublas::new(&ctx).and_then(|lt| lt.smoke_test(&ctx, &stream).map(|()| lt));
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(load)) {
                    Ok(Ok(lt)) => kernels.cublas = Some(lt),
                    Ok(Err(e)) => tracing::info!("matmul auto without cuBLASLt (long prefills on the tensor-core GEMM): {e}"),
                    Err(_) => tracing::info!("matmul auto without cuBLASLt (long prefills on the tensor-core GEMM): loading it panicked"),
                }
            }
            MatmulPath::Gemv | MatmulPath::Tensor => {}
        }
        let t = Instant::now();
        let dev_weights = DeviceWeights::upload(&ctx, &stream, &spec, weights, progress)?;
        let upload_seconds = t.elapsed().as_secs_f64();
        let new_megakernel = || Megakernel::new(&ctx, kernels.module(), &stream, &spec, &dev_weights, options.watchdog);
        let megakernel = match options.decode {
            DecodePath::Graph => None,
            DecodePath::Megakernel => Some(new_megakernel()?),
            DecodePath::Auto => match megakernel::fuel_for(&spec) {
                Some(_) => match new_megakernel() {
                    Ok(mk) => Some(mk),
                    Err(e) => {
                        tracing::warn!(error = %e, "no megakernel on this device; decoding with CUDA graphs");
                        None
                    }
                },
                None => None,
            },
        };
        let info = CudaInfo {
            device_name: ctx.name.clone(),
            compute_capability: ctx.compute_capability,
            sm_count: ctx.sm_count,
            driver_version: ctx.driver_version,
            kernel_image: kernels.image,
            module_load_seconds: kernels.load_seconds,
            upload_seconds,
            weight_bytes: dev_weights.bytes,
            cublas_loaded: kernels.cublas.is_some(),
        };
        tracing::info!(?info, "cuda backend ready");
        let host_inputs = PinnedBuffer::alloc(Scratch::inputs_bytes(1))?;
        Ok(CudaBackend {
            spec,
            info,
            options,
            megakernel_launches: AtomicU64::new(0),
            watchdog_events: AtomicU64::new(0),
            inner: Mutex::new(Inner {
                megakernel,
                graphs: HashMap::new(),
                prompt_graphs: GraphCache::new(),
                scratch: None,
                prefill_partials: None,
                pad_kv: None,
                sampler: DeviceSampler::default(),
                f16: F16Copy::NotYet,
                weights: dev_weights,
                kernels,
                host_inputs,
                stream,
                ctx,
            }),
        })
    }

    pub fn info(&self) -> &CudaInfo {
        &self.info
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Inner>> {
        let inner = self.inner.lock().map_err(|_| RocketError::Internal("the CUDA backend lock is poisoned".into()))?;
        inner.ctx.bind()?;
        Ok(inner)
    }

    /// One pass; returns logits rows or (with `argmax`) one token per output row.
    fn run(&self, chunks: &mut [Chunk<'_>], logits: Logits, pick: Pick<'_>) -> Result<PassOutput> {
        let s = &self.spec;
        check_chunks(chunks, s.vocab_size)?;
        let argmax = matches!(pick, Pick::Argmax);
        if let Pick::Sample(requests) = pick {
            if requests.len() != chunks.len() || logits != Logits::Last {
                return Err(RocketError::Internal(format!("{} sample requests for {} chunks with {logits:?} logits", requests.len(), chunks.len())));
            }
        }
        if argmax && logits != Logits::Last {
            return Err(RocketError::Internal(format!("a pass picking greedy tokens with {logits:?} logits")));
        }
        let rows: usize = chunks.iter().map(|c| c.tokens.len()).sum();
        let decode = chunks.iter().all(|c| c.tokens.len() == 1);
        // Prompt chunks (two tokens or more) take the tensor-core prefill attention, in
        // tiles of consecutive rows; single-token rows stay on the split kernel, so a
        // decode row gets the same bits whether or not a prompt shares its pass.
        let tiled = !decode && self.options.tc_attention;
        // A short prompt pass runs padded to its row bucket and replays the bucket's
        // graph (prompt_graphs.rs); the pad rows are a sequence of their own, after
        // the pass's rows, and reach no output row.
        let padded = if self.options.prompt_graphs && tiled && logits != Logits::All {
            prompt_graphs::padded_rows(chunks.iter().map(|c| c.tokens.len()))
        } else {
            None
        };
        let pad = padded.map_or(0, |p| p - rows);
        let rows = rows + pad;
        let out_rows = match logits {
            Logits::All => rows,
            Logits::Last => chunks.len(),
            Logits::KvOnly => 0,
        };
        // Decode passes size attention by capacity so one graph serves every step.
        let span = |c: &Chunk<'_>| if decode { c.session.capacity() } else { c.session.len() + c.tokens.len() };
        // The split kernel's chunk length comes from the rows it takes: with the prompts
        // tiled, a long prompt must not stretch a decode row's splits (and change its bits).
        let on_split = |c: &&Chunk<'_>| !tiled || c.tokens.len() == 1;
        let longest = chunks.iter().filter(on_split).map(span).max().unwrap_or(1);
        let attn_chunk = if decode { ATTN_CHUNK } else { ATTN_CHUNK.max(longest.div_ceil(PREFILL_SPLITS)) };
        let splits = longest.div_ceil(attn_chunk).max(1);
        let mut shape = PassShape {
            rows,
            out_rows,
            splits,
            attn_chunk,
            split_rows: rows,
            split_listed: false,
            prefill_tiles: 0,
            prefill_splits: 0,
            gather_last: !decode && logits == Logits::Last,
            argmax,
            fp16: fp16_offered(decode, rows),
            algo: pass_algo(chunks.iter().any(|c| c.tokens.len() == 1), chunks.iter().any(|c| !c.session.is_empty()), rows),
        };

        let mut guard = self.lock()?;
        let inner = &mut *guard;
        if inner.megakernel.as_ref().is_some_and(Megakernel::hung) {
            // Work queued behind a launch that never ended would wait forever.
            return Err(crate::megakernel::MegakernelError::GpuHeld.into());
        }
        let started = std::time::Instant::now();
        let grow = inner.scratch.as_ref().is_none_or(|sc| sc.rows < rows || sc.splits < splits);
        if grow {
            let (r, sp) = inner.scratch.as_ref().map_or((rows, splits), |sc| (sc.rows.max(rows), sc.splits.max(splits)));
            // Graphs point into the old buffers: drop them with the buffers.
            inner.graphs.clear();
            inner.prompt_graphs.clear();
            inner.scratch = None;
            // The bf16 inputs only where a pass this long can take cuBLASLt.
            let bf16 = inner.kernels.cublas.is_some() && r.next_power_of_two() >= CUBLAS_F16_PROMPT_MIN_ROWS;
            let fresh = Scratch::new(&inner.ctx, &inner.stream, s, r.next_power_of_two(), sp, bf16)?;
            fresh.poison(&inner.stream)?;
            inner.scratch = Some(fresh);
            inner.host_inputs = PinnedBuffer::alloc(Scratch::inputs_bytes(r.next_power_of_two()))?;
        }
        if pad > 0 && inner.pad_kv.is_none() {
            inner.pad_kv = Some(kv_cache(&inner.ctx, &inner.stream, s, PAD_POSITIONS, "the pad rows' KV cache")?);
        }
        let pad_kv = inner.pad_kv.as_ref().map_or(0, |kv| kv.ptr);
        let scratch = inner.scratch.as_ref().expect("allocated above");

        // Stage tokens, per-row metadata and the last-row map in one upload.
        let cap = scratch.rows;
        let bytes = inner.host_inputs.as_mut_slice::<u8>();
        let mut row = 0usize;
        let mut row_map = Vec::with_capacity(chunks.len());
        // With prompts tiled, the tiles and the split kernel's rows go straight into the
        // staging buffer (no list on a decode pass, where every row is the split kernel's).
        let (mut split_rows, mut tiles, mut max_splits) = (0usize, 0usize, 0usize);
        for c in chunks.iter_mut() {
            let sess = own_session::<CudaSession>(c.session, "cuda")?;
            let first = row;
            for (i, &tok) in c.tokens.iter().enumerate() {
                let pos = sess.len + i;
                let meta = RowMeta { position: pos as i32, context: pos as i32 + 1, kv_base: sess.kv.ptr };
                put(bytes, row * 4, tok);
                put(bytes, Scratch::meta_offset(cap) + row * std::mem::size_of::<RowMeta>(), meta);
                row += 1;
            }
            if tiled && c.tokens.len() >= 2 {
                for start in (first..row).step_by(PREFILL_TILE) {
                    let tile_rows = (row - start).min(PREFILL_TILE);
                    let tile = PrefillTile { first_row: start as i32, rows: tile_rows as i32 };
                    put(bytes, Scratch::tiles_offset(cap) + tiles * std::mem::size_of::<PrefillTile>(), tile);
                    tiles += 1;
                    max_splits = max_splits.max(prefill_splits(sess.len + (start - first) + tile_rows));
                }
            } else if tiled {
                for r in first..row {
                    put(bytes, Scratch::split_rows_offset(cap) + split_rows * 4, r as i32);
                    split_rows += 1;
                }
            }
            row_map.push(row as i32 - 1);
        }
        if pad > 0 {
            // One tile (a pad is shorter than PREFILL_TILE) from position 0 of the pad KV.
            let source = chunks[prompt_graphs::pad_source(chunks.iter().map(|c| (c.tokens.len(), c.session.len())), pad)].tokens;
            let first = row;
            for i in 0..pad {
                let meta = RowMeta { position: i as i32, context: i as i32 + 1, kv_base: pad_kv };
                put(bytes, row * 4, prompt_graphs::pad_token(source, i));
                put(bytes, Scratch::meta_offset(cap) + row * std::mem::size_of::<RowMeta>(), meta);
                row += 1;
            }
            let tile = PrefillTile { first_row: first as i32, rows: pad as i32 };
            put(bytes, Scratch::tiles_offset(cap) + tiles * std::mem::size_of::<PrefillTile>(), tile);
            tiles += 1;
            max_splits = max_splits.max(prefill_splits(pad));
        }
        for (i, &r) in row_map.iter().enumerate() {
            put(bytes, Scratch::row_map_offset(cap) + i * 4, r);
        }
        if tiles > 0 {
            shape.split_rows = split_rows;
            shape.split_listed = true;
            shape.prefill_tiles = tiles;
            shape.prefill_splits = max_splits;
            let items = tiles.min(prefill_group_tiles(max_splits)) * max_splits;
            if max_splits > 1 && inner.prefill_partials.as_ref().is_none_or(|p| p.items < items) {
                inner.prompt_graphs.clear();
                inner.prefill_partials = None;
                inner.prefill_partials = Some(PrefillPartials::new(&inner.ctx, &inner.stream, s, items)?);
            }
        }
        scratch.inputs.upload(&inner.stream, 0, &bytes[..Scratch::inputs_bytes(cap)])?;

        if matches!(inner.f16, F16Copy::NotYet) && self.layer_product_on_cublas(inner, &shape) {
            inner.f16 = match fp16_copy(&inner.ctx, &inner.stream, &inner.kernels, s, &inner.weights)? {
                Some(copy) => F16Copy::Ready(copy),
                None => F16Copy::Off,
            };
            // A graph recorded before has the products on the split.
            inner.graphs.clear();
            inner.prompt_graphs.clear();
        }
        let mut issued;
        // At most twice: a pass whose activations left fp16's range runs again on
        // the bf16 hi+lo products, with the fp16 copy gone for good. The rerun
        // rewrites every KV position the first run wrote before anything reads it.
        loop {
            if decode && self.options.cuda_graphs {
                // out_rows: a pass that fills KV alone records no LM head.
                let key = (rows, splits, argmax, out_rows);
                if !inner.graphs.contains_key(&key) {
                    let graph = self.capture(inner, scratch, &shape)?;
                    inner.graphs.insert(key, graph);
                }
                inner.graphs[&key].launch(&inner.stream)?;
            } else if padded.is_some() && self.options.cuda_graphs && inner.prompt_graphs.replays(&shape) {
                if !inner.prompt_graphs.contains(&shape) {
                    let t = Instant::now();
                    let graph = self.capture(inner, scratch, &shape)?;
                    inner.prompt_graphs.insert(shape.clone(), graph);
                    // What a shape's second pass pays once (recording and instantiating).
                    tracing::debug!(rows, record_us = t.elapsed().as_secs_f64() * 1e6, kept = inner.prompt_graphs.len(), "prompt graph recorded");
                }
                inner.prompt_graphs.get(&shape).expect("recorded above").launch(&inner.stream)?;
            } else {
                self.record_pass(inner, scratch, &shape)?;
            }
            issued = started.elapsed();
            let Some(flag) = self.f16_flag(inner, scratch, &shape) else { break };
            let mut overflowed = [0u32];
            flag.download(&inner.stream, 0, &mut overflowed)?;
            if overflowed[0] == 0 {
                break;
            }
            tracing::warn!(
                rows,
                "values past fp16's range (activations, or the prompt attention's outputs): this pass and every later one multiply on bf16 hi+lo parts (twice the arithmetic)"
            );
            inner.f16 = F16Copy::Off;
            inner.graphs.clear();
            inner.prompt_graphs.clear();
        }

        let out = match pick {
            // Nothing to download: wait for the pass (the pinned staging is reused by the next).
            _ if out_rows == 0 => {
                inner.stream.sync()?;
                PassOutput::Logits(Vec::new())
            }
            Pick::Argmax => {
                let mut tokens = vec![0u32; out_rows];
                scratch.argmax.download(&inner.stream, 0, &mut tokens)?;
                PassOutput::Tokens(tokens)
            }
            Pick::Sample(requests) => {
                let (ctx, stream, kernels) = (&inner.ctx, &inner.stream, &inner.kernels);
                PassOutput::Tokens(inner.sampler.sample(ctx, stream, kernels, scratch.logits.ptr, s.vocab_size, requests)?)
            }
            Pick::Logits => {
                let mut l = vec![0f32; out_rows * s.vocab_size];
                scratch.logits.download(&inner.stream, 0, &mut l)?;
                PassOutput::Logits(l)
            }
        };
        // Issue time near the total says the host's launches, not the GPU, bound the
        // pass (what a CUDA graph of the pass would remove).
        tracing::debug!(
            rows,
            decode,
            issue_us = issued.as_secs_f64() * 1e6,
            total_us = started.elapsed().as_secs_f64() * 1e6,
            pad,
            "pass"
        );
        for c in chunks.iter_mut() {
            own_session::<CudaSession>(c.session, "cuda")?.len += c.tokens.len();
        }
        Ok(out)
    }

    /// Whether one of a pass's layer products (not the LM head, which has no fp16
    /// copy) takes cuBLASLt.
    fn layer_product_on_cublas(&self, inner: &Inner, p: &PassShape) -> bool {
        // The layers' matrices get an fp16 copy at such a pass unless it is off for good
        // or the pass is offered none (record_pass gives it the copies alike).
        let offer = cublas_offer(&inner.kernels, p.fp16 && !matches!(inner.f16, F16Copy::Off));
        let on_cublas = |&(n, k): &(usize, usize)| matmul_kernel(self.options.matmul, offer, p.algo.kernel_rows(p.rows), n, k) == ProductKernel::Cublas;
        Scratch::matmul_shapes(&self.spec)[..4].iter().any(on_cublas)
    }

    /// The range flag of a pass whose cuBLASLt products take fp16
    /// operands, else None. Zeroed where the scratch is made: once set, the fp16
    /// copy is gone for good and the flag is never read again.
    fn f16_flag<'s>(&self, inner: &Inner, scratch: &'s Scratch, p: &PassShape) -> Option<&'s DeviceBuffer> {
        let flag = scratch.f16_overflow.as_ref()?;
        (inner.f16.ready().is_some() && self.layer_product_on_cublas(inner, p)).then_some(flag)
    }

    /// One whole forward pass recorded into a graph (nothing launched).
    fn capture(&self, inner: &Inner, sc: &Scratch, p: &PassShape) -> Result<Graph> {
        inner.stream.begin_capture()?;
        let recorded = self.record_pass(inner, sc, p);
        let graph = inner.stream.end_capture();
        recorded?;
        graph
    }

    /// Launches one whole forward pass on the stream (also what a graph records).
    fn record_pass(&self, inner: &Inner, sc: &Scratch, p: &PassShape) -> Result<()> {
        let s = &self.spec;
        let (k, w, st) = (&inner.kernels, &inner.weights, &inner.stream);
        let (d, qd, kvd, nl) = (s.hidden_size, s.q_dim(), s.kv_dim(), s.num_layers);
        let eps = s.rms_norm_eps as f32;
        let t = p.rows;
        let tokens = sc.inputs.ptr;
        let meta = sc.inputs.ptr + Scratch::meta_offset(sc.rows) as u64;
        let row_map = sc.inputs.ptr + Scratch::row_map_offset(sc.rows) as u64;
        let split_index = if p.split_listed { sc.inputs.ptr + Scratch::split_rows_offset(sc.rows) as u64 } else { 0 };
        let tile_table = sc.inputs.ptr + Scratch::tiles_offset(sc.rows) as u64;
        // The range flag of a pass on fp16 products (a value past fp16's range redoes it on bf16).
        let f16_flag = self.f16_flag(inner, sc, p).filter(|_| p.fp16).map(|flag| flag.ptr);
        k.embed(st, w.embed, tokens, sc.x.ptr, d, t)?;
        for (li, l) in w.layers.iter().enumerate() {
            // The fp16 copies of this layer's matrices (0: none).
            let (qkv16, o16, gate_up16, down16) = inner.f16.ready().filter(|_| p.fp16).map_or((0, 0, 0, 0), |f| {
                let l = f.layers[li];
                (l.qkv, l.o, l.gate_up, l.down)
            });
            self.normed_matmul(k, st, sc, l.attn_norm, [l.qkv, qkv16], sc.qkv.ptr, qd + 2 * kvd, t, p.algo, false)?;
            k.rope_kv(st, sc.qkv.ptr, w.inv_freq, l.q_norm, l.k_norm, eps, meta, s.num_heads, s.num_kv_heads, li, nl, t)?;
            if p.split_rows > 0 {
                k.attention(
                    st,
                    sc.qkv.ptr,
                    qd + 2 * kvd,
                    meta,
                    split_index,
                    sc.part_o.ptr,
                    sc.part_ml.ptr,
                    sc.attn.ptr,
                    s.num_heads,
                    s.num_kv_heads,
                    li,
                    nl,
                    p.attn_chunk,
                    p.splits,
                    p.split_rows,
                )?;
            }
            // A pass of prompt tiles alone whose O-projection takes fp16 operands gets them
            // from the attention itself (`fuse`: the bits `to_f16` would give, which the
            // fp16 range test checks against the unfused pass).
            let o_operand = f16_flag
                .filter(|_| self.options.fuse && p.prefill_tiles > 0 && p.split_rows == 0 && self.f16_product(k, t, p.algo, d, qd, o16))
                .and_then(|flag| sc.bf16.as_ref().map(|b| (b.ptr, flag)));
            if p.prefill_tiles > 0 {
                // A pass within one split per tile reads and writes no partial.
                let partials = match &inner.prefill_partials {
                    Some(pp) if p.prefill_splits > 1 => (pp.o.ptr, pp.ml.ptr),
                    _ if p.prefill_splits > 1 => return Err(RocketError::Internal("prefill splits without their partials".into())),
                    _ => (0, 0),
                };
                // Groups of tiles share the partials' space, one launch after another.
                let (tiles, splits) = (p.prefill_tiles, p.prefill_splits);
                let group = prefill_group_tiles(splits).min(tiles);
                for first in (0..tiles).step_by(group) {
                    let table = tile_table + (first * std::mem::size_of::<PrefillTile>()) as u64;
                    let n = group.min(tiles - first);
                    k.attention_prefill(st, sc.qkv.ptr, qd + 2 * kvd, meta, table, sc.attn.ptr, partials, s.num_heads, s.num_kv_heads, li, nl, n, splits, o_operand)?;
                }
            }
            if o_operand.is_some() {
                self.f16_matmul(k, st, sc, o16, sc.x.ptr, d, qd, t, p.algo, true, |_, _| Ok(()))?;
            } else {
                self.matmul(k, st, sc, [l.o, o16], sc.attn.ptr, sc.x.ptr, d, qd, t, p.algo, true)?;
            }
            self.mlp(k, st, sc, l.mlp_norm, [l.gate_up, gate_up16], [l.down, down16], t, p.algo)?;
        }
        // A pass that only fills KV (a prompt piece whose token is not due) runs no LM head.
        if p.out_rows == 0 {
            return Ok(());
        }
        // The final norm stays its own kernel, fused or not: prefill passes gather their
        // last rows in it, and a decode row must get the same bits whether or not a prompt
        // shares its pass. (Fused, the LM head also measured slower: 152 vs 141 µs.)
        let map = if p.gather_last { row_map } else { 0 };
        k.rms_norm(st, sc.x.ptr, w.final_norm, sc.normed.ptr, d, eps, map, p.out_rows)?;
        // The LM head's rows are the output rows, not the pass's: its own pick (a pinned
        // pass's kernel rows would move a one-row head off the GEMV).
        self.matmul(k, st, sc, [w.lm_head, 0], sc.normed.ptr, sc.logits.ptr, s.vocab_size, d, p.out_rows, AlgoChoice::FIRST, false)?;
        if p.argmax {
            k.argmax(st, sc.logits.ptr, sc.argmax.ptr, s.vocab_size, p.out_rows, sc.argmax_state.ptr)?;
        }
        Ok(())
    }
}

impl CudaBackend {
    /// y (+)= x · Wᵀ for `rows` input rows: cuBLASLt (on x rounded to fp16 with
    /// W's fp16 copy, else on x's bf16 hi and lo parts, in the scratch's `bf16`),
    /// or the tensor-core GEMM where the matmul mode picks it for `rows` and the
    /// width allows, else the GEMV. `w` is W in bf16 and its fp16 copy (0: none);
    /// `algo`: which of cuBLASLt's algorithms (`pass_algo`).
    #[allow(clippy::too_many_arguments)]
    fn matmul(&self, k: &Kernels, st: &Stream, sc: &Scratch, w: [u64; 2], x: u64, y: u64, n: usize, width: usize, rows: usize, algo: AlgoChoice, accumulate: bool) -> Result<()> {
        let [w, w16] = w;
        if self.f16_product(k, rows, algo, n, width, w16) {
            return self.f16_matmul(k, st, sc, w16, y, n, width, rows, algo, accumulate, |xb, flag| k.to_f16(st, x, xb, rows * width, flag));
        }
        let kernel = self.product_kernel(k, w16 != 0, rows, algo, n, width);
        if kernel == ProductKernel::Cublas {
            let (Some(lt), Some(xb)) = (&k.cublas, &sc.bf16) else {
                return Err(RocketError::Internal("a cuBLASLt product without cuBLASLt or its input buffers".into()));
            };
            let (hi, lo) = k.to_bf16_split(st, x, xb.ptr, rows * width)?;
            return lt.matmul_split(st, w, hi, lo, y, n, width, rows, algo, accumulate);
        }
        if kernel == ProductKernel::Tensor && k.gemm_tc_fits(width) {
            k.gemm_tc(st, w, x, y, n, width, rows, accumulate, &sc.gemm, GemmFusion::default())
        } else {
            k.gemv(st, w, x, y, n, width, rows, accumulate)
        }
    }

    /// y = RMSNorm(x; norm_w) · Wᵀ for the residual stream x (`n` weight rows), or
    /// with `silu` (W the fused gate|up) y = silu(gate) · up [rows][n / 2]: one
    /// tensor-core launch with the norm and SiLU fused where the matmul mode and
    /// shapes allow (gemm_tc.cu), else rms_norm, the matmul and silu_mul.
    #[allow(clippy::too_many_arguments)]
    fn normed_matmul(&self, k: &Kernels, st: &Stream, sc: &Scratch, norm_w: u64, w: [u64; 2], y: u64, n: usize, rows: usize, algo: AlgoChoice, silu: bool) -> Result<()> {
        let (d, eps) = (self.spec.hidden_size, self.spec.rms_norm_eps as f32);
        let on_tensor_cores = self.product_kernel(k, w[1] != 0, rows, algo, n, d) == ProductKernel::Tensor;
        let fits = on_tensor_cores && k.gemm_tc_fits(d) && (!silu || GemmFusion::silu_fits(n));
        if self.options.fuse && fits {
            return k.gemm_tc(st, w[0], sc.x.ptr, y, n, d, rows, false, &sc.gemm, GemmFusion { norm: Some((norm_w, eps)), silu });
        }
        let product_out = if silu { sc.gu.ptr } else { y };
        if self.options.fuse && self.f16_product(k, rows, algo, n, d, w[1]) {
            // The norm writes the product's fp16 operand itself.
            self.f16_matmul(k, st, sc, w[1], product_out, n, d, rows, algo, false, |xb, flag| k.rms_norm_f16(st, sc.x.ptr, norm_w, xb, d, eps, rows, flag))?;
        } else {
            k.rms_norm(st, sc.x.ptr, norm_w, sc.h.ptr, d, eps, 0, rows)?;
            self.matmul(k, st, sc, w, sc.h.ptr, product_out, n, d, rows, algo, false)?;
        }
        if silu {
            k.silu_mul(st, sc.gu.ptr, y, n / 2, rows)?;
        }
        Ok(())
    }

    /// The MLP: x += (silu(gate) · up)(RMSNorm(x; norm_w)) · downᵀ. Where both
    /// products take cuBLASLt's fp16 operands (and `fuse` is on), SiLU·mul writes
    /// the down-projection's fp16 operand itself; else `normed_matmul` and `matmul`.
    #[allow(clippy::too_many_arguments)]
    fn mlp(&self, k: &Kernels, st: &Stream, sc: &Scratch, norm_w: u64, gate_up: [u64; 2], down: [u64; 2], rows: usize, algo: AlgoChoice) -> Result<()> {
        let (d, ff) = (self.spec.hidden_size, self.spec.intermediate_size);
        let fp16_act = self.options.fuse && self.f16_product(k, rows, algo, 2 * ff, d, gate_up[1]) && self.f16_product(k, rows, algo, d, ff, down[1]);
        if !fp16_act {
            self.normed_matmul(k, st, sc, norm_w, gate_up, sc.act.ptr, 2 * ff, rows, algo, true)?;
            return self.matmul(k, st, sc, down, sc.act.ptr, sc.x.ptr, d, ff, rows, algo, true);
        }
        self.normed_matmul(k, st, sc, norm_w, gate_up, sc.gu.ptr, 2 * ff, rows, algo, false)?;
        self.f16_matmul(k, st, sc, down[1], sc.x.ptr, d, ff, rows, algo, true, |xb, flag| k.silu_mul_f16(st, sc.gu.ptr, xb, ff, rows, flag))
    }

    /// The kernel for a product of `rows` rows by an n x width matrix with or
    /// without an fp16 copy, picked for `algo`'s row count (`AlgoChoice::kernel_rows`).
    fn product_kernel(&self, k: &Kernels, has_f16: bool, rows: usize, algo: AlgoChoice, n: usize, width: usize) -> ProductKernel {
        matmul_kernel(self.options.matmul, cublas_offer(k, has_f16), algo.kernel_rows(rows), n, width)
    }

    /// Whether a product of `rows` rows by an n x width matrix runs on cuBLASLt
    /// with fp16 operands: the library takes it (`product_kernel`) and the matrix
    /// has an fp16 copy (`w16`, 0: none).
    fn f16_product(&self, k: &Kernels, rows: usize, algo: AlgoChoice, n: usize, width: usize, w16: u64) -> bool {
        w16 != 0 && self.product_kernel(k, true, rows, algo, n, width) == ProductKernel::Cublas
    }

    /// y (+)= x · W16ᵀ on fp16 operands (`w16`: W's fp16 copy), where
    /// `write_operand(xb, flag)` writes x in fp16 to the operand buffer xb (the
    /// scratch's `bf16`), setting the range flag for a value past fp16's range.
    /// Under `auto`, a pass on its own algorithm of up to `GEMM_F16_MAX_ROWS` rows
    /// multiplies on rocket's fp16 GEMM (`f16_gemm_takes`), every other on cuBLASLt.
    #[allow(clippy::too_many_arguments)]
    fn f16_matmul(
        &self,
        k: &Kernels,
        st: &Stream,
        sc: &Scratch,
        w16: u64,
        y: u64,
        n: usize,
        width: usize,
        rows: usize,
        algo: AlgoChoice,
        accumulate: bool,
        write_operand: impl FnOnce(u64, u64) -> Result<()>,
    ) -> Result<()> {
        let (Some(lt), Some(xb), Some(flag)) = (&k.cublas, &sc.bf16, &sc.f16_overflow) else {
            return Err(RocketError::Internal("an fp16 product without cuBLASLt, its operand buffer or its range flag".into()));
        };
        write_operand(xb.ptr, flag.ptr)?;
        if self.f16_gemm_takes(k, rows, algo, n, width) {
            return k.gemm_f16(st, w16, xb.ptr, y, n, width, rows, accumulate);
        }
        lt.matmul_pinned(st, cublas::Operands::F16, w16, xb.ptr, y, n, width, rows, accumulate, algo)
    }

    /// Whether an fp16 product of `rows` rows by an n x width matrix runs on
    /// rocket's fp16 GEMM instead of cuBLASLt: under `auto` (`MatmulPath::Cublas`
    /// asks for the library), in a pass on its own algorithm (a pass pinned to the
    /// 512-row pick keeps the bits that pick gives) of up to `GEMM_F16_MAX_ROWS`
    /// rows, where cuBLASLt's picks for products with few output tiles (Llama's qkv,
    /// o and down at 128 rows) stream their weights at 1.0-1.6 TB/s on an H100.
    fn f16_gemm_takes(&self, k: &Kernels, rows: usize, algo: AlgoChoice, n: usize, width: usize) -> bool {
        GEMM_F16_IN_FORWARD && self.options.matmul == MatmulPath::Auto && algo == AlgoChoice::FIRST && rows <= GEMM_F16_MAX_ROWS && k.gemm_f16_fits(n, width)
    }
}

/// The fp16 copy of the layers' matrices for cuBLASLt, or None (logged) where a
/// weight is past fp16's range or the device has no room for it.
fn fp16_copy(ctx: &Context, stream: &Stream, kernels: &Kernels, spec: &ModelSpec, weights: &DeviceWeights) -> Result<Option<F16Weights>> {
    match F16Weights::convert(ctx, stream, kernels, spec, weights) {
        Ok(Some(copy)) => {
            tracing::info!(bytes = copy.bytes, "fp16 copy of the layers' matrices made for cuBLASLt's products");
            Ok(Some(copy))
        }
        Ok(None) => {
            tracing::info!("a weight is past fp16's range: cuBLASLt multiplies on bf16 hi+lo parts (twice the arithmetic)");
            Ok(None)
        }
        Err(RocketError::DeviceMemory(why)) => {
            tracing::warn!("no room for the fp16 copy of the weights, cuBLASLt multiplies on bf16 hi+lo parts (twice the arithmetic): {why}");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Shapes the kernels' contracts require.
fn check_shapes(s: &ModelSpec) -> Result<()> {
    for (name, v) in [("hidden_size", s.hidden_size), ("intermediate_size", s.intermediate_size), ("q_dim", s.q_dim())] {
        if v % 8 != 0 {
            return Err(RocketError::Device(format!("{name} {v} is not a multiple of 8, which the CUDA GEMV needs")));
        }
    }
    Ok(())
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn new_session(&self, capacity: usize) -> Result<Box<dyn Session>> {
        let inner = self.lock()?;
        let kv = kv_cache(&inner.ctx, &inner.stream, &self.spec, capacity, &format!("a KV cache of {capacity} tokens"))?;
        Ok(Box::new(CudaSession { kv, len: 0, capacity }))
    }

    /// One device-to-device copy: the cache is position-major
    /// ([capacity][layers][k|v][kv_dim]), so the first `len` positions of every
    /// layer are one contiguous range whatever the capacity. Synchronised before
    /// returning, so `src` may be freed (evicted) at once (tests/cuda.rs
    /// `prefix_reuse_*` check it on both decode paths).
    fn copy_prefix(&self, src: &mut dyn Session, dst: &mut dyn Session, len: usize) -> Result<()> {
        check_copy(src, dst, len)?;
        let bytes = len * self.spec.num_layers * 2 * self.spec.kv_dim() * 2;
        let inner = self.lock()?;
        let src = own_session::<CudaSession>(src, "cuda")?;
        let dst = own_session::<CudaSession>(dst, "cuda")?;
        dst.kv.copy_prefix_from(&inner.stream, &src.kv, bytes)?;
        inner.stream.sync()?;
        dst.len = len;
        Ok(())
    }

    fn device_description(&self) -> String {
        let i = &self.info;
        let cublas = if i.cublas_loaded { ", cuBLASLt" } else { "" };
        format!("{} (sm_{}{}, {} SMs, {}{cublas})", i.device_name, i.compute_capability.0, i.compute_capability.1, i.sm_count, i.kernel_image)
    }

    fn copy_bandwidth_gbs(&self) -> Result<Option<f64>> {
        CudaBackend::copy_bandwidth_gbs(self).map(Some)
    }

    fn forward(&self, chunks: &mut [Chunk<'_>], logits: Logits) -> Result<Vec<f32>> {
        match self.run(chunks, logits, Pick::Logits)? {
            PassOutput::Logits(l) => Ok(l),
            PassOutput::Tokens(_) => Err(RocketError::Internal("argmax pass where logits were asked for".into())),
        }
    }

    #[cfg(feature = "diagnostics")]
    fn inject_device_fault(&self) -> Result<String> {
        CudaBackend::inject_device_fault(self)
    }

    fn decode_loop(
        &self,
        session: &mut dyn Session,
        first: u32,
        req: &LoopRequest<'_>,
        on_token: &mut dyn FnMut(u32, Option<TokenLogprob>) -> bool,
    ) -> Result<Option<LoopOutcome>> {
        Ok(self.loop_on_session(session, first, req, &[], false, on_token)?.map(|(outcome, _)| outcome))
    }

    fn counters(&self) -> BackendCounters {
        BackendCounters {
            megakernel_launches: self.megakernel_launches.load(Ordering::Relaxed),
            watchdog_events: self.watchdog_events.load(Ordering::Relaxed),
        }
    }

    fn pass_shared_rows(&self) -> crate::backend::SharedRows {
        crate::backend::SharedRows::new(PASS_SHARED_ROWS, LATER_PASS_SHARED_ROWS)
    }
    fn loops_sampling(&self, params: &SamplingParams) -> bool {
        self.lock().is_ok_and(|i| i.megakernel.as_ref().is_some_and(|mk| mk.in_service() && self.loops(mk, params)))
    }

    fn decode_path(&self, batch: usize, params: &SamplingParams) -> &'static str {
        let greedy = params.temperature == 0.0;
        match self.lock().map(|i| i.megakernel.as_ref().is_some_and(|mk| mk.in_service() && self.loops(mk, params))) {
            Ok(true) if batch == 1 => "megakernel",
            _ if greedy => "cuda-graph",
            _ if self.options.sampler == SamplerPlacement::Device => "cuda-graph + device sampler",
            _ => "cuda-graph + host sampler",
        }
    }

    fn forward_argmax(&self, chunks: &mut [Chunk<'_>]) -> Result<Option<Vec<u32>>> {
        match self.run(chunks, Logits::Last, Pick::Argmax)? {
            PassOutput::Tokens(t) => Ok(Some(t)),
            PassOutput::Logits(_) => Err(RocketError::Internal("logits pass where argmax was asked for".into())),
        }
    }

    fn forward_sample(&self, chunks: &mut [Chunk<'_>], requests: &[SampleRequest<'_>]) -> Result<Option<Vec<u32>>> {
        if self.options.sampler == SamplerPlacement::Host {
            return Ok(None);
        }
        match self.run(chunks, Logits::Last, Pick::Sample(requests))? {
            PassOutput::Tokens(t) => Ok(Some(t)),
            PassOutput::Logits(_) => Err(RocketError::Internal("logits pass where sampling was asked for".into())),
        }
    }
}

impl CudaBackend {
    /// `decode_loop`'s launch on `session` from its current length. The
    /// diagnostics' teacher forcing passes `forced` (step t < forced.len() feeds
    /// forced[t] next instead of its pick) and `keep_logits` (every step's
    /// logits come back too); the product passes neither.
    fn loop_on_session(
        &self,
        session: &mut dyn Session,
        first: u32,
        req: &LoopRequest<'_>,
        forced: &[u32],
        keep_logits: bool,
        on_token: &mut dyn FnMut(u32, Option<TokenLogprob>) -> bool,
    ) -> Result<Option<(LoopOutcome, Option<Vec<f32>>)>> {
        let mut guard = self.lock()?;
        let inner = &mut *guard;
        let Some(mk) = inner.megakernel.as_mut() else { return Ok(None) };
        if !mk.in_service() {
            return Ok(None); // a launch failed earlier: CUDA graphs from here on
        }
        if req.sampling.as_ref().is_some_and(|s| !self.loops(mk, s.params)) {
            return Ok(None); // a large top-k: one CTA would sample while the others wait
        }
        let mut end_ids = req.end_ids.to_vec();
        end_ids.sort_unstable();
        end_ids.dedup();
        if end_ids.len() > MAX_END_IDS {
            return Ok(None); // more end ids than the device checks: the step-by-step path
        }
        let sess = own_session::<CudaSession>(session, "cuda")?;
        let max_steps = req.max_steps.min(sess.capacity - sess.len).min(MAX_LOOP_STEPS);
        if max_steps == 0 {
            return Err(RocketError::ContextOverflow { prompt_tokens: sess.len + 1, max_tokens: 0, limit: sess.capacity });
        }
        let launch = Launch {
            kv: sess.kv.ptr,
            capacity: sess.capacity,
            pos0: sess.len,
            first,
            req: LoopRequest { max_steps, end_ids: &end_ids, mask_end_steps: req.mask_end_steps, sampling: req.sampling },
            forced,
            keep_logits,
            trace_step: self.options.trace_step.filter(|&step| step < max_steps),
        };
        // Counted here so the session keeps the tokens handed on even if the launch fails later.
        let mut handed = 0;
        self.megakernel_launches.fetch_add(1, Ordering::Relaxed);
        let ran = mk.run(&inner.ctx, &inner.stream, &launch, &mut |_, t, lp| {
            handed += 1;
            on_token(t, lp)
        });
        sess.len += handed;
        if let Err(RocketError::Megakernel(MegakernelError::Watchdog { .. } | MegakernelError::CopyFault { .. } | MegakernelError::Hung { .. })) = &ran {
            self.watchdog_events.fetch_add(1, Ordering::Relaxed);
        }
        let (outcome, logits) = ran?;
        if let (Some(step), Some(stamps)) = (launch.trace_step, mk.last_trace.take()) {
            match Profile::from_trace(&mk.schedule, &stamps) {
                Ok(profile) => tracing::info!(step, position = sess.len - handed + step, "megakernel step profile (GpuOptions::trace_step)\n{profile}"),
                // A launch that stopped before the step leaves it unstamped.
                Err(e) => tracing::info!(step, error = %e, "no megakernel step profile"),
            }
        }
        Ok(Some((outcome, logits)))
    }
}

impl CudaBackend {
    /// Whether the megakernel's token loop takes requests sampled with `params`:
    /// those all SMs sample together (`SamplingParams::races_on_all_sms`: all
    /// but a top-k above 64); the others only when `GpuOptions::loop_sampling`
    /// asks (one CTA samples while the rest wait).
    fn loops(&self, mk: &Megakernel, params: &SamplingParams) -> bool {
        self.options.loop_sampling || params.races_on_all_sms(mk.vocab())
    }

    /// Device-to-device copy bandwidth in GB/s (read + write bytes per second),
    /// measured on a 1 GiB buffer: the roofline every decode figure is a ratio to.
    pub fn copy_bandwidth_gbs(&self) -> Result<f64> {
        let inner = self.lock()?;
        let bytes = 1usize << 30;
        let src = DeviceBuffer::alloc(&inner.ctx, bytes, "the bandwidth probe")?;
        let dst = DeviceBuffer::alloc(&inner.ctx, bytes, "the bandwidth probe")?;
        src.fill_u8(&inner.stream, 0x3c)?;
        let (start, end) = (driver::TimedEvent::new()?, driver::TimedEvent::new()?);
        let reps = 20;
        for _ in 0..3 {
            dst.copy_from(&inner.stream, &src)?;
        }
        start.record(&inner.stream)?;
        for _ in 0..reps {
            dst.copy_from(&inner.stream, &src)?;
        }
        end.record(&inner.stream)?;
        inner.stream.sync()?;
        let ms = start.elapsed_ms(&end)? as f64;
        Ok((2 * bytes * reps) as f64 / (ms / 1e3) / 1e9)
    }
}

/// Why CUDA is unavailable here, or None when a usable device exists.
pub fn unavailable_reason() -> Option<String> {
    Context::open(0).err().map(|e| e.to_string())
}

/// How many CUDA devices this process sees (`Devices::All` opens each).
pub fn device_count() -> Result<usize> {
    Context::device_count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_product_has_the_kernel_its_measurements_chose() {
        use ProductKernel::*;
        let (llama_gate_up, smollm2_qkv, smollm2_o) = ((16384, 2048), (960, 576), (576, 576));
        let pick = |m, offer, rows, (n, k): (usize, usize)| matmul_kernel(m, offer, rows, n, k);
        for offer in [CublasOffer::None, CublasOffer::Split, CublasOffer::F16] {
            // The fixed kernels, and the GEMV for one row.
            for rows in [1, 16, 128, 4096] {
                assert_eq!(pick(MatmulPath::Gemv, offer, rows, llama_gate_up), Gemv);
                assert_eq!(pick(MatmulPath::Tensor, offer, rows, llama_gate_up), Tensor);
                assert_eq!(pick(MatmulPath::Auto, offer, 1, llama_gate_up), Gemv);
            }
            // Passes of up to 32 rows stay on the tensor cores (decode batches below
            // `CUBLAS_MIN_ROWS` rows are offered no fp16 products: `fp16_offered`).
            assert_eq!(pick(MatmulPath::Auto, offer, 16, llama_gate_up), Tensor);
            assert_eq!(pick(MatmulPath::Auto, offer, 32, llama_gate_up), Tensor);
            if offer != CublasOffer::F16 {
                assert_eq!(pick(MatmulPath::Auto, offer, 127, llama_gate_up), Tensor);
            }
            assert_eq!(pick(MatmulPath::Cublas, offer, 127, llama_gate_up), Tensor);
            // `cublas`: every pass of 128 rows or more.
            assert_eq!(pick(MatmulPath::Cublas, offer, 128, smollm2_o), Cublas);
        }
        // `auto` without the library: the tensor cores.
        assert_eq!(pick(MatmulPath::Auto, CublasOffer::None, 4096, llama_gate_up), Tensor);
        // `auto` on the hi+lo split: products of 2^30 multiply-adds or more.
        let split = CublasOffer::Split;
        assert_eq!(pick(MatmulPath::Auto, split, 128, llama_gate_up), Cublas); // 4.3e9
        assert_eq!(pick(MatmulPath::Auto, split, 512, smollm2_qkv), Tensor); // 2.8e8
        assert_eq!(pick(MatmulPath::Auto, split, 4096, smollm2_qkv), Cublas); // 2.3e9
        assert_eq!(pick(MatmulPath::Auto, split, 64, (1 << 20, 1 << 20)), Tensor); // big, but a decode-sized pass
        assert_eq!(pick(MatmulPath::Auto, split, 128, (8192, 1024)), Cublas); // 128 x 8192 x 1024 = 2^30
        assert_eq!(pick(MatmulPath::Auto, split, 128, (8191, 1024)), Tensor);
        // `auto` on fp16 operands (offered to prompt passes, and decode passes of 128
        // rows or more): every product of a pass of 33 rows or more.
        let f16 = CublasOffer::F16;
        assert_eq!(pick(MatmulPath::Auto, f16, 128, smollm2_o), Cublas); // 4.2e7
        assert_eq!(pick(MatmulPath::Auto, f16, 512, smollm2_qkv), Cublas);
        assert_eq!(pick(MatmulPath::Auto, f16, 127, (1 << 20, 1024)), Cublas);
        assert_eq!(pick(MatmulPath::Auto, f16, 33, smollm2_o), Cublas);
        assert_eq!(pick(MatmulPath::Auto, f16, 32, llama_gate_up), Tensor);
        // The split keeps 128 rows, whatever the size; `cublas` keeps 128 rows on either.
        assert_eq!(pick(MatmulPath::Auto, split, 100, (1 << 20, 1 << 20)), Tensor);
        assert_eq!(pick(MatmulPath::Cublas, f16, 100, llama_gate_up), Tensor);
    }

    #[test]
    fn decode_batches_are_offered_no_fp16_products() {
        for rows in [1, 16, 33, 64, 127] {
            assert!(!fp16_offered(true, rows), "a decode pass of {rows} rows");
        }
        assert!(fp16_offered(true, CUBLAS_MIN_ROWS));
        for rows in [2, 33, 100, 4096] {
            assert!(fp16_offered(false, rows), "a prompt pass of {rows} rows");
        }
    }

    #[test]
    fn only_later_prompt_passes_alone_under_the_shared_rows_take_the_pinned_algorithm() {
        let pinned = AlgoChoice { rows: Some(PASS_SHARED_ROWS), candidate: 0 };
        for rows in [LATER_PASS_SHARED_ROWS, 132, 200, PASS_SHARED_ROWS - 1] {
            assert_eq!(pass_algo(false, true, rows), pinned, "a later prompt pass of {rows} rows");
            assert_eq!(pass_algo(false, false, rows), AlgoChoice::FIRST, "a first pass of {rows} rows");
            assert_eq!(pass_algo(true, true, rows), AlgoChoice::FIRST, "a pass with decode rows, of {rows} rows");
        }
        for rows in [PASS_SHARED_ROWS, 2048, 2559] {
            assert_eq!(pass_algo(false, true, rows), AlgoChoice::FIRST, "a later prompt pass of {rows} rows");
        }
    }

    #[test]
    fn staged_row_meta_has_the_layout_common_cuh_declares() {
        let mut bytes = vec![0xaau8; 20];
        put(&mut bytes, 2, RowMeta { position: 7, context: 8, kv_base: 0x1122_3344_5566_7788 });
        let mut want = vec![0xaau8; 2];
        want.extend(7i32.to_ne_bytes());
        want.extend(8i32.to_ne_bytes());
        want.extend(0x1122_3344_5566_7788u64.to_ne_bytes());
        want.extend([0xaa; 2]);
        assert_eq!(bytes, want);
    }

    #[test]
    fn staged_inputs_tables_are_aligned_and_disjoint() {
        assert_eq!(std::mem::size_of::<PrefillTile>(), 8, "attention_prefill.cu reads PrefillTile as two i32");
        for rows in [1usize, 2, 3, 5, 16, 17, 63, 100, 1000, 4097] {
            // (offset, bytes, alignment) of tokens, meta, row_map, split_rows, tiles.
            let tables = [
                (0, rows * 4, 4),
                (Scratch::meta_offset(rows), rows * std::mem::size_of::<RowMeta>(), 16),
                (Scratch::row_map_offset(rows), rows * 4, 4),
                (Scratch::split_rows_offset(rows), rows * 4, 4),
                (Scratch::tiles_offset(rows), rows * std::mem::size_of::<PrefillTile>(), 8),
            ];
            for w in tables.windows(2) {
                assert!(w[0].0 + w[0].1 <= w[1].0, "{rows} rows: tables overlap: {tables:?}");
            }
            for &(off, _, align) in &tables {
                assert_eq!(off % align, 0, "{rows} rows: a table at {off} is not {align}-byte aligned");
            }
            let (last, len, _) = tables[4];
            assert_eq!(Scratch::inputs_bytes(rows), last + len, "{rows} rows: the upload must cover the tile table");
        }
        let mut bytes = vec![0u8; 8];
        put(&mut bytes, 0, PrefillTile { first_row: 3, rows: 64 });
        assert_eq!(bytes, [3i32.to_ne_bytes(), 64i32.to_ne_bytes()].concat());
    }
}
