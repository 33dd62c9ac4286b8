//! The reference backend's arithmetic: f32 accumulation over weights in their
//! stored dtype. Plain loops written so the compiler vectorises them; an
//! AVX2+FMA build of the same loops is picked at run time where available.

use rayon::prelude::*;

use crate::weights::{bf16_to_f32, WeightView};

const LANES: usize = 16;

#[inline(always)]
fn fmadd<const FMA: bool>(acc: f32, a: f32, b: f32) -> f32 {
    if FMA {
        a.mul_add(b, acc)
    } else {
        acc + a * b
    }
}

/// Dot product of a weight row with an f32 vector; `widen` turns a stored element into f32.
#[inline(always)]
fn dot_impl<T: Copy, const FMA: bool>(w: &[T], x: &[f32], widen: impl Fn(T) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let mut wc = w.chunks_exact(LANES);
    let mut xc = x.chunks_exact(LANES);
    for (wb, xb) in (&mut wc).zip(&mut xc) {
        for j in 0..LANES {
            acc[j] = fmadd::<FMA>(acc[j], widen(wb[j]), xb[j]);
        }
    }
    let mut tail = 0f32;
    for (&a, &b) in wc.remainder().iter().zip(xc.remainder()) {
        tail = fmadd::<FMA>(tail, widen(a), b);
    }
    // Pairwise sum of the lanes keeps the reduction order fixed.
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for j in 0..width {
            acc[j] += acc[j + width];
        }
    }
    acc[0] + tail
}

#[inline(always)]
fn f16_to_f32(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}

#[inline(always)]
fn dot_row<const FMA: bool>(w: WeightView<'_>, row: usize, k: usize, x: &[f32]) -> f32 {
    let r = row * k..(row + 1) * k;
    match w {
        WeightView::BF16(s) => dot_impl::<u16, FMA>(&s[r], x, bf16_to_f32),
        WeightView::F16(s) => dot_impl::<u16, FMA>(&s[r], x, f16_to_f32),
        WeightView::F32(s) => dot_impl::<f32, FMA>(&s[r], x, |v| v),
    }
}

/// Rows `rows` of `w` times each of the `t` vectors in `x`; `out` is [rows.len()][t].
#[inline(always)]
fn rows_times_vectors<const FMA: bool>(
    w: WeightView<'_>,
    rows: std::ops::Range<usize>,
    k: usize,
    x: &[f32],
    t: usize,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    if t == 1 {
        for (o, row) in out.iter_mut().zip(rows) {
            *o = dot_row::<FMA>(w, row, k, x);
        }
        return;
    }
    // Several vectors: widen each row once, then reuse it for every vector.
    scratch.resize(k, 0.0);
    for (i, row) in rows.enumerate() {
        w.to_f32_into(row * k, scratch);
        for ti in 0..t {
            out[i * t + ti] = dot_impl::<f32, FMA>(scratch, &x[ti * k..(ti + 1) * k], |v| v);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_times_vectors_avx2(
    w: WeightView<'_>,
    rows: std::ops::Range<usize>,
    k: usize,
    x: &[f32],
    t: usize,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    rows_times_vectors::<true>(w, rows, k, x, t, out, scratch)
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn rows_dispatch(
    w: WeightView<'_>,
    rows: std::ops::Range<usize>,
    k: usize,
    x: &[f32],
    t: usize,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked above).
        unsafe { rows_times_vectors_avx2(w, rows, k, x, t, out, scratch) };
        return;
    }
    rows_times_vectors::<false>(w, rows, k, x, t, out, scratch)
}

/// `out[i] = w[rows.start + i] · x` on the calling thread: the same arithmetic,
/// row for row, as `matmul` with one vector (so results are bit-identical).
pub fn matvec_rows(w: WeightView<'_>, rows: std::ops::Range<usize>, k: usize, x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), k, "input size");
    assert_eq!(out.len(), rows.len(), "output size");
    assert!(rows.end * k <= w.len(), "rows out of range");
    rows_dispatch(w, rows, k, x, 1, out, &mut Vec::new());
}

/// `out[ti][r] = Σ_c w[r][c] · x[ti][c]` for a weight `w` of shape [n, k] and
/// `t` input vectors; rows are split across threads.
pub fn matmul(w: WeightView<'_>, n: usize, k: usize, x: &[f32], t: usize, out: &mut [f32]) {
    assert_eq!(w.len(), n * k, "weight size");
    assert_eq!(x.len(), t * k, "input size");
    assert_eq!(out.len(), t * n, "output size");
    let threads = rayon::current_num_threads().max(1);
    let rows_per_task = n.div_ceil(threads * 4).max(16);
    let compute = |out_t: &mut [f32]| {
        out_t.par_chunks_mut(rows_per_task * t).enumerate().for_each_init(Vec::new, |scratch, (ci, chunk)| {
            let start = ci * rows_per_task;
            rows_dispatch(w, start..start + chunk.len() / t, k, x, t, chunk, scratch);
        });
    };
    if t == 1 {
        compute(out);
    } else {
        let mut out_t = vec![0f32; n * t];
        compute(&mut out_t);
        for r in 0..n {
            for ti in 0..t {
                out[ti * n + r] = out_t[r * t + ti];
            }
        }
    }
}

/// RMSNorm of each `dim`-sized row of `x` into `out`, scaled by `weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let scale = rms_scale(xr, eps);
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = w * (v * scale);
        }
    }
}

/// `rms_norm` of one row onto itself (the q/k norms of each head).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let scale = rms_scale(x, eps);
    for (v, &w) in x.iter_mut().zip(weight) {
        *v = w * (*v * scale);
    }
}

fn rms_scale(row: &[f32], eps: f32) -> f32 {
    let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
    1.0 / (mean_sq + eps).sqrt()
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Numerically stable softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn matmul_matches_f64_reference_for_every_dtype_and_batch() {
        let mut seed = 7;
        let (n, k) = (37, 53);
        let w32: Vec<f32> = (0..n * k).map(|_| lcg(&mut seed)).collect();
        let wb: Vec<u16> = w32.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
        let wh: Vec<u16> = w32.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
        for t in [1, 3] {
            let x: Vec<f32> = (0..t * k).map(|_| lcg(&mut seed)).collect();
            for view in [WeightView::F32(&w32), WeightView::BF16(&wb), WeightView::F16(&wh)] {
                let mut out = vec![f32::NAN; t * n];
                matmul(view, n, k, &x, t, &mut out);
                for ti in 0..t {
                    for r in 0..n {
                        let want: f64 = (0..k).map(|c| view.get(r * k + c) as f64 * x[ti * k + c] as f64).sum();
                        let got = out[ti * n + r] as f64;
                        assert!((got - want).abs() < 1e-4, "t={t} r={r}: {got} vs {want}");
                    }
                }
            }
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut v = vec![1000.0, 1001.0, -5.0];
        softmax(&mut v);
        assert!((v.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(v[1] > v[0] && v[0] > v[2]);
    }
}
