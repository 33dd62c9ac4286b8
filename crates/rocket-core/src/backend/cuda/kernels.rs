//! rocket's precompiled kernels (kernels/src, built by kernels/build.sh) and one
//! typed launcher per kernel, mirroring the launch contract in each .cu header.

use std::time::Instant;

use super::driver::{Arg, Context, Function, Module, Stream};
use crate::error::{Result, RocketError};

/// Machine code for Hopper (sm_90a): loads without a JIT.
static CUBIN: &[u8] = include_bytes!("../../../../../kernels/build/rocket.sm_90a.cubin");
/// PTX for sm_90, JIT-compiled by the driver on other GPUs of compute capability >= 9.0.
static PTX: &[u8] = include_bytes!("../../../../../kernels/build/rocket.ptx");

/// Tokens per launch row of each GEMV instantiation, and the weight rows each
/// warp computes (kernels/src/gemv.cu `GEMV(N, R)`).
const GEMV_TILES: [u32; 5] = [1, 2, 4, 8, 16];
const GEMV_ROWS_PER_WARP: [u32; 5] = [1, 2, 2, 4, 2];

/// Input rows per CTA (16 MT) and weight rows per CTA (8 NT) of each tensor-core
/// GEMM instantiation (kernels/src/gemm_tc.cu `GEMM_TC(MT, NT)`), in this order.
const GEMM_TC_SHAPES: [(u32, u32); 6] = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2)];

/// The arguments gemv.cu and gemm_tc.cu both take: (W, x, y, n, k, rows, accumulate).
#[allow(clippy::too_many_arguments)]
fn matmul_args(w: u64, x: u64, y: u64, n: usize, k: usize, rows: usize, accumulate: bool) -> [Arg; 7] {
    [Arg::Ptr(w), Arg::Ptr(x), Arg::Ptr(y), Arg::I32(n as i32), Arg::I32(k as i32), Arg::I32(rows as i32), Arg::I32(accumulate as i32)]
}

pub(crate) struct Kernels {
    module: Module,
    gemm_tc: [Function; 6],
    embed: Function,
    rms_norm: Function,
    gemv: [Function; 5],
    rope_kv: Function,
    attn_partial: Function,
    attn_merge: Function,
    silu_mul: Function,
    argmax: Function,
    sample: Function,
    head_dim: u32,
    /// "sm_90a cubin" or "sm_90 PTX (JIT)", and how long loading took.
    pub image: &'static str,
    pub load_seconds: f64,
}

impl Kernels {
    pub(crate) fn load(ctx: &Context, head_dim: usize) -> Result<Self> {
        if ![32, 64, 128].contains(&head_dim) {
            return Err(RocketError::Device(format!(
                "head_dim {head_dim} has no CUDA attention kernel (supported: 32, 64, 128)"
            )));
        }
        let start = Instant::now();
        let (module, image) = if ctx.compute_capability == (9, 0) {
            (Module::load(CUBIN)?, "sm_90a cubin")
        } else {
            let mut ptx = PTX.to_vec();
            ptx.push(0);
            (Module::load(&ptx)?, "sm_90 PTX (JIT)")
        };
        let f = |name: &str| module.function(name);
        let gemv = [f("gemv_bf16_t1")?, f("gemv_bf16_t2")?, f("gemv_bf16_t4")?, f("gemv_bf16_t8")?, f("gemv_bf16_t16")?];
        let tc = |(m, n): (u32, u32)| f(&format!("gemm_tc_m{m}_n{n}"));
        let gemm_tc = [
            tc(GEMM_TC_SHAPES[0])?,
            tc(GEMM_TC_SHAPES[1])?,
            tc(GEMM_TC_SHAPES[2])?,
            tc(GEMM_TC_SHAPES[3])?,
            tc(GEMM_TC_SHAPES[4])?,
            tc(GEMM_TC_SHAPES[5])?,
        ];
        Ok(Kernels {
            gemm_tc,
            embed: f("embed_gather")?,
            rms_norm: f("rms_norm")?,
            gemv,
            rope_kv: f("rope_store_kv")?,
            attn_partial: f(&format!("attn_partial_hd{head_dim}"))?,
            attn_merge: f(&format!("attn_merge_hd{head_dim}"))?,
            silu_mul: f("silu_mul")?,
            argmax: f("argmax")?,
            sample: f("sample_rows")?,
            head_dim: head_dim as u32,
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
        self.embed.launch(s, (rows as u32, 1, 1), 256, &[Arg::Ptr(table), Arg::Ptr(tokens), Arg::Ptr(x), Arg::I32(hidden as i32)])
    }

    /// `row_map` 0 means output row i normalises input row i.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rms_norm(&self, s: &Stream, x: u64, w: u64, out: u64, dim: usize, eps: f32, row_map: u64, rows: usize) -> Result<()> {
        let block = dim.div_ceil(32).clamp(1, 32) as u32 * 32;
        let args = [Arg::Ptr(x), Arg::Ptr(w), Arg::Ptr(out), Arg::I32(dim as i32), Arg::F32(eps), Arg::Ptr(row_map)];
        self.rms_norm.launch(s, (rows as u32, 1, 1), block.min(256), &args)
    }

    /// y [rows][n] (+)= x [rows][k] · W[n][k]ᵀ.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv(&self, s: &Stream, w: u64, x: u64, y: u64, n: usize, k: usize, rows: usize, accumulate: bool) -> Result<()> {
        debug_assert!(k % 8 == 0);
        let tile = GEMV_TILES.iter().position(|&t| t as usize >= rows).unwrap_or(GEMV_TILES.len() - 1);
        let rows_per_block = 8 * GEMV_ROWS_PER_WARP[tile] as usize;
        let grid = (n.div_ceil(rows_per_block) as u32, rows.div_ceil(GEMV_TILES[tile] as usize) as u32, 1);
        self.gemv[tile].launch(s, grid, 256, &matmul_args(w, x, y, n, k, rows, accumulate))
    }

