//! How fast one CTA per SM streams from HBM (kernels/src/stream_probe.cu): the
//! megakernel's weight ring at several slot sizes and plain loads, each timed on
//! the same random buffer and checked against the buffer's xor computed here.

use super::driver::{self, Arg, DeviceBuffer};
use super::CudaBackend;
use crate::error::{Result, RocketError};
use crate::sampling::splitmix64;

/// One streaming kernel's rate.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamRate {
    /// `ring 16 KiB x 12` (the megakernel's geometry) or `loads`.
    pub kernel: String,
    /// Bytes read per second, in GB/s (best of the repetitions).
    pub read_gbs: f64,
    /// Whether the kernel's xor of the buffer equals the host's.
    pub checksum_ok: bool,
}

/// (function, slot bytes, slots); slot × slots = 192 KiB, the megakernel's ring.
const RINGS: [(&str, usize, usize); 4] =
    [("stream_ring_8k", 8 << 10, 24), ("stream_ring_16k", 16 << 10, 12), ("stream_ring_32k", 32 << 10, 6), ("stream_ring_64k", 64 << 10, 3)];

/// Fresh random bytes for the buffer (never time on zeros): the splitmix64 stream
/// from `seed` (splitmix64 adds its own increment to each input).
fn random_words(n: usize, seed: u64) -> Vec<u64> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            let word = splitmix64(state);
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            word
        })
        .collect()
}

impl CudaBackend {
    /// Streams about `bytes` (rounded down to whole 64 KiB slots per SM) of
    /// random data through each probe kernel, `reps` times after a warm-up, and
    /// reports the best rate of each. A diagnostic for the megakernel's weight
    /// ring: its matrix-vector ops can go no faster than `ring 16 KiB x 12`.
    pub fn stream_probe(&self, bytes: usize, reps: usize, seed: u64) -> Result<Vec<StreamRate>> {
        if reps == 0 {
            return Err(RocketError::invalid_arg("reps", reps, "must be at least 1"));
        }
        let inner = self.lock()?;
        let sms = inner.ctx.sm_count as usize;
        let unit = 64 << 10;
        let per_cta = bytes / sms / unit * unit;
        if per_cta == 0 {
            return Err(RocketError::invalid_arg("bytes", bytes, format!("need at least {} (64 KiB per SM)", sms * unit)));
        }
        let total = per_cta * sms;
        let host = random_words(total / 8, seed);
        let (mut lo, mut hi) = (0u64, 0u64);
        for pair in host.chunks_exact(2) {
            lo ^= pair[0];
            hi ^= pair[1];
        }
        let expected = [lo as u32, (lo >> 32) as u32, hi as u32, (hi >> 32) as u32];
        let src = DeviceBuffer::alloc(&inner.ctx, total, "the stream probe")?;
        src.upload(&inner.stream, 0, &host)?;
        let sink = DeviceBuffer::alloc(&inner.ctx, sms * 16, "the stream probe's sink")?;
        let module = inner.kernels.module();

        let mut kernels: Vec<(String, driver::Function, u32, u32)> = Vec::new();
        for (name, slot, slots) in RINGS {
            let smem = slot * slots + 16 * slots;
            let f = module.function(name)?;
            f.set_max_dynamic_smem(smem)?;
            kernels.push((format!("ring {} KiB x {slots}", slot >> 10), f, 288, smem as u32));
        }
        kernels.push(("loads (8 x 16 B in flight per thread)".into(), module.function("stream_ldg")?, 256, 0));

        let mut rates = Vec::new();
        for (label, f, block, smem) in kernels {
            let args = [Arg::Ptr(src.ptr), Arg::U64(per_cta as u64), Arg::Ptr(sink.ptr)];
            let mut best = f64::INFINITY;
            let mut checksum_ok = true;
            for rep in 0..=reps {
                sink.fill_u8(&inner.stream, 0)?;
                let (start, end) = (driver::TimedEvent::new()?, driver::TimedEvent::new()?);
                start.record(&inner.stream)?;
                f.launch_with_smem(&inner.stream, (sms as u32, 1, 1), block, smem, &args)?;
                end.record(&inner.stream)?;
                inner.stream.sync()?;
                let mut sinks = vec![0u32; sms * 4];
                sink.download(&inner.stream, 0, &mut sinks)?;
                inner.stream.sync()?;
                let mut got = [0u32; 4];
                for cta in sinks.chunks_exact(4) {
                    for k in 0..4 {
                        got[k] ^= cta[k];
                    }
                }
                checksum_ok &= got == expected;
                if rep > 0 {
                    best = best.min(start.elapsed_ms(&end)? as f64);
                }
            }
            rates.push(StreamRate { kernel: label, read_gbs: total as f64 / (best / 1e3) / 1e9, checksum_ok });
        }
        Ok(rates)
    }
}
