//! How rocket's fp16 GEMM (kernels/src/gemm_f16.cu) covers one product: the
//! instantiation, the grid and the split of K (a tile's splits are one thread
//! block cluster), and the shared memory that takes. The launch itself is
//! `Kernels::gemm_f16`.

use super::split_k::split_k;

/// Input rows per CTA (32 MT) of each instantiation (gemm_f16.cu `GEMM_F16(MT)`), in this order.
pub(crate) const GEMM_F16_MT: [usize; 2] = [2, 4];
/// Weight rows per CTA, k per ring block and block size of gemm_f16.cu.
const TILE_N: usize = 128;
const KB: usize = 64;
pub(crate) const GEMM_F16_THREADS: u32 = 256;
/// gemm_f16.cu's `MAX_SPLITS`: a tile's splits are one cluster, at most the portable 8.
const MAX_SPLITS: usize = 8;
/// Shared memory one CTA may take on Hopper (gemm_f16.cu's ring is as deep as that allows, at most 8).
const SMEM_LIMIT: usize = 227 << 10;

/// The passes the fp16 GEMM multiplies, in place of cuBLASLt's fp16 products:
/// those of `CUBLAS_F16_PROMPT_MIN_ROWS` rows up to this many on the pass's own
/// algorithm (`AlgoChoice::FIRST`). Longer passes have enough tiles for cuBLASLt's
/// picks to stream the weights near the copy bandwidth; a pass that continues a
/// cached prefix keeps the 512-row pick it shares bits with (mod.rs `pass_algo`).
pub(crate) const GEMM_F16_MAX_ROWS: usize = 256;

/// Whether the forward pass takes the fp16 GEMM at all: off, because with it a
/// 128-token prompt's first token came later than on cuBLASLt's picks on
/// Llama-3.2-1B and Qwen3-0.6B (its split products and the inputs every weight
/// tile re-reads; benches/NOTES.md has the figures). The GPU tests run the kernel
/// directly either way.
pub(crate) const GEMM_F16_IN_FORWARD: bool = false;

/// The 1,024 bytes the kernel may skip to align its ring to the swizzle's period (gemm_f16.cu `ALIGN`).
const ALIGN: usize = 1024;

/// Dynamic shared memory of `gemm_f16_m{mt}` (gemm_f16.cu `Layout<MT>::BYTES`): a
/// ring of weight + input blocks, and the slack that aligns it.
pub(crate) const fn gemm_f16_smem_bytes(mt: usize) -> usize {
    let stage = TILE_N * KB * 2 + 32 * mt * KB * 2;
    let fit = (SMEM_LIMIT - ALIGN) / stage;
    let stages = if fit > 8 { 8 } else { fit };
    stages * stage + ALIGN
}

/// The split depends only on (n, k) and the SM count, never on the rows, and no
/// MMA mixes rows, so a row's result is the same bits whatever else is in the pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct F16GemmPlan {
    pub mt: usize,
    pub tiles_n: usize,
    pub tiles_m: usize,
    pub splits: usize,
}

impl F16GemmPlan {
    pub(crate) fn new(n: usize, k: usize, rows: usize, sms: usize) -> Self {
        let mt = if rows <= 64 { 2 } else { 4 };
        let tiles_n = n.div_ceil(TILE_N);
        F16GemmPlan { mt, tiles_n, tiles_m: rows.div_ceil(32 * mt), splits: split_k(tiles_n, k / KB, sms, MAX_SPLITS) }
    }

    /// The index of the plan's instantiation in `GEMM_F16_MT`.
    pub(crate) fn instantiation(&self) -> usize {
        GEMM_F16_MT.iter().position(|&mt| mt == self.mt).expect("plans pick instantiated shapes")
    }

    /// Whether the kernel takes a product of an n x k matrix (gemm_f16.cu's contract).
    pub(crate) fn fits(n: usize, k: usize) -> bool {
        n % 8 == 0 && k % KB == 0 && k > 0 && n > 0
    }
}

