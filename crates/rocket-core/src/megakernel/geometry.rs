//! The megakernel's fixed geometry (its constants are the kernel's, from
//! `abi`, which a test checks against kernels/src/mk_geometry.cuh): how a CTA
//! is split into warps, how big the shared-memory weight ring is, and how a
//! matrix-vector instruction walks its weights through that ring.

pub use super::abi::{CONSUMER_WARPS, MAX_SPLITS, PART_CAP, SLOTS, SLOT_BYTES, SPLIT_POSITIONS};
use crate::model::ModelSpec;

/// Of an attention op's `splits` splits, how many a step with `context`
/// positions uses (the first ones; none of them is empty, the rest are).
pub fn used_splits(context: usize, splits: usize) -> usize {
    splits.min(context.div_ceil(SPLIT_POSITIONS))
}

/// How a matrix with rows of `k` bf16 weights goes through the ring: `rows` whole
/// rows per slot, each row cut into `segments` equal column segments so that
/// `rows * segments` warps share a slot (one (row, segment) each) when a row is
/// long; when rows are short (`segments == 1`) each warp takes rows `w, w+8, ...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatvecShape {
    pub k: usize,
    pub rows: usize,
    pub segments: usize,
}

impl MatvecShape {
    /// None when rows of `k` weights cannot stream through the ring.
    pub fn of(k: usize) -> Option<Self> {
        if k == 0 || k % 8 != 0 || 2 * k > SLOT_BYTES {
            return None;
        }
        let fit = SLOT_BYTES / (2 * k);
        let (rows, segments) = if fit >= CONSUMER_WARPS {
            (fit, 1)
        } else {
            let rows = 1usize << fit.ilog2(); // 1, 2 or 4: a divisor of the warp count
            (rows, CONSUMER_WARPS / rows)
        };
        // Each lane handles 8 columns at a time (one 16-byte load).
        if (k / segments) % 8 != 0 || k % segments != 0 {
            return None;
        }
        Some(MatvecShape { k, rows, segments })
    }
}

/// Whether the MLP instruction's down-projection (transposed rows of `d`
/// weights, kernels/src/mk_geometry.cuh `Scatter`) fits the CTA: each of the
/// 256 consumer threads takes 8 columns of a row, so `d / 8` column groups must
/// not outnumber the threads, and the row lanes' sums (`lanes * d`) must fit the
/// partial sums.
pub fn scatter_fits(d: usize) -> bool {
    let groups = d / 8;
    let threads = CONSUMER_WARPS * 32;
    d % 8 == 0 && groups >= 1 && groups <= threads && scatter_rows(d) >= 1 && (threads / groups) * d <= PART_CAP
}

/// Rows of the transposed down-projection (`d` weights each) in one ring chunk
/// (kernels/src/mk_geometry.cuh `Scatter::ROWS`).
pub fn scatter_rows(d: usize) -> usize {
    SLOT_BYTES / (2 * d)
}

/// Why `spec` cannot be scheduled, or None when it can. (The CUDA kernel also
/// needs an instantiation for the exact shapes: see `backend::cuda::megakernel`.)
pub fn unsupported_reason(spec: &ModelSpec) -> Option<String> {
    for (what, k) in [("hidden_size", spec.hidden_size), ("q_dim", spec.q_dim()), ("intermediate_size", spec.intermediate_size)] {
        if MatvecShape::of(k).is_none() {
            return Some(format!("{what} {k} cannot stream through the {SLOT_BYTES}-byte weight ring"));
        }
    }
    if !scatter_fits(spec.hidden_size) {
        return Some(format!("hidden_size {} does not fit the MLP's down-projection geometry", spec.hidden_size));
    }
    if spec.num_layers > 255 {
        return Some(format!("{} layers (at most 255)", spec.num_layers));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_fuel_width_streams_through_the_ring() {
        // (k, rows per slot, segments) for every matrix width of the four fuels.
        for (k, rows, segments) in [
            (576, 14, 1),  // SmolLM2 hidden
            (1536, 4, 2),  // SmolLM2 ff
            (1024, 8, 1),  // Qwen3-0.6B hidden
            (2048, 4, 2),  // Llama hidden, Qwen3 q_dim
            (3072, 2, 4),  // Qwen3-0.6B ff
            (6144, 1, 8),  // Qwen3-1.7B ff
            (8192, 1, 8),  // Llama ff
        ] {
            let s = MatvecShape::of(k).unwrap();
            assert_eq!((s.rows, s.segments), (rows, segments), "k = {k}");
            assert!(s.rows * k * 2 <= SLOT_BYTES, "k = {k}: a full chunk overflows its slot");
            // A lane's share of a segment is at most 4 groups of 8 columns.
            assert!((k / segments).div_ceil(8 * 32) <= 4, "k = {k}");
        }
        // (hidden, transposed down-projection rows per slot) as the kernel's Scatter<D>.
        for (d, rows) in [(576, 14), (1024, 8), (2048, 4)] {
            assert!(scatter_fits(d), "hidden {d}");
            assert_eq!(scatter_rows(d), rows, "hidden {d}");
        }
        assert!(!scatter_fits(4096) && !scatter_fits(100));
        assert!(MatvecShape::of(8200).is_none());
        assert!(MatvecShape::of(100).is_none());
    }
}
