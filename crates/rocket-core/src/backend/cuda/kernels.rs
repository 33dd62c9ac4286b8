//! rocket's precompiled kernels (kernels/src, built by kernels/build.sh) and one
//! typed launcher per kernel, mirroring the launch contract in each .cu header.

use std::time::Instant;

use super::cublas::Cublas;
use super::driver::{Arg, Context, DeviceBuffer, Function, Module, Stream};
use super::gemm_f16::{gemm_f16_smem_bytes, F16GemmPlan, GEMM_F16_MT, GEMM_F16_THREADS};
use super::split_k::split_k;
use crate::error::{Result, RocketError};

/// Machine code for Hopper (sm_90a): loads without a JIT.
static CUBIN: &[u8] = include_bytes!("../../../../../kernels/build/rocket.sm_90a.cubin");
/// PTX for sm_90, JIT-compiled by the driver on other GPUs of compute capability >= 9.0.
static PTX: &[u8] = include_bytes!("../../../../../kernels/build/rocket.ptx");

/// Tokens per launch row of each GEMV instantiation, and the weight rows each
/// warp computes (kernels/src/gemv.cu `GEMV(N, R)`).
const GEMV_TILES: [u32; 5] = [1, 2, 4, 8, 16];
const GEMV_ROWS_PER_WARP: [u32; 5] = [1, 2, 2, 4, 2];

/// Input rows per CTA (16 MT) of each tensor-core GEMM instantiation
/// (kernels/src/gemm_tc.cu `GEMM_TC(MT)`), in this order.
const GEMM_TC_MT: [usize; 4] = [1, 2, 4, 5];
/// Weight rows per CTA, k per ring block and block size of gemm_tc.cu.
const GEMM_TILE_N: usize = 128;
const GEMM_KB: usize = 64;
const GEMM_THREADS: u32 = 256;
/// Passes of at most this many rows may split K; larger passes have enough
/// tiles to fill the GPU, and their partials would cost more than they save.
const GEMM_SPLIT_MAX_ROWS: usize = 256;
/// gemm_tc.cu's `MAX_SPLITS`.
const GEMM_MAX_SPLITS: usize = 8;

/// Dynamic shared memory of `gemm_tc_m{mt}` (gemm_tc.cu `Layout<MT>::BYTES`): the
/// ring of weight + f32 input + f32 norm-weight blocks (`Layout::STAGES` deep),
/// then two buffers of bf16 hi and lo inputs.
const fn gemm_tc_smem_bytes(mt: usize) -> usize {
    let m = 16 * mt;
    let stages = match mt {
        1 => 8,
        2 => 7,
        _ => 5,
    };
    stages * (GEMM_TILE_N * GEMM_KB * 2 + m * GEMM_KB * 4 + GEMM_KB * 4) + 2 * 2 * m * GEMM_KB * 2
}

/// How `gemm_tc` covers one product: the instantiation, the grid, and how many
/// ways K is split. The split depends only on (n, k) and the SM count, never on
/// the number of rows (up to `GEMM_SPLIT_MAX_ROWS`), so a row's result is the
/// same bits whatever else is in the pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GemmPlan {
    pub mt: usize,
    pub tiles_n: usize,
    pub tiles_m: usize,
    pub splits: usize,
}

impl GemmPlan {
    pub(crate) fn new(n: usize, k: usize, rows: usize, sms: usize) -> Self {
        // 65-80 rows (a 64-row prompt piece beside up to 16 decoding rows) in one
        // tile of 5: two tiles of 4 would stream every weight twice.
        let mt = match rows {
            0..=16 => 1,
            17..=32 => 2,
            65..=80 => 5,
            _ => 4,
        };
        let tiles_n = n.div_ceil(GEMM_TILE_N);
        let tiles_m = rows.div_ceil(16 * mt);
        // An SM runs ceil(tiles·s / sms) CTAs; a split's batch-16 partial is 16 KiB, as
        // much as one k block of 128 rows.
        let splits = if rows <= GEMM_SPLIT_MAX_ROWS { split_k(tiles_n, k / GEMM_KB, sms, GEMM_MAX_SPLITS) } else { 1 };
        GemmPlan { mt, tiles_n, tiles_m, splits }
    }

    /// Floats of split-K partials the launch writes (0 without a split): each
    /// split's partial tile, then its rows' sums of squares (the RMSNorm fusion).
    pub(crate) fn workspace_floats(&self) -> usize {
        if self.splits > 1 { self.tiles_n * self.tiles_m * self.splits * 16 * self.mt * (GEMM_TILE_N + 1) } else { 0 }
    }

    /// Arrival counters the launch uses (0 without a split).
    pub(crate) fn counters(&self) -> usize {
        if self.splits > 1 { self.tiles_n * self.tiles_m } else { 0 }
    }

    /// The most workspace floats and counters any pass of up to `rows` rows needs
    /// for the products `shapes` ((n, k) pairs).
    pub(crate) fn scratch_needs(shapes: &[(usize, usize)], rows: usize, sms: usize) -> (usize, usize) {
        // Padded rows, and so the need, only grow with rows; splits stop past GEMM_SPLIT_MAX_ROWS.
        let rows = rows.clamp(1, GEMM_SPLIT_MAX_ROWS);
        shapes.iter().fold((0, 0), |(ws, c), &(n, k)| {
            let p = GemmPlan::new(n, k, rows, sms);
            (ws.max(p.workspace_floats()), c.max(p.counters()))
        })
    }
}

/// The tensor-core GEMM's instantiations, allowed their shared memory, or why this
/// GPU cannot run them (then every matmul uses the GEMV, with a warning).
fn load_gemm_tc(module: &Module, ctx: &Context) -> std::result::Result<[Function; GEMM_TC_MT.len()], String> {
    load_instantiations(module, "gemm_tc", GEMM_TC_MT, gemm_tc_smem_bytes).map_err(|e| {
        let bytes = GEMM_TC_MT.iter().map(|&mt| gemm_tc_smem_bytes(mt)).max().unwrap_or(0);
        let why = format!("the tensor-core GEMM cannot be set up on {} (it needs up to {bytes} bytes of shared memory per block): {e}", ctx.name);
        tracing::warn!("{why}; every matmul uses the GEMV");
        why
    })
}