impl std::fmt::Display for F16GemmPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "m{} {}x{} tiles, split {}", self.mt, self.tiles_n, self.tiles_m, self.splits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100_SMS: usize = 132;
    /// (n, k) of Llama-3.2-1B's qkv, o, gate|up and down; Qwen3-0.6B's; SmolLM2-135M's.
    const SHAPES: [(usize, usize); 12] = [
        (3072, 2048),
        (2048, 2048),
        (16384, 2048),
        (2048, 8192),
        (4096, 1024),
        (1024, 2048),
        (6144, 1024),
        (1024, 3072),
        (960, 576),
        (576, 576),
        (3072, 576),
        (576, 1536),
    ];

    #[test]
    fn splits_fill_the_gpu_and_never_depend_on_rows() {
        let llama: Vec<usize> = SHAPES[..4].iter().map(|&(n, k)| F16GemmPlan::new(n, k, 128, H100_SMS).splits).collect();
        // 24 weight tiles x 5 = 120 CTAs, 16 x 8 = 128, 128 tiles unsplit, 16 x 8.
        assert_eq!(llama, [5, 8, 1, 8]);
        for &(n, k) in &SHAPES {
            let solo = F16GemmPlan::new(n, k, 1, H100_SMS);
            for rows in [33, 64, 65, 128, 200, 256] {
                assert_eq!(F16GemmPlan::new(n, k, rows, H100_SMS).splits, solo.splits, "{n}x{k} at {rows} rows");
            }
            assert!(k / KB / solo.splits >= 2, "{n}x{k}: fewer than two k blocks a split");
        }
    }

    #[test]
    fn tiles_cover_every_row_and_splits_make_portable_clusters() {
        for rows in [1usize, 33, 64, 65, 100, 128, 129, 200, 256] {
            for &(n, k) in &SHAPES {
                let p = F16GemmPlan::new(n, k, rows, H100_SMS);
                assert!(p.tiles_n * TILE_N >= n && p.tiles_m * 32 * p.mt >= rows, "{n}x{k} at {rows} rows: {p:?}");
                assert!((1..=8).contains(&p.splits), "{n}x{k}: a cluster of {} CTAs", p.splits);
                assert_eq!(GEMM_F16_MT[p.instantiation()], p.mt);
            }
        }
        // A 128-row pass is one row tile: every weight streams once.
        assert_eq!(F16GemmPlan::new(2048, 2048, 128, H100_SMS).tiles_m, 1);
    }

    #[test]
    fn shared_memory_fits_hopper_and_kernel_layout() {
        let src = include_str!("../../../../../kernels/src/gemm_f16.cu");
        for mt in GEMM_F16_MT {
            assert!(gemm_f16_smem_bytes(mt) <= SMEM_LIMIT, "m{mt}: {} bytes", gemm_f16_smem_bytes(mt));
            assert!(src.contains(&format!("GEMM_F16({mt})")), "gemm_f16.cu instantiates m{mt}");
        }
        // 7 stages of 32 KiB at 128 rows, 8 of 24 KiB at 64, and the alignment's slack.
        assert_eq!((gemm_f16_smem_bytes(4), gemm_f16_smem_bytes(2)), (((7 * 32) << 10) + 1024, ((8 * 24) << 10) + 1024));
        for (name, value) in [("TILE_N", TILE_N), ("KB", KB), ("THREADS", GEMM_F16_THREADS as usize), ("MAX_SPLITS", MAX_SPLITS), ("ALIGN", ALIGN)] {
            assert!(src.contains(&format!("constexpr int {name} = {value};")), "gemm_f16.cu's {name}");
        }
    }

    #[test]
    fn only_whole_k_blocks_and_8_column_tiles_fit() {
        assert!(F16GemmPlan::fits(960, 576) && F16GemmPlan::fits(2048, 8192));
        assert!(!F16GemmPlan::fits(2048, 100) && !F16GemmPlan::fits(1004, 2048) && !F16GemmPlan::fits(0, 64));
    }
}
