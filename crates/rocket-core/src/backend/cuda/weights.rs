//! The model's weights in one device arena: every matrix as bf16 (f16/f32
//! checkpoints are converted on the way), q|k|v and gate|up fused into single
//! matrices so each is one GEMV, norms and RoPE frequencies as f32. Uploaded
//! once through two pinned staging buffers, so reading the checkpoint (page
//! faults on the mmap) overlaps the copies to the device.

use super::driver::{Context, DeviceBuffer, Event, PinnedBuffer, Stream};
use crate::error::Result;
use crate::model::{rope, ModelSpec, ModelWeights};
use crate::progress::LoadProgress;
use crate::weights::{Tensor, WeightView};

const STAGING_BYTES: usize = 32 << 20;
const ALIGN: usize = 256;

/// Device addresses of one layer's weights.
pub(crate) struct LayerPtrs {
    pub attn_norm: u64,
    pub qkv: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub o: u64,
    pub mlp_norm: u64,
    pub gate_up: u64,
    pub down: u64,
}

pub(crate) struct DeviceWeights {
    _arena: DeviceBuffer,
    pub bytes: usize,
    pub embed: u64,
    pub lm_head: u64,
    pub final_norm: u64,
    pub inv_freq: u64,
    pub layers: Vec<LayerPtrs>,
}

/// Something to place in the arena.
enum Piece<'a> {
    Matrix(&'a Tensor),
    Floats(&'a [f32]),
}

impl Piece<'_> {
    fn bytes(&self) -> usize {
        match self {
            Piece::Matrix(t) => t.numel() * 2,
            Piece::Floats(v) => v.len() * 4,
        }
    }
}

/// Groups of pieces placed back to back (a fused matrix is one group).
struct Plan<'a> {
    groups: Vec<(usize, Vec<Piece<'a>>)>,
    total: usize,
}

impl<'a> Plan<'a> {
    fn new() -> Self {
        Plan { groups: Vec::new(), total: 0 }
    }

    /// Returns the group's offset in the arena.
    fn place(&mut self, pieces: Vec<Piece<'a>>) -> usize {
        let offset = self.total.next_multiple_of(ALIGN);
        self.total = offset + pieces.iter().map(Piece::bytes).sum::<usize>();
        self.groups.push((offset, pieces));
        offset
    }
}

impl DeviceWeights {
    pub(crate) fn upload(ctx: &Context, stream: &Stream, spec: &ModelSpec, w: &ModelWeights, progress: &LoadProgress) -> Result<Self> {
        let inv_freq = rope::inv_freq(spec);
        let mut plan = Plan::new();
        let embed = plan.place(vec![Piece::Matrix(&w.embed_tokens)]);
        let tied = std::ptr::eq(w.lm_head(), &w.embed_tokens);
        let lm_head = if tied { embed } else { plan.place(vec![Piece::Matrix(w.lm_head())]) };
        let final_norm = plan.place(vec![Piece::Floats(&w.final_norm)]);
        let inv = plan.place(vec![Piece::Floats(&inv_freq)]);
        let mut offsets = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let attn_norm = plan.place(vec![Piece::Floats(&l.attn_norm)]);
            let qkv = plan.place(vec![Piece::Matrix(&l.q_proj), Piece::Matrix(&l.k_proj), Piece::Matrix(&l.v_proj)]);
            let q_norm = l.q_norm.as_deref().map(|n| plan.place(vec![Piece::Floats(n)]));
            let k_norm = l.k_norm.as_deref().map(|n| plan.place(vec![Piece::Floats(n)]));
            let o = plan.place(vec![Piece::Matrix(&l.o_proj)]);
            let mlp_norm = plan.place(vec![Piece::Floats(&l.mlp_norm)]);
            let gate_up = plan.place(vec![Piece::Matrix(&l.gate_proj), Piece::Matrix(&l.up_proj)]);
            let down = plan.place(vec![Piece::Matrix(&l.down_proj)]);
            offsets.push((attn_norm, qkv, q_norm, k_norm, o, mlp_norm, gate_up, down));
        }
        let arena = DeviceBuffer::alloc(ctx, plan.total, "the model weights")?;
        Uploader::new(stream)?.run(&arena, &plan, progress)?;
        let base = arena.ptr;
        let at = |off: usize| base + off as u64;
        let layers = offsets
            .into_iter()
            .map(|(attn_norm, qkv, q_norm, k_norm, o, mlp_norm, gate_up, down)| LayerPtrs {
                attn_norm: at(attn_norm),
                qkv: at(qkv),
                q_norm: q_norm.map_or(0, at),
                k_norm: k_norm.map_or(0, at),
                o: at(o),
                mlp_norm: at(mlp_norm),
                gate_up: at(gate_up),
                down: at(down),
            })
            .collect();
        Ok(DeviceWeights {
            bytes: plan.total,
            embed: at(embed),
            lm_head: at(lm_head),
            final_norm: at(final_norm),
            inv_freq: at(inv),
            layers,
            _arena: arena,
        })
    }
}