/// `{name}_m{mt}` for every instantiation in `mts`, each allowed `smem(mt)` bytes
/// of dynamic shared memory.
fn load_instantiations<const N: usize>(module: &Module, name: &str, mts: [usize; N], smem: fn(usize) -> usize) -> Result<[Function; N]> {
    let functions = mts
        .iter()
        .map(|&mt| {
            let func = module.function(&format!("{name}_m{mt}"))?;
            func.set_max_dynamic_smem(smem(mt))?;
            Ok(func)
        })
        .collect::<Result<Vec<Function>>>()?;
    functions.try_into().map_err(|_| RocketError::Internal(format!("{name}: not one function per instantiation")))
}

/// The fp16 GEMM's instantiations, allowed their shared memory, or why this GPU
/// cannot run them: they multiply on warpgroup MMAs, in the sm_90a cubin alone.
fn load_gemm_f16(module: &Module, ctx: &Context, cubin: bool) -> std::result::Result<[Function; GEMM_F16_MT.len()], String> {
    let loaded = if cubin {
        load_instantiations(module, "gemm_f16", GEMM_F16_MT, gemm_f16_smem_bytes).map_err(|e| format!("the fp16 GEMM cannot be set up on {}: {e}", ctx.name))
    } else {
        Err(format!("the fp16 GEMM runs on Hopper's warpgroup MMA (sm_90a), which {} lacks", ctx.name))
    };
    loaded.map_err(|why| {
        tracing::info!("{why}; cuBLASLt takes its products");
        why
    })
}

/// gemm_tc's split-K partials and arrival counters. The counters are zeroed here,
/// once; every launch leaves them zero, so they must never be poisoned.
pub(crate) struct GemmScratch {
    pub workspace: DeviceBuffer,
    counters: DeviceBuffer,
}

impl GemmScratch {
    /// Room for `workspace_floats` partials and `counters` counters (as
    /// `GemmPlan::scratch_needs` or one plan reports), the counters zeroed on `st`.
    pub(crate) fn alloc(ctx: &Context, st: &Stream, workspace_floats: usize, counters: usize) -> Result<Self> {
        let workspace = DeviceBuffer::alloc(ctx, workspace_floats * 4, "GEMM split-K partials")?;
        let counters = DeviceBuffer::alloc(ctx, counters * 4, "GEMM split-K counters")?;
        counters.fill_u8(st, 0)?;
        Ok(GemmScratch { workspace, counters })
    }

    fn holds(&self, plan: &GemmPlan) -> bool {
        plan.workspace_floats() * 4 <= self.workspace.bytes && plan.counters() * 4 <= self.counters.bytes
    }
}

/// What `gemm_tc` folds into a product besides y (+)= x · Wᵀ (gemm_tc.cu's header).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct GemmFusion {
    /// The product is of RMSNorm(x) with this norm weight (device address of
    /// k f32) and epsilon, rms_norm.cu's formula: x is the residual stream.
    pub norm: Option<(u64, f32)>,
    /// W is the fused gate|up [2 ff][k] and y [rows][ff] = silu(gate) · up.
    pub silu: bool,
}

impl GemmFusion {
    /// Whether the SiLU epilogue can take a gate|up of `n` rows: whole 128-row
    /// tiles of 64 gate + 64 up rows (gemm_tc.cu's header).
    pub(crate) fn silu_fits(n: usize) -> bool {
        n % GEMM_TILE_N == 0
    }
}

/// The arguments gemv.cu and gemm_tc.cu both take: (W, x, y, n, k, rows, accumulate).
#[allow(clippy::too_many_arguments)]
fn matmul_args(w: u64, x: u64, y: u64, n: usize, k: usize, rows: usize, accumulate: bool) -> [Arg; 7] {
    [Arg::Ptr(w), Arg::Ptr(x), Arg::Ptr(y), Arg::I32(n as i32), Arg::I32(k as i32), Arg::I32(rows as i32), Arg::I32(accumulate as i32)]
}

pub(crate) struct Kernels {
    module: Module,
    /// The tensor-core GEMM, or why this GPU cannot run it (its ring needs more
    /// shared memory per block than, e.g., a ~100 KiB consumer part allows).
    gemm_tc: std::result::Result<[Function; GEMM_TC_MT.len()], String>,
    /// The fp16 GEMM (gemm_f16.cu, sm_90a only), or why this GPU cannot run it
    /// (then cuBLASLt takes its products).
    gemm_f16: std::result::Result<[Function; GEMM_F16_MT.len()], String>,
    sms: usize,
    embed: Function,
    rms_norm: Function,
    rms_norm_f16: Function,
    gemv: [Function; 5],
    rope_kv: Function,
    attn_partial: Function,
    attn_merge: Function,
    attn_prefill: Function,
    /// Dynamic shared memory of `attn_prefill`'s variant.
    attn_prefill_smem: u32,
    attn_prefill_merge: Function,
    silu_mul: Function,
    silu_mul_f16: Function,
    to_bf16_split: Function,
    to_f16: Function,
    bf16_to_f16: Function,
    argmax: Function,
    sample: Function,
    sample_topk_lists: Function,
    sample_topk_rows: Function,
    sample_bins_max: Function,
    sample_bins_parts: Function,
    sample_bins_rows: Function,
    head_dim: u32,
    /// cuBLASLt (backend/cuda/cublas.rs): loaded for `MatmulPath::Cublas`, and
    /// for `Auto` where the library is found.
    pub cublas: Option<Cublas>,
    /// Launch every kernel as a programmatic dependent launch (common.cuh
    /// `pdl_wait`): its CTAs start, and the GEMM's weights stream, while the
    /// previous kernel finishes. `GpuOptions::pdl` off turns it off.
    pub pdl: bool,
    /// "sm_90a cubin" or "sm_90 PTX (JIT)", and how long loading took.
    pub image: &'static str,
    pub load_seconds: f64,
}

