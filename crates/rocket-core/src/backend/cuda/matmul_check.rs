//! One matmul kernel (kernels/src/gemm_tc.cu or gemv.cu, or cuBLASLt) on its own: checked
//! against an f64 product on the host, on fresh random inputs with a poisoned
//! output, then timed streaming weights from HBM (in the manner of llm.c's
//! dev/cuda: one kernel, a CPU check, a GB/s figure).

use half::bf16;
use rayon::prelude::*;

use super::cublas::{AlgoChoice, Cublas, Operands};
use super::driver::{Context, DeviceBuffer, Stream, TimedEvent};
use super::kernels::{GemmFusion, GemmPlan, GemmScratch};
use super::CudaBackend;
use crate::error::{Result, RocketError};
use crate::sampling::splitmix64;

/// Which kernel a [`MatmulCheck`] ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MatmulKernel {
    /// The tensor-core GEMM (bf16 hi+lo inputs on mma.sync).
    Tensor,
    /// The CUDA-core GEMV.
    Gemv,
    /// cuBLASLt on the inputs' bf16 hi and lo parts, as `MatmulPath::Cublas`
    /// runs it (kernels/src/to_bf16.cu, timed with it).
    Cublas,
    /// cuBLASLt on the hi parts alone: half the arithmetic, one rounding of
    /// each input to bf16 (what the split buys, measured).
    CublasBf16,
    /// cuBLASLt on fp16 operands, as the forward pass runs it with the weights'
    /// fp16 copy: x rounded by to_f16.cu (timed with it), W converted before.
    CublasF16,
    /// `CublasF16` on the heuristic's n-th candidate algorithm (0: the one the
    /// forward pass runs); fails where the heuristic offered fewer.
    CublasF16Candidate(u8),
    /// `CublasF16Candidate(candidate)` made to split K `splits` ways under the
    /// reduction `scheme` (cuBLASLt's `CUBLASLT_REDUCTION_SCHEME_*` value); fails,
    /// saying why, where cuBLASLt refuses that configuration.
    CublasF16SplitK { candidate: u8, splits: u8, scheme: u8 },
    /// rocket's fp16 GEMM (gemm_f16.cu) on the operands `CublasF16` takes (x
    /// rounded by to_f16.cu, timed with it).
    F16Gemm,
}

/// What the tensor-core GEMM folds into the product (gemm_tc.cu's fused prologue
/// and epilogue, as the forward pass runs them); the GEMV takes neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MatmulFusion {
    /// The product is of RMSNorm(x) (random norm weights, eps 1e-5).
    pub norm: bool,
    /// W is a fused gate|up [n][k]; the output [rows][n / 2] is silu(gate) · up.
    pub silu: bool,
}

/// The outcome of [`CudaBackend::matmul_check`].
#[derive(Debug, Clone, PartialEq)]
pub struct MatmulCheck {
    pub kernel: MatmulKernel,
    /// How the tensor-core GEMM covered the product (tiles, split), or "gemv".
    pub plan: String,
    /// Relative L2 error of the checked outputs against the host's f64 product:
    /// the worse of the first launch and one after the timed launches (which
    /// catches state a launch leaves behind, such as the split-K counters).
    pub rel_l2: f64,
    /// Outputs compared with the host (every row, a stride of columns on large shapes).
    pub checked: usize,
    /// Whether every output was written: the output starts as NaN without
    /// `accumulate` (with it, the starting values are finite and this is always true).
    pub all_written: bool,
    /// Whether the launch after the timed ones gave the first launch's bits.
    pub repeatable: bool,
    /// Mean time per launch, in microseconds, with weights coming from HBM.
    pub micros: f64,
    /// Weight, input and output bytes moved per launch over that time, in GB/s.
    pub gbs: f64,
}

