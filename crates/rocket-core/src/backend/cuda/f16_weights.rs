//! The fp16 copy of the layers' matrices that cuBLASLt's fp16 products read
//! (backend/cuda/cublas.rs), converted on the device from the bf16 arena at the
//! first pass that needs it. The LM head has none: its passes of 128 rows or more (all-position
//! logits) keep the bf16 hi+lo products.

use super::driver::{Context, DeviceBuffer, Stream};
use super::kernels::Kernels;
use super::weights::DeviceWeights;
use crate::error::Result;
use crate::model::ModelSpec;

const ALIGN: usize = 256;

/// Device addresses of one layer's fp16 matrices (the bf16 arena's layout:
/// q|k|v and gate|up fused).
#[derive(Debug, Clone, Copy)]
pub(crate) struct F16Layer {
    pub qkv: u64,
    pub o: u64,
    pub gate_up: u64,
    pub down: u64,
}

pub(crate) struct F16Weights {
    _arena: DeviceBuffer,
    pub bytes: usize,
    pub layers: Vec<F16Layer>,
}

impl F16Weights {
    /// Element counts of one layer's matrices, in `F16Layer`'s order.
    fn layer_shapes(s: &ModelSpec) -> [usize; 4] {
        let (d, ff) = (s.hidden_size, s.intermediate_size);
        [(s.q_dim() + 2 * s.kv_dim()) * d, d * s.q_dim(), 2 * ff * d, d * ff]
    }

    /// Bytes the copy takes on the device.
    pub(crate) fn bytes_for(s: &ModelSpec) -> usize {
        s.num_layers * Self::layer_shapes(s).iter().map(|&n| (2 * n).next_multiple_of(ALIGN)).sum::<usize>()
    }

    /// The copy, or None where a weight's magnitude is past fp16's largest (65,504).
    pub(crate) fn convert(ctx: &Context, stream: &Stream, kernels: &Kernels, s: &ModelSpec, w: &DeviceWeights) -> Result<Option<Self>> {
        let bytes = Self::bytes_for(s);
        let arena = DeviceBuffer::alloc(ctx, bytes, "the fp16 copy of the layers' matrices")?;
        let overflow = DeviceBuffer::with_data(ctx, stream, &[0u32], "the fp16 copy's range flag")?;
        let shapes = Self::layer_shapes(s);
        let mut at = arena.ptr;
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let mut dst = [0u64; 4];
            for (i, (src, n)) in [l.qkv, l.o, l.gate_up, l.down].into_iter().zip(shapes).enumerate() {
                kernels.bf16_to_f16(stream, src, at, n, overflow.ptr)?;
                dst[i] = at;
                at += (2 * n).next_multiple_of(ALIGN) as u64;
            }
            layers.push(F16Layer { qkv: dst[0], o: dst[1], gate_up: dst[2], down: dst[3] });
        }
        let mut flag = [0u32];
        overflow.download(stream, 0, &mut flag)?;
        Ok((flag[0] == 0).then_some(F16Weights { _arena: arena, bytes, layers }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_copy_is_two_bytes_for_every_layer_weight() {
        // Llama-3.2-1B: every matrix is a multiple of the alignment already.
        let s = ModelSpec {
            family: crate::model::Family::Llama,
            hidden_size: 2048,
            intermediate_size: 8192,
            num_layers: 16,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 64,
            vocab_size: 128_256,
            max_position_embeddings: 131_072,
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_scaling: None,
            rope_freq_factors: None,
            tie_word_embeddings: true,
            qk_norm: false,
        };
        // q|k|v 3072 x 2048, o 2048 x 2048, gate|up 16384 x 2048, down 2048 x 8192.
        assert_eq!(F16Weights::bytes_for(&s), 16 * 2 * (3072 * 2048 + 2048 * 2048 + 16384 * 2048 + 2048 * 8192));
        // Odd shapes: q|k|v 120 x 72, o 72 x 72, gate|up 400 x 72, down 72 x 200; each
        // matrix starts aligned.
        let odd = ModelSpec { hidden_size: 72, intermediate_size: 200, num_layers: 1, num_heads: 3, num_kv_heads: 1, head_dim: 24, ..s };
        let unaligned = 2 * (120 * 72 + 72 * 72 + 400 * 72 + 72 * 200);
        let bytes = F16Weights::bytes_for(&odd);
        assert_eq!(bytes, [17_280usize, 10_368, 57_600, 28_800].iter().map(|b| b.next_multiple_of(256)).sum::<usize>());
        assert!(bytes > unaligned && bytes < unaligned + 4 * ALIGN, "{bytes} vs {unaligned}");
        assert_eq!(bytes % ALIGN, 0);
    }
}