impl Kernels {
    /// `wgmma_attention`: the prompt attention on warpgroup MMAs where the sm_90a
    /// cubin has them (`GpuOptions::wgmma_attention`).
    pub(crate) fn load(ctx: &Context, head_dim: usize, wgmma_attention: bool) -> Result<Self> {
        if ![32, 64, 128].contains(&head_dim) {
            return Err(RocketError::Device(format!(
                "head_dim {head_dim} has no CUDA attention kernel (supported: 32, 64, 128)"
            )));
        }
        let start = Instant::now();
        let cubin = ctx.compute_capability == (9, 0);
        let (module, image) = if cubin {
            (Module::load(CUBIN)?, "sm_90a cubin")
        } else {
            let mut ptx = PTX.to_vec();
            ptx.push(0);
            (Module::load(&ptx)?, "sm_90 PTX (JIT)")
        };
        let f = |name: &str| module.function(name);
        // The warpgroup-MMA prompt attention is in the sm_90a cubin alone.
        let wgmma = wgmma_attention && cubin && prefill_has_wgmma(head_dim);
        let prefill_smem = prefill_smem_bytes(head_dim, wgmma);
        let gemv = [f("gemv_bf16_t1")?, f("gemv_bf16_t2")?, f("gemv_bf16_t4")?, f("gemv_bf16_t8")?, f("gemv_bf16_t16")?];
        let gemm_tc = load_gemm_tc(&module, ctx);
        let gemm_f16 = load_gemm_f16(&module, ctx, cubin);
        Ok(Kernels {
            gemm_tc,
            gemm_f16,
            sms: ctx.sm_count.max(1) as usize,
            embed: f("embed_gather")?,
            rms_norm: f("rms_norm")?,
            rms_norm_f16: f("rms_norm_f16")?,
            gemv,
            rope_kv: f(if head_dim <= 64 { "rope_store_kv_hd64" } else { "rope_store_kv_hd128" })?,
            attn_partial: f(&format!("attn_partial_hd{head_dim}"))?,
            attn_merge: f(&format!("attn_merge_hd{head_dim}"))?,
            attn_prefill: {
                let func = f(&prefill_kernel_name(head_dim, wgmma))?;
                // hd128's buffers (68-97 KiB) are over the 48 KiB a launch gets without asking.
                func.set_max_dynamic_smem(prefill_smem)?;
                func
            },
            attn_prefill_smem: prefill_smem as u32,
            attn_prefill_merge: f(&format!("attn_prefill_merge_hd{head_dim}"))?,
            silu_mul: f("silu_mul")?,
            silu_mul_f16: f("silu_mul_f16")?,
            to_bf16_split: f("to_bf16_split")?,
            to_f16: f("to_f16")?,
            bf16_to_f16: f("bf16_to_f16")?,
            argmax: f("argmax")?,
            sample: f("sample_rows")?,
            sample_topk_lists: f("sample_topk_lists")?,
            sample_topk_rows: f("sample_topk_rows")?,
            sample_bins_max: f("sample_bins_max")?,
            sample_bins_parts: f("sample_bins_parts")?,
            sample_bins_rows: f("sample_bins_rows")?,
            head_dim: head_dim as u32,
            cublas: None,
            pdl: true,
            image,
            load_seconds: start.elapsed().as_secs_f64(),
            module,
        })
    }

    /// The loaded module (the megakernel's functions live in it too).
    pub(crate) fn module(&self) -> &Module {
        &self.module
    }

    pub(crate) fn embed(&self, s: &Stream, table: u64, tokens: u64, x: u64, hidden: usize, rows: usize) -> Result<()> {
        self.go(&self.embed, s, (rows as u32, 1, 1), 256, 0, &[Arg::Ptr(table), Arg::Ptr(tokens), Arg::Ptr(x), Arg::I32(hidden as i32)])
    }

