//! Whether a row's fp16 product keeps its bits when the pass around it has
//! another row count: the property prefix reuse's fixed pass boundaries rest on
//! (`batch::chunk_end`). One product at several row counts, the first rows of
//! each compared bit for bit with a reference row count's, on cuBLASLt (under
//! either the heuristic's own pick per row count or one algorithm for all) or on
//! rocket's fp16 GEMM (gemm_f16.cu).

use half::f16;
use rayon::prelude::*;

use super::cublas::{describe_algo, AlgoChoice, Cublas, Operands};
use super::driver::{DeviceBuffer, TimedEvent};
use super::matmul_check::{rotated_weights, uniform};
use super::CudaBackend;
use crate::error::{Result, RocketError};

/// Which kernel [`CudaBackend::product_row_bits`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowBitsKernel {
    /// cuBLASLt: every run on the heuristic's pick for that many rows, or
    /// (None) each on its own row count's pick (what the forward pass does).
    Cublas { algo_rows: Option<usize> },
    /// rocket's fp16 GEMM (gemm_f16.cu), at any row count.
    F16Gemm,
}

/// One row count's outcome in [`CudaBackend::product_row_bits`].
#[derive(Debug, Clone, PartialEq)]
pub struct RowBits {
    pub rows: usize,
    /// The algorithm that ran (`describe_algo`).
    pub algo: String,
    /// Outputs of the compared rows whose bits differ from the reference run's.
    pub differ: usize,
    /// Outputs compared: the first min(rows, reference rows) rows, every column.
    pub compared: usize,
    /// Mean time per launch, in microseconds, with weights coming from HBM.
    pub micros: f64,
    /// Why cuBLASLt refused the pinned algorithm at this row count (nothing
    /// compared or timed then); never set for its own picks, whose errors fail.
    pub refused: Option<String>,
}

const TIMED_LAUNCHES: usize = 10;

/// `n` fp16 values drawn from [-scale, scale) (`matmul_check::uniform`'s draws).
fn random_f16(seed: u64, n: usize, scale: f32) -> Vec<u16> {
    uniform(seed, n).into_par_iter().map(|v| f16::from_f32(v * scale).to_bits()).collect()
}

impl CudaBackend {
    /// y = x · Wᵀ on fp16 operands for a random W [n][k] and random x on `kernel`, at
    /// `reference_rows` and then at each of `rows` (x's first rows): each run's
    /// first rows compared bit for bit with the reference run's.
    pub fn product_row_bits(&self, kernel: RowBitsKernel, n: usize, k: usize, reference_rows: usize, rows: &[usize], seed: u64) -> Result<Vec<RowBits>> {
        if n == 0 || k == 0 || k % 8 != 0 || reference_rows == 0 || rows.contains(&0) {
            return Err(RocketError::invalid_arg("n, k, rows", format!("{n}, {k}, {reference_rows}, {rows:?}"), "n and every row count at least 1, k a positive multiple of 8"));
        }
        let max_rows = rows.iter().copied().chain([reference_rows]).max().unwrap_or(reference_rows);
        let inner = self.lock()?;
        let (ctx, st, kernels) = (&inner.ctx, &inner.stream, &inner.kernels);
        let algo_rows = match kernel {
            RowBitsKernel::Cublas { algo_rows } => algo_rows,
            RowBitsKernel::F16Gemm => None,
        };
        let lt = match kernel {
            RowBitsKernel::Cublas { .. } => Some(Cublas::new(ctx)?),
            RowBitsKernel::F16Gemm if !kernels.gemm_f16_fits(n, k) => {
                return Err(RocketError::invalid_arg("n, k", format!("{n}, {k}"), "the fp16 GEMM takes n % 8 == 0 and k % 64 == 0 (on a GPU that runs it)"));
            }
            RowBitsKernel::F16Gemm => None,
        };
        let w_bytes = n * k * 2;
        let (weights, copies) = rotated_weights(ctx, st, &random_f16(seed, n * k, 0.25), "the row-bits check's weights")?;
        let x = DeviceBuffer::with_data(ctx, st, &random_f16(seed ^ 0x9e37_79b9, max_rows * k, 1.0), "the row-bits check's inputs")?;
        let y = DeviceBuffer::alloc(ctx, max_rows * n * 4, "the row-bits check's outputs")?;
        let choice = AlgoChoice { rows: algo_rows, candidate: 0 };
        // One launch at `r` rows on the weights at `w`: what ran (cuBLASLt's algorithm, or the GEMM's plan).
        let launch = |w: u64, r: usize| -> Result<String> {
            match &lt {
                Some(lt) => {
                    let algo = lt
                        .matmul_with(st, Operands::F16, w, x.ptr, y.ptr, n, k, r, false, choice)?
                        .ok_or_else(|| RocketError::Internal(format!("cuBLASLt offered no algorithm for {n}x{k} at {r} rows")))?;
                    Ok(describe_algo(&algo))
                }
                None => {
                    kernels.gemm_f16(st, w, x.ptr, y.ptr, n, k, r, false)?;
                    Ok(format!("gemm_f16 {}", kernels.gemm_f16_plan(n, k, r)))
                }
            }
        };
        // One product at `r` rows on fresh NaN outputs: its outputs and algorithm.
        let run = |r: usize| -> Result<(Vec<f32>, String)> {
            y.upload(st, 0, &vec![f32::NAN; r * n])?;
            let algo = launch(weights.ptr, r)?;
            let mut got = vec![0f32; r * n];
            y.download(st, 0, &mut got)?;
            st.sync()?;
            if let Some(i) = got.iter().position(|v| !v.is_finite()) {
                return Err(RocketError::Internal(format!("{kernel:?} {n}x{k} at {r} rows left output {i} unwritten or non-finite")));
            }
            Ok((got, algo))
        };
        let (reference, _) = run(reference_rows)?;
        let mut out = Vec::new();
        for &r in rows {
            let (got, algo) = match run(r) {
                Ok(ran) => ran,
                // A pinned algorithm need not run at every row count (a split-K
                // one's workspace, say): that is a finding, not a failure.
                Err(e @ RocketError::Device(_)) if algo_rows.is_some() => {
                    out.push(RowBits { rows: r, algo: String::new(), differ: 0, compared: 0, micros: f64::NAN, refused: Some(e.to_string()) });
                    continue;
                }
                Err(e) => return Err(e),
            };
            let compared = r.min(reference_rows) * n;
            let differ = got[..compared].iter().zip(&reference[..compared]).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            let (start, end) = (TimedEvent::new()?, TimedEvent::new()?);
            start.record(st)?;
            for i in 0..TIMED_LAUNCHES {
                launch(weights.ptr + ((i + 1) % copies * w_bytes) as u64, r)?;
            }
            end.record(st)?;
            st.sync()?;
            let micros = start.elapsed_ms(&end)? as f64 * 1e3 / TIMED_LAUNCHES as f64;
            out.push(RowBits { rows: r, algo, differ, compared, micros, refused: None });
        }
        Ok(out)
    }
}