    /// Whether `gemm_tc` can multiply rows of `k` weights (64-wide blocks).
    pub(crate) fn gemm_tc_fits(k: usize) -> bool {
        k % 64 == 0
    }

    /// y [rows][n] (+)= x [rows][k] · W[n][k]ᵀ on the tensor cores (bf16 hi+lo split
    /// inputs, f32 accumulation); `gemm_tc_fits(k)` must hold.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_tc(&self, s: &Stream, w: u64, x: u64, y: u64, n: usize, k: usize, rows: usize, accumulate: bool) -> Result<()> {
        if !Self::gemm_tc_fits(k) {
            return Err(RocketError::Internal(format!("gemm_tc needs k % 64 == 0, got {k}")));
        }
        let mt = if rows <= 16 { 1 } else if rows <= 32 { 2 } else { 4 };
        // Two weight tiles per CTA only where that still leaves two CTAs per SM of an H100/H200.
        let nt = if n / 16 >= 264 { 2 } else { 1 };
        let i = GEMM_TC_SHAPES.iter().position(|&shape| shape == (mt, nt)).expect("instantiated shape");
        let grid = (n.div_ceil(8 * nt as usize) as u32, rows.div_ceil(16 * mt as usize) as u32, 1);
        self.gemm_tc[i].launch(s, grid, 256, &matmul_args(w, x, y, n, k, rows, accumulate))
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
        self.rope_kv.launch(s, (rows as u32, 1, 1), 256, &args)
    }

    /// Attention of q (rows `q_stride` apart) into out [rows][n_heads*hd], split
    /// into `splits` chunks of `chunk` positions merged through `part_o`/`part_ml`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention(
        &self,
        s: &Stream,
        q: u64,
        q_stride: usize,
        meta: u64,
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
            Arg::Ptr(part_o),
            Arg::Ptr(part_ml),
            Arg::I32(n_heads as i32),
            Arg::I32(n_kv as i32),
            Arg::I32(layer as i32),
            Arg::I32(n_layers as i32),
            Arg::I32(chunk as i32),
            Arg::F32(scale),
        ];
        self.attn_partial.launch(s, (n_heads as u32, rows as u32, splits as u32), 128, &args)?;
        let args = [Arg::Ptr(part_o), Arg::Ptr(part_ml), Arg::Ptr(out), Arg::I32(n_heads as i32), Arg::I32(splits as i32)];
        self.attn_merge.launch(s, (n_heads as u32, rows as u32, 1), self.head_dim, &args)
    }

    pub(crate) fn silu_mul(&self, s: &Stream, gu: u64, out: u64, ff: usize, rows: usize) -> Result<()> {
        self.silu_mul.launch(s, (ff.div_ceil(256) as u32, rows as u32, 1), 256, &[Arg::Ptr(gu), Arg::Ptr(out), Arg::I32(ff as i32)])
    }

    pub(crate) fn argmax(&self, s: &Stream, logits: u64, out: u64, vocab: usize, rows: usize) -> Result<()> {
        self.argmax.launch(s, (rows as u32, 1, 1), 1024, &[Arg::Ptr(logits), Arg::Ptr(out), Arg::I32(vocab as i32)])
    }

    /// out[r] = the host sampler's token for logits row r (modified in place by
    /// the penalties) and request `rows[r]`; `items` holds SAMPLE_ITEM_BYTES ×
    /// vocab bytes per row.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sample(&self, s: &Stream, logits: u64, inputs: &SampleInputs, items: u64, out: u64, vocab: usize, rows: usize) -> Result<()> {
        let args = [
            Arg::Ptr(logits),
            Arg::Ptr(inputs.rows),
            Arg::Ptr(inputs.penalty_tokens),
            Arg::Ptr(inputs.penalty_counts),
            Arg::Ptr(inputs.mask_ids),
            Arg::Ptr(items),
            Arg::Ptr(out),
            Arg::I32(vocab as i32),
        ];
        self.sample.launch(s, (rows as u32, 1, 1), SAMPLE_THREADS, &args)
    }
}

/// Threads per row of `sample_rows` (kernels/src/sample.cu SAMPLE_THREADS).
const SAMPLE_THREADS: u32 = 1024;

/// Bytes of one compacted candidate (kernels/src/sample.cu SampleItem).
pub(crate) const SAMPLE_ITEM_BYTES: usize = 16;

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
    pub reserved: u32,
}
const _: () = assert!(std::mem::size_of::<SampleRow>() == 64, "SampleRow must match sample.cu");

/// Device addresses of the per-row requests and their penalty and mask lists.
pub(crate) struct SampleInputs {
    pub rows: u64,
    pub penalty_tokens: u64,
    pub penalty_counts: u64,
    pub mask_ids: u64,
}