    /// `row_map` 0 means output row i normalises input row i.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rms_norm(&self, s: &Stream, x: u64, w: u64, out: u64, dim: usize, eps: f32, row_map: u64, rows: usize) -> Result<()> {
        let args = [Arg::Ptr(x), Arg::Ptr(w), Arg::Ptr(out), Arg::I32(dim as i32), Arg::F32(eps), Arg::Ptr(row_map)];
        self.go(&self.rms_norm, s, (rows as u32, 1, 1), Self::rms_norm_block(dim), 0, &args)
    }

    /// rms_norm's values rounded to fp16 (the bits of `rms_norm` then `to_f16`),
    /// for a cuBLASLt product on fp16 operands; a finite value past fp16's range
    /// sets the u32 at `overflow` (rms_norm.cu).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rms_norm_f16(&self, s: &Stream, x: u64, w: u64, out: u64, dim: usize, eps: f32, rows: usize, overflow: u64) -> Result<()> {
        let args = [Arg::Ptr(x), Arg::Ptr(w), Arg::Ptr(out), Arg::I32(dim as i32), Arg::F32(eps), Arg::Ptr(overflow)];
        self.go(&self.rms_norm_f16, s, (rows as u32, 1, 1), Self::rms_norm_block(dim), 0, &args)
    }

    /// Two float4 chunks of a row per thread (rms_norm.cu keeps up to four in
    /// registers), 1 to 8 warps.
    fn rms_norm_block(dim: usize) -> u32 {
        dim.div_ceil(8).div_ceil(32).clamp(1, 8) as u32 * 32
    }

    /// 256 threads of four elements each per 1,024 of a row (silu_mul.cu).
    fn silu_grid(ff: usize, rows: usize) -> (u32, u32, u32) {
        (ff.div_ceil(1024) as u32, rows as u32, 1)
    }

    /// y [rows][n] (+)= x [rows][k] · W[n][k]ᵀ.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv(&self, s: &Stream, w: u64, x: u64, y: u64, n: usize, k: usize, rows: usize, accumulate: bool) -> Result<()> {
        debug_assert!(k % 8 == 0);
        let tile = GEMV_TILES.iter().position(|&t| t as usize >= rows).unwrap_or(GEMV_TILES.len() - 1);
        let rows_per_block = 8 * GEMV_ROWS_PER_WARP[tile] as usize;
        let grid = (n.div_ceil(rows_per_block) as u32, rows.div_ceil(GEMV_TILES[tile] as usize) as u32, 1);
        self.go(&self.gemv[tile], s, grid, 256, 0, &matmul_args(w, x, y, n, k, rows, accumulate))
    }

    /// Whether `gemm_tc` runs on this GPU and can multiply rows of `k` weights
    /// (64-wide blocks); where not, matmuls fall back to the GEMV.
    pub(crate) fn gemm_tc_fits(&self, k: usize) -> bool {
        self.gemm_tc.is_ok() && k % 64 == 0
    }

    /// The plan `gemm_tc` follows for this product on this GPU.
    pub(crate) fn gemm_plan(&self, n: usize, k: usize, rows: usize) -> GemmPlan {
        GemmPlan::new(n, k, rows, self.sms)
    }

    /// y [rows][n] (+)= x [rows][k] · W[n][k]ᵀ on the tensor cores (bf16 hi+lo split
    /// inputs, f32 accumulation), with `fusion`'s prologue and epilogue;
    /// `gemm_tc_fits(k)` must hold, and `scratch` must hold what `gemm_plan(n, k, rows)` needs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_tc(
        &self,
        s: &Stream,
        w: u64,
        x: u64,
        y: u64,
        n: usize,
        k: usize,
        rows: usize,
        accumulate: bool,
        scratch: &GemmScratch,
        fusion: GemmFusion,
    ) -> Result<()> {
        let functions = self.gemm_tc.as_ref().map_err(|why| RocketError::Device(why.clone()))?;
        if k % 64 != 0 {
            return Err(RocketError::Internal(format!("gemm_tc needs k % 64 == 0, got {k}")));
        }
        if fusion.silu && (!GemmFusion::silu_fits(n) || accumulate) {
            return Err(RocketError::Internal(format!("gemm_tc's SiLU epilogue needs n % 128 == 0 and no accumulate, got n = {n}")));
        }
        let plan = self.gemm_plan(n, k, rows);
        if plan.splits > GEMM_MAX_SPLITS.min(k / GEMM_KB) {
            return Err(RocketError::Internal(format!("gemm_tc cannot split {k} columns {} ways", plan.splits)));
        }
        if !scratch.holds(&plan) {
            return Err(RocketError::Internal(format!("gemm_tc scratch too small for {plan:?} ({n} x {k}, {rows} rows)")));
        }
        let i = GEMM_TC_MT.iter().position(|&mt| mt == plan.mt).expect("instantiated shape");
        let grid = (plan.tiles_n as u32, plan.tiles_m as u32, plan.splits as u32);
        let [a0, a1, a2, a3, a4, a5, a6] = matmul_args(w, x, y, n, k, rows, accumulate);
        let (norm_w, eps) = fusion.norm.unwrap_or((0, 0.0));
        let args = [
            a0,
            a1,
            a2,
            a3,
            a4,
            a5,
            a6,
            Arg::Ptr(scratch.workspace.ptr),
            Arg::Ptr(scratch.counters.ptr),
            Arg::Ptr(norm_w),
            Arg::F32(eps),
            Arg::I32(fusion.silu as i32),
        ];
        self.go(&functions[i], s, grid, GEMM_THREADS, gemm_tc_smem_bytes(plan.mt) as u32, &args)
    }

    /// Whether `gemm_f16` runs on this GPU and takes an n x k matrix.
    pub(crate) fn gemm_f16_fits(&self, n: usize, k: usize) -> bool {
        self.gemm_f16.is_ok() && F16GemmPlan::fits(n, k)
    }

    /// The plan `gemm_f16` follows for this product on this GPU.
    pub(crate) fn gemm_f16_plan(&self, n: usize, k: usize, rows: usize) -> F16GemmPlan {
        F16GemmPlan::new(n, k, rows, self.sms)
    }

    /// y [rows][n] (+)= x [rows][k] · W[n][k]ᵀ for fp16 x and W (the weights'
    /// fp16 copy), f32 accumulation (gemm_f16.cu); `gemm_f16_fits(n, k)` must
    /// hold. A split tile's splits run as one thread block cluster and sum their
    /// partials in shared memory: no scratch.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_f16(&self, s: &Stream, w16: u64, x16: u64, y: u64, n: usize, k: usize, rows: usize, accumulate: bool) -> Result<()> {
        let functions = self.gemm_f16.as_ref().map_err(|why| RocketError::Device(why.clone()))?;
        if rows == 0 {
            return Ok(());
        }
        if !F16GemmPlan::fits(n, k) {
            return Err(RocketError::Internal(format!("gemm_f16 needs n % 8 == 0 and k % 64 == 0, got {n} x {k}")));
        }
        let plan = self.gemm_f16_plan(n, k, rows);
        let grid = (plan.tiles_n as u32, plan.tiles_m as u32, plan.splits as u32);
        let args = matmul_args(w16, x16, y, n, k, rows, accumulate);
        let smem = gemm_f16_smem_bytes(plan.mt) as u32;
        functions[plan.instantiation()].launch_in_clusters(s, grid, plan.splits as u32, GEMM_F16_THREADS, smem, self.pdl, &args)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rope_kv(
        &self,
        s: &Stream,
        qkv: u64,
        inv_freq: u64,
        q_norm: u64,
        k_norm: u64,
        eps: f32,
        meta: u64,
        n_heads: usize,
        n_kv: usize,
        layer: usize,
        n_layers: usize,
        rows: usize,
    ) -> Result<()> {
        let args = [
            Arg::Ptr(qkv),
            Arg::Ptr(inv_freq),
            Arg::Ptr(q_norm),
            Arg::Ptr(k_norm),
            Arg::F32(eps),
            Arg::Ptr(meta),
            Arg::I32(n_heads as i32),
            Arg::I32(n_kv as i32),
            Arg::I32(self.head_dim as i32),
            Arg::I32(layer as i32),
            Arg::I32(n_layers as i32),
        ];
        // rope_kv.cu: a block of ROPE_WARPS = 8 warps per row (the kernel for the
        // head_dim, which `load` limits to 32, 64 and 128).
        self.go(&self.rope_kv, s, (rows as u32, 1, 1), 256, 0, &args)
    }

    /// Attention of q (rows `q_stride` apart) into out [rows][n_heads*hd], split
    /// into `splits` chunks of `chunk` positions merged through `part_o`/`part_ml`:
    /// for the `rows` rows listed at `row_index` (i32 each), or rows 0..rows when
    /// `row_index` is 0.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention(
        &self,
        s: &Stream,
        q: u64,
        q_stride: usize,
        meta: u64,
        row_index: u64,
        part_o: u64,
        part_ml: u64,
        out: u64,
        n_heads: usize,
        n_kv: usize,
        layer: usize,
        n_layers: usize,
        chunk: usize,
        splits: usize,
        rows: usize,
    ) -> Result<()> {
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let args = [
            Arg::Ptr(q),
            Arg::I32(q_stride as i32),
            Arg::Ptr(meta),
            Arg::Ptr(row_index),
            Arg::Ptr(part_o),
            Arg::Ptr(part_ml),
            Arg::I32(n_heads as i32),
            Arg::I32(n_kv as i32),
            Arg::I32(layer as i32),
            Arg::I32(n_layers as i32),
            Arg::I32(chunk as i32),
            Arg::F32(scale),
        ];
        self.go(&self.attn_partial, s, (n_heads as u32, rows as u32, splits as u32), 128, 0, &args)?;
        let args = [Arg::Ptr(part_o), Arg::Ptr(part_ml), Arg::Ptr(row_index), Arg::Ptr(out), Arg::I32(n_heads as i32), Arg::I32(splits as i32)];
        self.go(&self.attn_merge, s, (n_heads as u32, rows as u32, 1), self.head_dim, 0, &args)
    }

    /// Causal attention of prompt rows on the tensor cores (attention_prefill.cu):
    /// `tiles` PrefillTile entries at `tile_table`, each up to PREFILL_TILE
    /// consecutive rows of one sequence, into out [rows][n_heads*hd]. A CTA walks
    /// one PREFILL_SPAN of key positions; tiles whose context spans several
    /// (`max_splits` at most, `prefill_splits`) leave partials in `part_o` /
    /// `part_ml` (`prefill_partial_floats`) for the merge that follows. With
    /// `out16` = (operand, range flag), the output goes to the operand rounded to
    /// fp16 (as `to_f16` would round `out`) instead of to `out`, and a value past
    /// fp16's range sets the flag's u32.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention_prefill(
        &self,
        s: &Stream,
        q: u64,
        q_stride: usize,
        meta: u64,
        tile_table: u64,
        out: u64,
        (part_o, part_ml): (u64, u64),
        n_heads: usize,
        n_kv: usize,
        layer: usize,
        n_layers: usize,
        tiles: usize,
        max_splits: usize,
        out16: Option<(u64, u64)>,
    ) -> Result<()> {
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        let (out16, flag) = out16.unwrap_or((0, 0));
        let span = PREFILL_SPAN as i32;
        let args = [
            Arg::Ptr(q),
            Arg::I32(q_stride as i32),
            Arg::Ptr(meta),
            Arg::Ptr(tile_table),
            Arg::Ptr(out),
            Arg::Ptr(part_o),
            Arg::Ptr(part_ml),
            Arg::I32(n_heads as i32),
            Arg::I32(n_kv as i32),
            Arg::I32(layer as i32),
            Arg::I32(n_layers as i32),
            Arg::I32(span),
            Arg::F32(scale),
            Arg::Ptr(out16),
            Arg::Ptr(flag),
        ];
        let smem = self.attn_prefill_smem;
        let grid = (tiles as u32, n_heads as u32, max_splits.max(1) as u32);
        self.go(&self.attn_prefill, s, grid, PREFILL_THREADS, smem, &args)?;
        if max_splits > 1 {
            let args = [
                Arg::Ptr(meta),
                Arg::Ptr(tile_table),
                Arg::Ptr(part_o),
                Arg::Ptr(part_ml),
                Arg::Ptr(out),
                Arg::I32(n_heads as i32),
                Arg::I32(span),
                Arg::I32(max_splits as i32),
                Arg::Ptr(out16),
                Arg::Ptr(flag),
            ];
            // attention_prefill.cu PREFILL_MERGE_ROWS: a CTA merges 512 / head_dim rows.
            let row_groups = self.head_dim / 8;
            self.go(&self.attn_prefill_merge, s, (tiles as u32, n_heads as u32, row_groups), PREFILL_THREADS, 0, &args)?;
        }
        Ok(())
    }

    pub(crate) fn silu_mul(&self, s: &Stream, gu: u64, out: u64, ff: usize, rows: usize) -> Result<()> {
        self.go(&self.silu_mul, s, Self::silu_grid(ff, rows), 256, 0, &[Arg::Ptr(gu), Arg::Ptr(out), Arg::I32(ff as i32)])
    }

    /// silu_mul's values rounded to fp16 (the bits of `silu_mul` then `to_f16`),
    /// for the down-projection on cuBLASLt's fp16 operands; a finite value past
    /// fp16's range sets the u32 at `overflow` (silu_mul.cu).
    pub(crate) fn silu_mul_f16(&self, s: &Stream, gu: u64, out: u64, ff: usize, rows: usize, overflow: u64) -> Result<()> {
        let args = [Arg::Ptr(gu), Arg::Ptr(out), Arg::I32(ff as i32), Arg::Ptr(overflow)];
        self.go(&self.silu_mul_f16, s, Self::silu_grid(ff, rows), 256, 0, &args)
    }

    /// hi[i] = x[i] as bf16 (round to nearest even) and lo[i] = x[i] - hi[i] as
    /// bf16, for i < n: the cuBLASLt path's inputs, in `parts` (2n bf16: the hi
    /// parts, then the lo parts). Returns where each starts.
    pub(crate) fn to_bf16_split(&self, s: &Stream, x: u64, parts: u64, n: usize) -> Result<(u64, u64)> {
        if n > i32::MAX as usize {
            return Err(RocketError::Internal(format!("to_bf16_split of {n} elements (at most 2^31 - 1)")));
        }
        let (hi, lo) = (parts, parts + (2 * n) as u64);
        let args = [Arg::Ptr(x), Arg::Ptr(hi), Arg::Ptr(lo), Arg::I32(n as i32)];
        self.go(&self.to_bf16_split, s, (n.div_ceil(1024) as u32, 1, 1), 256, 0, &args)?;
        Ok((hi, lo))
    }

    /// y = x (f32) rounded to fp16, for cuBLASLt's fp16 products; a finite value
    /// past fp16's range sets the u32 at `overflow` (to_f16.cu).
    pub(crate) fn to_f16(&self, s: &Stream, x: u64, y: u64, n: usize, overflow: u64) -> Result<()> {
        let n = Self::elementwise_len("to_f16", n)?;
        self.go(&self.to_f16, s, (n.div_ceil(1024) as u32, 1, 1), 256, 0, &[Arg::Ptr(x), Arg::Ptr(y), Arg::I32(n as i32), Arg::Ptr(overflow)])
    }

    /// y = x (bf16) as fp16: the weights' copy for cuBLASLt's fp16 products; a
    /// weight past fp16's range sets the u32 at `overflow` (to_f16.cu).
    pub(crate) fn bf16_to_f16(&self, s: &Stream, x: u64, y: u64, n: usize, overflow: u64) -> Result<()> {
        let n = Self::elementwise_len("bf16_to_f16", n)?;
        self.go(&self.bf16_to_f16, s, (n.div_ceil(1024) as u32, 1, 1), 256, 0, &[Arg::Ptr(x), Arg::Ptr(y), Arg::I32(n as i32), Arg::Ptr(overflow)])
    }

    /// The element count of an elementwise kernel that indexes with an i32 (its
    /// last CTA's threads count up to n + 1,023).
    fn elementwise_len(what: &str, n: usize) -> Result<usize> {
        if n > i32::MAX as usize - 1024 {
            return Err(RocketError::Internal(format!("{what} of {n} elements (at most 2^31 - 1,025)")));
        }
        Ok(n)
    }

    /// out[r] = argmax of logits row r; `state` holds `argmax_state_bytes(rows)`
    /// zeroed bytes (per-row keys and counters, left zero by every launch).
    pub(crate) fn argmax(&self, s: &Stream, logits: u64, out: u64, vocab: usize, rows: usize, state: u64) -> Result<()> {
        let grid = (vocab.div_ceil(ARGMAX_SPAN) as u32, rows as u32, 1);
        let args = [Arg::Ptr(logits), Arg::Ptr(out), Arg::I32(vocab as i32), Arg::Ptr(state), Arg::Ptr(state + 8 * rows as u64)];
        self.go(&self.argmax, s, grid, ARGMAX_THREADS, 0, &args)
    }

    /// One launch of `f`, programmatic (early) when `pdl` is on.
    fn go(&self, f: &Function, s: &Stream, grid: (u32, u32, u32), block: u32, smem: u32, args: &[Arg]) -> Result<()> {
        f.launch_ex(s, grid, block, smem, self.pdl, args)
    }

    /// out[r] = the host sampler's token for logits row r (modified in place by
    /// the penalties) and request `rows[r]`, each row through the kernels its
    /// `path` names (`SamplePath`); `paths` says which paths the rows use, so
    /// only their kernels launch. `items` holds SAMPLE_ITEM_BYTES × vocab bytes
    /// per row, `lists` SAMPLE_LIST_BYTES and `bins` SAMPLE_BIN_BYTES.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sample(&self, s: &Stream, logits: u64, inputs: &SampleInputs, scratch: &SampleScratch, out: u64, vocab: usize, rows: usize, paths: &[SamplePath]) -> Result<()> {
        let per_row = (rows as u32, 1, 1);
        let per_part = (SAMPLE_PARTS as u32, rows as u32, 1);
        let row_inputs = [Arg::Ptr(logits), Arg::Ptr(inputs.rows), Arg::Ptr(inputs.penalty_tokens), Arg::Ptr(inputs.penalty_counts), Arg::Ptr(inputs.mask_ids)];
        let vocab = Arg::I32(vocab as i32);
        let with = |tail: &[Arg]| -> Vec<Arg> { row_inputs.iter().chain(tail).copied().collect() };
        if paths.contains(&SamplePath::Whole) {
            self.go(&self.sample, s, per_row, SAMPLE_THREADS, 0, &with(&[Arg::Ptr(scratch.items), Arg::Ptr(out), vocab]))?;
        }
        if paths.contains(&SamplePath::Lists) {
            self.go(&self.sample_topk_lists, s, per_part, SAMPLE_LIST_THREADS, 0, &with(&[Arg::Ptr(scratch.items), Arg::Ptr(scratch.lists), vocab]))?;
            let args = [Arg::Ptr(scratch.lists), Arg::Ptr(inputs.rows), Arg::Ptr(scratch.items), Arg::Ptr(out), vocab];
            self.go(&self.sample_topk_rows, s, per_row, SAMPLE_THREADS, 0, &args)?;
        }
        if paths.contains(&SamplePath::Bins) {
            self.go(&self.sample_bins_max, s, per_part, SAMPLE_LIST_THREADS, 0, &with(&[Arg::Ptr(scratch.bins), vocab]))?;
            let args = [Arg::Ptr(logits), Arg::Ptr(inputs.rows), Arg::Ptr(scratch.bins), vocab];
            self.go(&self.sample_bins_parts, s, per_part, SAMPLE_LIST_THREADS, 0, &args)?;
            let args = [Arg::Ptr(scratch.bins), Arg::Ptr(inputs.rows), Arg::Ptr(out)];
            self.go(&self.sample_bins_rows, s, per_row, SAMPLE_THREADS, 0, &args)?;
        }
        Ok(())
    }
}