/// At most this many multiply-adds are checked on the host per call.
const HOST_CHECK_MACS: usize = 1 << 26;
/// Timed launches rotate over weight copies of at least this many bytes in
/// all, more than the H200's 50 MB L2, so weights come from HBM as in decode.
const ROTATION_BYTES: usize = 192 << 20;

/// splitmix64 draws mapped to [-1, 1).
pub(super) fn uniform(seed: u64, n: usize) -> Vec<f32> {
    (0..n).into_par_iter().map(|i| (splitmix64(seed.wrapping_add(i as u64)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0).collect()
}

/// One device buffer holding as many copies of the weights `w` as rotate past
/// L2 (`ROTATION_BYTES`), and how many: launch `i` of a timed loop reads copy
/// `i % copies`.
pub(super) fn rotated_weights<T: Copy>(ctx: &Context, st: &Stream, w: &[T], what: &str) -> Result<(DeviceBuffer, usize)> {
    let bytes = std::mem::size_of_val(w);
    let copies = ROTATION_BYTES.div_ceil(bytes.max(1)).max(1);
    let weights = DeviceBuffer::alloc(ctx, bytes * copies, what)?;
    for c in 0..copies {
        weights.upload(st, c * bytes, w)?;
    }
    Ok((weights, copies))
}

impl CudaBackend {
    /// Runs `y (+)= x · Wᵀ` (with `fusion`'s prologue and epilogue) for a random bf16 `W`
    /// [n][k] and random f32 `x` [rows][k] on `kernel`, checks it against the
    /// host, then times `reps` launches. A diagnostic and a test of the matmul
    /// kernels at any shape.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_check(
        &self,
        kernel: MatmulKernel,
        fusion: MatmulFusion,
        n: usize,
        k: usize,
        rows: usize,
        accumulate: bool,
        reps: usize,
        seed: u64,
    ) -> Result<MatmulCheck> {
        if n == 0 || k == 0 || rows == 0 || reps == 0 {
            return Err(RocketError::invalid_arg("n, k, rows, reps", format!("{n}, {k}, {rows}, {reps}"), "must all be at least 1"));
        }
        if fusion != MatmulFusion::default() && kernel != MatmulKernel::Tensor {
            return Err(RocketError::invalid_arg("fusion", format!("{fusion:?}"), "only the tensor-core GEMM fuses"));
        }
        if fusion.silu && (!GemmFusion::silu_fits(n) || accumulate) {
            return Err(RocketError::invalid_arg("n", n, "the SiLU epilogue needs n % 128 == 0 and no accumulate"));
        }
        let needs = match kernel {
            MatmulKernel::Tensor => (k % 64 == 0, "a multiple of 64"),
            MatmulKernel::Gemv => (k % 8 == 0, "a multiple of 8"),
            // The lo parts follow the hi parts: 16-byte aligned when k is a multiple of 8.
            MatmulKernel::Cublas | MatmulKernel::CublasBf16 | MatmulKernel::CublasF16 | MatmulKernel::CublasF16Candidate(_) | MatmulKernel::CublasF16SplitK { .. } => {
                (k % 8 == 0, "a multiple of 8")
            }
            MatmulKernel::F16Gemm => (k % 64 == 0 && n % 8 == 0, "a multiple of 64 (and n of 8)"),
        };
        if !needs.0 {
            return Err(RocketError::invalid_arg("k", k, format!("must be {} for {kernel:?}", needs.1)));
        }
        let inner = self.lock()?;
        let (ctx, st, kernels) = (&inner.ctx, &inner.stream, &inner.kernels);
        let w_host: Vec<bf16> = uniform(seed, n * k).into_par_iter().map(|v| bf16::from_f32(v * 0.25)).collect();
        let x_host = uniform(seed ^ 0x9e37_79b9, rows * k);
        let n_out = if fusion.silu { n / 2 } else { n };
        let y0_host: Vec<f32> = if accumulate { uniform(seed ^ 0x5151, rows * n_out) } else { vec![f32::NAN; rows * n_out] };
        let norm_host: Option<Vec<f32>> = fusion.norm.then(|| uniform(seed ^ 0x707, k).iter().map(|v| 1.0 + 0.5 * v).collect());

        let w_bytes = n * k * 2;
        let (weights, copies) = rotated_weights(ctx, st, &w_host, "the matmul check's weights")?;
        let x = DeviceBuffer::alloc(ctx, rows * k * 4, "the matmul check's inputs")?;
        x.upload(st, 0, &x_host)?;
        let y = DeviceBuffer::alloc(ctx, rows * n_out * 4, "the matmul check's outputs")?;
        y.upload(st, 0, &y0_host)?;
        let norm = DeviceBuffer::alloc(ctx, k * 4, "the matmul check's norm weights")?;
        if let Some(nw) = &norm_host {
            norm.upload(st, 0, nw)?;
        }
        let gemm_fusion = GemmFusion { norm: fusion.norm.then_some((norm.ptr, NORM_EPS)), silu: fusion.silu };
        let plan = kernels.gemm_plan(n, k, rows);
        let f16_plan = kernels.gemm_f16_plan(n, k, rows);
        let scratch = GemmScratch::alloc(ctx, st, plan.workspace_floats(), plan.counters())?;
        let (cublas, x_bf16) = match kernel {
            MatmulKernel::Cublas | MatmulKernel::CublasBf16 | MatmulKernel::CublasF16 | MatmulKernel::CublasF16Candidate(_) | MatmulKernel::CublasF16SplitK { .. } => {
                (Some(Cublas::new(ctx)?), Some(DeviceBuffer::alloc(ctx, 2 * rows * k * 2, "the matmul check's 16-bit inputs")?))
            }
            MatmulKernel::F16Gemm => (None, Some(DeviceBuffer::alloc(ctx, rows * k * 2, "the matmul check's fp16 inputs")?)),
            _ => (None, None),
        };
        // The fp16 copy of every rotated weight copy, and the range flag (which
        // these inputs, within [-1, 1), must never set).
        let f16 = match kernel {
            MatmulKernel::CublasF16 | MatmulKernel::CublasF16Candidate(_) | MatmulKernel::CublasF16SplitK { .. } | MatmulKernel::F16Gemm => {
                let w16 = DeviceBuffer::alloc(ctx, w_bytes * copies, "the matmul check's fp16 weights")?;
                let flag = DeviceBuffer::with_data(ctx, st, &[0u32], "the matmul check's range flag")?;
                kernels.bf16_to_f16(st, weights.ptr, w16.ptr, n * k * copies, flag.ptr)?;
                Some((w16, flag))
            }
            _ => None,
        };
        // The candidate algorithm's configuration, from its first launch.
        let algo = std::cell::RefCell::new(String::new());
        let launch = |w: u64| match (kernel, &cublas, &x_bf16) {
            (MatmulKernel::CublasF16 | MatmulKernel::CublasF16Candidate(_), Some(lt), Some(xb)) => {
                let c = if let MatmulKernel::CublasF16Candidate(c) = kernel { c } else { 0 };
                let (w16, flag) = f16.as_ref().expect("made above for the fp16 kernels");
                kernels.to_f16(st, x.ptr, xb.ptr, rows * k, flag.ptr)?;
                let choice = AlgoChoice { rows: None, candidate: c as usize };
                let ran = lt.matmul_with(st, Operands::F16, w16.ptr + (w - weights.ptr), xb.ptr, y.ptr, n, k, rows, accumulate, choice)?;
                let ran = ran.ok_or_else(|| RocketError::invalid_arg("candidate", c, format!("cuBLASLt offered fewer algorithms for {n}x{k} at {rows} rows")))?;
                // Once: its attribute reads would slow the timed loop's launches.
                if algo.borrow().is_empty() {
                    *algo.borrow_mut() = super::cublas::describe_algo(&ran);
                }
                Ok(())
            }
            (MatmulKernel::CublasF16SplitK { candidate, splits, scheme }, Some(lt), Some(xb)) => {
                let (w16, flag) = f16.as_ref().expect("made above for the fp16 kernels");
                kernels.to_f16(st, x.ptr, xb.ptr, rows * k, flag.ptr)?;
                let w16 = w16.ptr + (w - weights.ptr);
                let ran = lt.matmul_split_k(st, w16, xb.ptr, y.ptr, n, k, rows, accumulate, candidate as usize, splits as u32, scheme as u32)?;
                let ran = ran.map_err(|why| RocketError::invalid_arg("split K", format!("{kernel:?}"), format!("cuBLASLt refused it: {why}")))?;
                if algo.borrow().is_empty() {
                    *algo.borrow_mut() = super::cublas::describe_algo(&ran);
                }
                Ok(())
            }
            (MatmulKernel::F16Gemm, None, Some(xb)) => {
                let (w16, flag) = f16.as_ref().expect("made above for the fp16 kernels");
                kernels.to_f16(st, x.ptr, xb.ptr, rows * k, flag.ptr)?;
                kernels.gemm_f16(st, w16.ptr + (w - weights.ptr), xb.ptr, y.ptr, n, k, rows, accumulate)
            }
            (MatmulKernel::Cublas | MatmulKernel::CublasBf16, Some(lt), Some(xb)) => {
                let (hi, lo) = kernels.to_bf16_split(st, x.ptr, xb.ptr, rows * k)?;
                match kernel {
                    MatmulKernel::Cublas => lt.matmul_split(st, w, hi, lo, y.ptr, n, k, rows, AlgoChoice::FIRST, accumulate),
                    _ => lt.matmul(st, Operands::Bf16, w, hi, y.ptr, n, k, rows, accumulate),
                }
            }
            (MatmulKernel::Tensor, ..) => kernels.gemm_tc(st, w, x.ptr, y.ptr, n, k, rows, accumulate, &scratch, gemm_fusion),
            _ => kernels.gemv(st, w, x.ptr, y.ptr, n, k, rows, accumulate),
        };

        launch(weights.ptr)?;
        let mut got = vec![0f32; rows * n_out];
        y.download(st, 0, &mut got)?;
        let all_written = got.iter().all(|v| v.is_finite());
        let reference = Reference::new(&w_host, &x_host, &y0_host, norm_host.as_deref(), fusion.silu, n, k, rows, accumulate);
        let (rel_l2, checked) = reference.compare(&got);

        let (start, end) = (TimedEvent::new()?, TimedEvent::new()?);
        launch(weights.ptr)?;
        start.record(st)?;
        for r in 0..reps {
            launch(weights.ptr + ((r + 1) % copies * w_bytes) as u64)?;
        }
        end.record(st)?;
        st.sync()?;
        let micros = start.elapsed_ms(&end)? as f64 * 1e3 / reps as f64;
        // Once more from the starting outputs, after every timed launch has run.
        y.upload(st, 0, &y0_host)?;
        let first = got.clone();
        launch(weights.ptr)?;
        y.download(st, 0, &mut got)?;
        let repeatable = first.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
        let (again, _) = reference.compare(&got);
        let all_written = all_written && got.iter().all(|v| v.is_finite());
        let rel_l2 = if rel_l2.is_nan() || again.is_nan() { f64::NAN } else { rel_l2.max(again) };
        let moved = w_bytes + rows * k * 4 + rows * n_out * 4 * (1 + accumulate as usize);
        let plan = match kernel {
            MatmulKernel::Tensor => describe(&plan),
            MatmulKernel::Gemv => "gemv".to_string(),
            MatmulKernel::Cublas => "cublaslt hi+lo".to_string(),
            MatmulKernel::CublasBf16 => "cublaslt bf16".to_string(),
            MatmulKernel::CublasF16 => "cublaslt fp16".to_string(),
            MatmulKernel::CublasF16Candidate(_) | MatmulKernel::CublasF16SplitK { .. } => algo.into_inner(),
            MatmulKernel::F16Gemm => format!("gemm_f16 {f16_plan}"),
        };
        if let Some((_, flag)) = &f16 {
            let mut set = [0u32];
            flag.download(st, 0, &mut set)?;
            if set[0] != 0 {
                return Err(RocketError::Internal("the fp16 conversion flagged inputs within [-1, 1) as out of range".into()));
            }
        }
        Ok(MatmulCheck {
            kernel,
            plan,
            rel_l2,
            checked,
            all_written,
            repeatable,
            micros,
            gbs: moved as f64 / micros / 1e3,
        })
    }
}

fn describe(p: &GemmPlan) -> String {
    format!("m{} {}x{} tiles, split {}", p.mt, p.tiles_n, p.tiles_m, p.splits)
}

/// The eps of the checked RMSNorm fusion.
const NORM_EPS: f32 = 1e-5;

/// The host's f64 version of one checked launch.
struct Reference<'a> {
    w: &'a [bf16],
    /// Each row's input as the product sees it, in f64: RMSNorm(x) with the norm
    /// weights, else x.
    inputs: Vec<Vec<f64>>,
    y0: &'a [f32],
    /// Outputs are silu(gate) · up of weight rows c and n / 2 + c.
    silu: bool,
    n: usize,
    k: usize,
    rows: usize,
    accumulate: bool,
}

