//! How many ways a GEMM splits K (gemm_tc.cu and gemm_f16.cu share the scheme):
//! the split that minimises the busiest SM's k blocks.

/// The split of `blocks` k blocks over `tiles_n` weight tiles on `sms` SMs that
/// minimises the busiest SM's blocks, counting a split's partial written and read
/// back as one more block, with at least two blocks per split and at most
/// `max_splits` (the smaller split on ties).
pub(crate) fn split_k(tiles_n: usize, blocks: usize, sms: usize, max_splits: usize) -> usize {
    let most = (blocks / 2).clamp(1, max_splits);
    let cost = |s: usize| {
        let per_cta = blocks as f64 / s as f64 + if s > 1 { 1.0 } else { 0.0 };
        (tiles_n * s).div_ceil(sms.max(1)) as f64 * per_cta
    };
    (1..=most).fold(1, |best, s| if cost(s) < cost(best) { s } else { best })
}