/// Query rows per CTA of `attn_prefill` (attention_prefill.cu PREFILL_TILE), and its block size.
pub(crate) const PREFILL_TILE: usize = 64;
const PREFILL_THREADS: u32 = 128;

/// Key positions one `attn_prefill` CTA walks (its context split). A row's bits
/// depend on it, so it is a constant: it lets a few rows deep in a long context
/// (a prompt's piece beside decoding streams) spread over every SM, while the
/// partials it costs stay a few percent of a long pass's traffic (a 512-row pass
/// at 16K positions writes and reads ~70 MB per layer).
pub(crate) const PREFILL_SPAN: usize = 1024;

/// Context splits of the tensor-core prefill attention for a tile whose last
/// row has `context` positions (attention_prefill.cu: `(end + span - 1) / span`).
pub(crate) const fn prefill_splits(context: usize) -> usize {
    context.div_ceil(PREFILL_SPAN)
}

/// (tile, split) items of partials one prefill attention launch may leave: a
/// pass with more tiles launches it over groups of tiles that reuse the space
/// (~70 MB for Llama-3.2-1B; a 512-row pass at 16K positions needs 128 items).
pub(crate) const PREFILL_PARTIAL_ITEMS: usize = 128;

/// Tiles per prefill attention launch when a tile has up to `max_splits` splits.
pub(crate) const fn prefill_group_tiles(max_splits: usize) -> usize {
    if max_splits <= 1 {
        usize::MAX
    } else if max_splits >= PREFILL_PARTIAL_ITEMS {
        1
    } else {
        PREFILL_PARTIAL_ITEMS / max_splits
    }
}