/// Double-buffered host → device copies through pinned memory.
struct Uploader<'s> {
    stream: &'s Stream,
    staging: [PinnedBuffer; 2],
    done: [Event; 2],
    used: [bool; 2],
    turn: usize,
}

impl<'s> Uploader<'s> {
    fn new(stream: &'s Stream) -> Result<Self> {
        Ok(Uploader {
            stream,
            staging: [PinnedBuffer::alloc(STAGING_BYTES)?, PinnedBuffer::alloc(STAGING_BYTES)?],
            done: [Event::new()?, Event::new()?],
            used: [false; 2],
            turn: 0,
        })
    }

    fn run(mut self, arena: &DeviceBuffer, plan: &Plan<'_>, progress: &LoadProgress) -> Result<()> {
        progress.phase("uploading", plan.total as u64);
        for (offset, pieces) in &plan.groups {
            let mut at = *offset;
            for piece in pieces {
                match piece {
                    Piece::Floats(v) => self.copy(arena, at, v.len() * 4, |dst: &mut [u8], from| {
                        for (d, x) in dst.chunks_exact_mut(4).zip(&v[from / 4..]) {
                            d.copy_from_slice(&x.to_ne_bytes());
                        }
                    })?,
                    Piece::Matrix(t) => {
                        let view = t.view();
                        self.copy(arena, at, t.numel() * 2, |dst: &mut [u8], from| {
                            let start = from / 2;
                            if let WeightView::BF16(s) = view {
                                // Already bf16: a plain copy (the common case).
                                for (d, v) in dst.chunks_exact_mut(2).zip(&s[start..]) {
                                    d.copy_from_slice(&v.to_ne_bytes());
                                }
                            } else {
                                for (i, d) in dst.chunks_exact_mut(2).enumerate() {
                                    d.copy_from_slice(&bf16_bits(&view, start + i).to_ne_bytes());
                                }
                            }
                        })?
                    }
                }
                progress.advance(piece.bytes() as u64);
                at += piece.bytes();
            }
        }
        self.stream.sync()
    }

    /// Copies `bytes` to `arena[at..]` in staging-sized pieces; `fill(dst, from)`
    /// writes source bytes `from..from + dst.len()` into the staging buffer.
    fn copy(&mut self, arena: &DeviceBuffer, at: usize, bytes: usize, fill: impl Fn(&mut [u8], usize)) -> Result<()> {
        let mut from = 0;
        while from < bytes {
            let n = (bytes - from).min(STAGING_BYTES);
            let i = self.turn;
            if self.used[i] {
                self.done[i].sync()?;
            }
            let buf = &mut self.staging[i].as_mut_slice::<u8>()[..n];
            fill(buf, from);
            arena.upload(self.stream, at + from, buf)?;
            self.done[i].record(self.stream)?;
            self.used[i] = true;
            self.turn = 1 - i;
            from += n;
        }
        Ok(())
    }
}

fn bf16_bits(view: &WeightView<'_>, i: usize) -> u16 {
    match view {
        WeightView::BF16(s) => s[i],
        WeightView::F16(s) => half::bf16::from_f32(half::f16::from_bits(s[i]).to_f32()).to_bits(),
        WeightView::F32(s) => half::bf16::from_f32(s[i]).to_bits(),
    }
}