impl<'a> Reference<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(w: &'a [bf16], x: &[f32], y0: &'a [f32], norm: Option<&[f32]>, silu: bool, n: usize, k: usize, rows: usize, accumulate: bool) -> Self {
        let inputs = (0..rows)
            .into_par_iter()
            .map(|r| {
                let xr = &x[r * k..(r + 1) * k];
                match norm {
                    Some(nw) => {
                        let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / k as f64;
                        let scale = 1.0 / (ms + NORM_EPS as f64).sqrt();
                        xr.iter().zip(nw).map(|(&v, &w)| v as f64 * scale * w as f64).collect()
                    }
                    None => xr.iter().map(|&v| v as f64).collect(),
                }
            })
            .collect();
        Reference { w, inputs, y0, silu, n, k, rows, accumulate }
    }

    /// Relative L2 error of `got` over every row and a stride of output columns
    /// (always the last, which sits in a partial tile), and how many outputs that compared.
    fn compare(&self, got: &[f32]) -> (f64, usize) {
        let (n, k, rows, inputs) = (self.n, self.k, self.rows, &self.inputs);
        let n_out = if self.silu { n / 2 } else { n };
        let macs_per_col = k * rows * if self.silu { 2 } else { 1 };
        let stride = (n_out * macs_per_col).div_ceil(HOST_CHECK_MACS).max(1);
        let mut cols: Vec<usize> = (0..n_out).step_by(stride).collect();
        if cols.last() != Some(&(n_out - 1)) {
            cols.push(n_out - 1);
        }
        let dot = |c: usize, r: usize| -> f64 { self.w[c * k..(c + 1) * k].iter().zip(&inputs[r]).map(|(a, b)| a.to_f64() * b).sum() };
        let (err, norm) = cols
            .par_iter()
            .map(|&c| {
                let (mut err, mut norm) = (0f64, 0f64);
                for r in 0..rows {
                    let mut want = if self.silu {
                        let (gate, up) = (dot(c, r), dot(n / 2 + c, r));
                        gate / (1.0 + (-gate).exp()) * up
                    } else {
                        dot(c, r)
                    };
                    if self.accumulate {
                        want += self.y0[r * n_out + c] as f64;
                    }
                    err += (got[r * n_out + c] as f64 - want).powi(2);
                    norm += want * want;
                }
                (err, norm)
            })
            .reduce(|| (0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
        ((err / norm.max(f64::MIN_POSITIVE)).sqrt(), cols.len() * rows)
    }
}