/// f32 values of the prefill attention's partials for `tiles` tiles of up to
/// `max_splits` splits: (part_o, part_ml), laid out per (tile, head, split) item.
pub(crate) const fn prefill_partial_floats(tiles: usize, n_heads: usize, max_splits: usize, head_dim: usize) -> (usize, usize) {
    let rows = tiles * n_heads * max_splits * PREFILL_TILE;
    (rows * head_dim, rows * 2)
}

/// Whether head_dim has the warpgroup-MMA prompt attention (attention_prefill_wg.cu,
/// Hopper's sm_90a cubin): its K and V tiles are whole 64-dimension swizzle atoms.
const fn prefill_has_wgmma(head_dim: usize) -> bool {
    head_dim == 64 || head_dim == 128
}

/// The prompt attention's kernel: `attn_prefill_wg_hd{head_dim}` (wgmma) or
/// `attn_prefill_hd{head_dim}` (mma.sync, every GPU).
fn prefill_kernel_name(head_dim: usize, wgmma: bool) -> String {
    if wgmma {
        format!("attn_prefill_wg_hd{head_dim}")
    } else {
        format!("attn_prefill_hd{head_dim}")
    }
}

/// Dynamic shared memory of the prompt attention: two buffers of keys and values,
/// rows of head_dim + 8 bf16 (attention_prefill.cu `PREFILL_SMEM_BYTES`), or with
/// wgmma the same unpadded and swizzled, the queries' hi and lo tiles beside them,
/// and 1 KiB to align them to the swizzle's 1,024-byte pattern
/// (attention_prefill_wg.cu `PREFILL_WG_SMEM_BYTES`).
const fn prefill_smem_bytes(head_dim: usize, wgmma: bool) -> usize {
    if wgmma {
        3 * 2 * PREFILL_TILE * head_dim * 2 + 1024
    } else {
        2 * 2 * PREFILL_TILE * (head_dim + 8) * 2
    }
}

/// Block size and logits per CTA of `argmax` (kernels/src/argmax.cu).
const ARGMAX_THREADS: u32 = 256;
const ARGMAX_SPAN: usize = ARGMAX_THREADS as usize * 16;

/// Bytes of `argmax`'s per-row state for passes of up to `rows` rows.
pub(crate) const fn argmax_state_bytes(rows: usize) -> usize {
    rows * 12
}

/// Threads per row of `sample_rows` (kernels/src/sample.cu SAMPLE_THREADS).
const SAMPLE_THREADS: u32 = 1024;

/// CTAs per row of `sample_topk_lists`, the longest list each keeps (the
/// largest top-k that path serves), and its block size (kernels/src/sample.cu).
pub(crate) const SAMPLE_PARTS: usize = 32;
pub(crate) const SAMPLE_LIST_K: usize = 64;
const SAMPLE_LIST_THREADS: u32 = 256;

/// Bytes of one row's top-k lists: SAMPLE_PARTS lists of SAMPLE_LIST_K u64 keys.
pub(crate) const SAMPLE_LIST_BYTES: usize = SAMPLE_PARTS * SAMPLE_LIST_K * 8;

/// Bytes of one compacted candidate (kernels/src/sample.cu SampleItem).
pub(crate) const SAMPLE_ITEM_BYTES: usize = 8;

/// Bins below a row's top one that can hold weight (sampler.cuh RACE_MASS_BINS:
/// a weighed token's scaled logit is within 32 nats of the top, 16 bins a nat).
pub(crate) const SAMPLE_MASS_BINS: usize = 520;

/// u64 words one part of a row leaves for the bins path (sample.cu
/// SAMPLE_BIN_WORDS): mass and best key per bin, the best key below the bins,
/// the argmax key and the top logit's order key.
pub(crate) const SAMPLE_BIN_WORDS: usize = 2 * SAMPLE_MASS_BINS + 3;

/// Bytes of one row's bins-path partials: SAMPLE_PARTS parts of SAMPLE_BIN_WORDS.
pub(crate) const SAMPLE_BIN_BYTES: usize = SAMPLE_PARTS * SAMPLE_BIN_WORDS * 8;

/// Which kernels pick a row (sample.cu SAMPLE_PATH_*, the value of `SampleRow::path`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub(crate) enum SamplePath {
    /// One CTA walks the whole row (sample_rows).
    Whole = 0,
    /// SAMPLE_PARTS CTAs list their slice's k best, one CTA picks (sample_topk_*).
    Lists = 1,
    /// SAMPLE_PARTS CTAs sum their slice's bins and race, one CTA merges (sample_bins_*).
    Bins = 2,
}

/// Device scratch of the sampler's paths.
pub(crate) struct SampleScratch {
    pub items: u64,
    pub lists: u64,
    pub bins: u64,
}

/// One row's sampling request, laid out as kernels/src/sample.cu `SampleRow`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SampleRow {
    pub seed: u64,
    pub step: u64,
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub top_k: u32,
    pub penalty_off: u32,
    pub penalty_len: u32,
    pub mask_off: u32,
    pub mask_len: u32,
    /// A `SamplePath` (0 in the megakernel, which samples its own way).
    pub path: u32,
}
const _: () = assert!(std::mem::size_of::<SampleRow>() == 64, "SampleRow must match sample.cu");

/// Device addresses of the per-row requests and their penalty and mask lists.
pub(crate) struct SampleInputs {
    pub rows: u64,
    pub penalty_tokens: u64,
    pub penalty_counts: u64,
    pub mask_ids: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    const H200_SMS: usize = 132;
    /// Llama-3.2-1B's products: qkv, O, gate|up, down, LM head.
    const LLAMA: [(usize, usize); 5] = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128_256, 2048)];

    /// The prefill attention's tile and block size, as attention_prefill.cu
    /// defines them: a host tile longer than the kernel's would leave rows unwritten.
    #[test]
    fn prefill_attention_constants_are_the_kernels() {
        let src = include_str!("../../../../../kernels/src/attention_prefill.cu");
        let define = |name: &str| -> usize {
            let prefix = format!("#define {name} ");
            let line = src.lines().find_map(|l| l.strip_prefix(prefix.as_str())).unwrap_or_else(|| panic!("no #define {name}"));
            line.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("#define {name} {line}"))
        };
        assert_eq!(define("PREFILL_TILE"), PREFILL_TILE);
        assert_eq!(define("PREFILL_THREADS"), PREFILL_THREADS as usize);
        // The launch's dynamic shared memory is the kernel's two buffers.
        let smem = src.lines().find_map(|l| l.strip_prefix("#define PREFILL_SMEM_BYTES(D) ")).expect("no PREFILL_SMEM_BYTES");
        assert_eq!(smem.split("//").next().unwrap().trim(), "(2 * 2 * PREFILL_TILE * ((D) + 8) * 2)");
        assert_eq!([32, 64, 128].map(|hd| prefill_smem_bytes(hd, false)), [20_480, 36_864, 69_632]);
        let wg = include_str!("../../../../../kernels/src/attention_prefill_wg.cu");
        let smem = wg.lines().find_map(|l| l.strip_prefix("#define PREFILL_WG_SMEM_BYTES(D) ")).expect("no PREFILL_WG_SMEM_BYTES");
        assert_eq!(smem.trim(), "(3 * 2 * PREFILL_TILE * (D) * 2 + 1024)");
        assert!(wg.contains("ATTN_PREFILL_WG(64)\nATTN_PREFILL_WG(128)\n"), "the wgmma kernels are the head_dims prefill_has_wgmma names");
        assert_eq!([64, 128].map(|hd| prefill_smem_bytes(hd, true)), [50_176, 99_328]);
        assert!(prefill_smem_bytes(128, false) <= 227 * 1024 && prefill_smem_bytes(128, true) <= 227 * 1024);
        assert_eq!([32, 64, 128].map(prefill_has_wgmma), [false, true, true]);
        assert_eq!(prefill_kernel_name(128, true), "attn_prefill_wg_hd128");
        assert_eq!(prefill_kernel_name(32, false), "attn_prefill_hd32");
    }

    /// Context splits: whole spans, and launches whose partials fit the space kept
    /// for them whatever the pass (a tile deeper than every item still gets one).
    #[test]
    fn prefill_splits_and_groups_bound_the_partials() {
        assert_eq!([1, 1024, 1025, 4096, 16_384, 131_072].map(prefill_splits), [1, 1, 2, 4, 16, 128]);
        assert_eq!(prefill_group_tiles(1), usize::MAX);
        for splits in [2, 3, 16, 127, 128, 129, 1000] {
            let group = prefill_group_tiles(splits);
            assert!(group >= 1, "{splits} splits");
            assert!(group * splits <= PREFILL_PARTIAL_ITEMS.max(splits), "{splits} splits: {group} tiles per launch");
            // No smaller launch than the space allows: one more tile would not fit.
            assert!(splits >= PREFILL_PARTIAL_ITEMS || (group + 1) * splits > PREFILL_PARTIAL_ITEMS, "{splits} splits");
        }
        // A 512-row pass (8 tiles) at 16K positions runs in one launch.
        assert!(prefill_group_tiles(prefill_splits(16_384)) >= 8);
        // Llama-3.2-1B: 128 items of 32 heads x 64 rows x (64 + 2) floats, ~69 MB.
        let (o, ml) = prefill_partial_floats(PREFILL_PARTIAL_ITEMS, 32, 1, 64);
        assert_eq!((o + ml) * 4, 69_206_016);
    }

    /// The device sampler's split over CTAs, as sample.cu defines it.
    #[test]
    fn sampler_constants_are_the_kernels() {
        let src = include_str!("../../../../../kernels/src/sample.cu");
        let define = |name: &str| -> usize {
            let prefix = format!("#define {name} ");
            let line = src.lines().find_map(|l| l.strip_prefix(prefix.as_str())).unwrap_or_else(|| panic!("no #define {name}"));
            line.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("#define {name} {line}"))
        };
        assert_eq!(define("SAMPLE_THREADS"), SAMPLE_THREADS as usize);
        assert_eq!(define("SAMPLE_PARTS"), SAMPLE_PARTS);
        assert_eq!(define("SAMPLE_LIST_K"), SAMPLE_LIST_K);
        assert_eq!(define("SAMPLE_LIST_THREADS"), SAMPLE_LIST_THREADS as usize);
        assert_eq!(define("SAMPLE_PATH_WHOLE"), SamplePath::Whole as usize);
        assert_eq!(define("SAMPLE_PATH_LISTS"), SamplePath::Lists as usize);
        assert_eq!(define("SAMPLE_PATH_BINS"), SamplePath::Bins as usize);
        let bin_words = src.lines().find_map(|l| l.strip_prefix("#define SAMPLE_BIN_WORDS ")).expect("no SAMPLE_BIN_WORDS");
        assert_eq!(bin_words.trim(), "(2 * RACE_MASS_BINS + 3)");
        let cuh = include_str!("../../../../../kernels/src/sampler.cuh");
        assert!(cuh.contains(&format!("constexpr int RACE_MASS_BINS = {SAMPLE_MASS_BINS};")), "sampler.cuh's RACE_MASS_BINS");
    }

    #[test]
    fn gemm_splits_fill_the_gpu_and_never_depend_on_rows() {
        let splits: Vec<usize> = LLAMA.iter().map(|&(n, k)| GemmPlan::new(n, k, 16, H200_SMS).splits).collect();
        // 24 tiles x 5 = 120 CTAs; 16 x 8 = 128; 128 tiles and 1002 tiles need no split.
        assert_eq!(splits, [5, 8, 1, 8, 1]);
        for &(n, k) in &LLAMA {
            let solo = GemmPlan::new(n, k, 1, H200_SMS);
            for rows in [2, 16, 17, 33, 72, 80, 128, 256] {
                assert_eq!(GemmPlan::new(n, k, rows, H200_SMS).splits, solo.splits, "{n}x{k} at {rows} rows");
            }
            assert_eq!(GemmPlan::new(n, k, 257, H200_SMS).splits, 1, "long prefills do not split");
        }
        // Every split keeps at least two k blocks (SmolLM2's 576 = 9 blocks: at most 4 ways).
        assert!(GemmPlan::new(576, 576, 16, H200_SMS).splits <= 4);
        assert_eq!(GemmPlan::new(64, 64, 16, H200_SMS).splits, 1);
    }

    #[test]
    fn gemm_tiles_cover_every_row_and_the_scratch_fits_every_pass() {
        for rows in [1usize, 16, 17, 32, 33, 64, 65, 72, 80, 81, 100, 256, 300, 4096] {
            let (ws, counters) = GemmPlan::scratch_needs(&LLAMA, rows.next_power_of_two(), H200_SMS);
            for &(n, k) in &LLAMA {
                let p = GemmPlan::new(n, k, rows, H200_SMS);
                assert!(p.tiles_n * GEMM_TILE_N >= n && p.tiles_m * 16 * p.mt >= rows);
                assert!(p.workspace_floats() <= ws && p.counters() <= counters, "{n}x{k} at {rows} rows: {p:?}");
            }
        }
    }

    #[test]
    fn a_prompt_piece_beside_decoding_rows_streams_the_weights_once() {
        // A 64-row piece and up to 16 decoding rows: one row tile (every weight read once).
        for rows in [40, 64, 65, 72, 80] {
            assert_eq!(GemmPlan::new(2048, 2048, rows, H200_SMS).tiles_m, 1, "{rows} rows");
        }
        assert_eq!(GemmPlan::new(2048, 2048, 72, H200_SMS).mt, 5);
        assert_eq!(GemmPlan::new(2048, 2048, 81, H200_SMS).tiles_m, 2);
    }

    #[test]
    fn gemm_shared_memory_fits_hopper() {
        // 227 KiB per CTA at most (the ring is as deep as one CTA per SM allows).
        for mt in GEMM_TC_MT {
            assert!(gemm_tc_smem_bytes(mt) <= 227 << 10, "m{mt}: {} bytes", gemm_tc_smem_bytes(mt));
        }
    }
}
