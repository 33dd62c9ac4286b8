//! Diagnostics for the megakernel's costs. How fast one CTA per SM streams from
//! HBM (kernels/src/stream_probe.cu): the weight ring at several slot sizes and
//! plain loads, each timed on the same random buffer and checked against the
//! buffer's xor computed here. What a dependent L2 load and a release cost, idle
//! and beside a weight stream (kernels/src/latency_probe.cu), each walk checked
//! against the host's walk of the same random chain.
//!
//! The probe kernels are an image of their own (kernels/src/diagnostics.cu),
//! embedded and loaded only here: the shipped rocket image carries none of them.

use super::driver::{self, Arg, Context, DeviceBuffer, Module};
use super::CudaBackend;
use crate::error::{Result, RocketError};
use crate::megakernel::geometry::{SLOTS, SLOT_BYTES};
use crate::sampling::splitmix64;

static CUBIN: &[u8] = include_bytes!("../../../../../kernels/build/diagnostics.sm_90a.cubin");
static PTX: &[u8] = include_bytes!("../../../../../kernels/build/diagnostics.ptx");

/// The probe kernels for this GPU: the sm_90a cubin on Hopper, else the PTX
/// (JIT), as `Kernels::load` picks the product's image. Loaded per probe call
/// (a few ms), so a backend that never probes never holds the module.
pub(super) fn probe_module(ctx: &Context) -> Result<Module> {
    if ctx.compute_capability == (9, 0) {
        Module::load(CUBIN)
    } else {
        let mut ptx = PTX.to_vec();
        ptx.push(0);
        Module::load(&ptx)
    }
}

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
pub(super) fn random_words(n: usize, seed: u64) -> Vec<u64> {
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
        let src = DeviceBuffer::with_data(&inner.ctx, &inner.stream, &host, "the stream probe")?;
        let sink = DeviceBuffer::alloc(&inner.ctx, sms * 16, "the stream probe's sink")?;
        let module = probe_module(&inner.ctx)?;

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
                f.launch_ex(&inner.stream, (sms as u32, 1, 1), block, smem, false, &args)?;
                end.record(&inner.stream)?;
                inner.stream.sync()?;
                let mut sinks = vec![0u32; sms * 4];
                sink.download(&inner.stream, 0, &mut sinks)?;
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

/// What one dependent load from L2 costs (kernels/src/latency_probe.cu): the
/// unit of the megakernel's hand-offs, alone and under its weight stream.
#[derive(Debug, Clone, PartialEq)]
pub struct L2Latency {
    /// ns per dependent load with the GPU otherwise idle.
    pub idle_ns: f64,
    /// The same while every other SM streams HBM (16-byte loads, 8 in flight per thread).
    pub loaded_ns: f64,
    /// Whether both walks ended where the host's walk of the same chain does.
    pub chain_ok: bool,
}

/// 128-byte lines in the latency probe's chain (512 KiB: L2-resident).
const CHAIN_LINES: usize = 4096;
const LINE_WORDS: usize = 32;

/// A random cycle through every line: chain[32 a] = 32 b, b the line after a
/// (the other words random).
fn chain_words(seed: u64) -> Vec<u32> {
    let mut order: Vec<u32> = (0..CHAIN_LINES as u32).collect();
    let draws = random_words(CHAIN_LINES, seed);
    for i in (1..order.len()).rev() {
        order.swap(i, (draws[i] % (i as u64 + 1)) as usize);
    }
    let mut words: Vec<u32> = random_words(CHAIN_LINES * LINE_WORDS / 2, seed ^ 1).iter().flat_map(|&w| [w as u32, (w >> 32) as u32]).collect();
    for k in 0..order.len() {
        words[order[k] as usize * LINE_WORDS] = order[(k + 1) % order.len()] * LINE_WORDS as u32;
    }
    words
}

/// Where `hops` links of `chain` lead from word 0.
fn walk(chain: &[u32], hops: usize) -> u32 {
    (0..hops).fold(0u32, |at, _| chain[at as usize])
}

impl CudaBackend {
    /// Times `hops` dependent L2 loads on one SM, idle and while the other SMs
    /// stream `stream_bytes` of random data from HBM over and over (see
    /// `L2Latency`). A diagnostic for the megakernel's hand-offs.
    pub fn l2_latency_probe(&self, hops: usize, stream_bytes: usize, seed: u64) -> Result<L2Latency> {
        if hops == 0 || hops > i32::MAX as usize {
            return Err(RocketError::invalid_arg("hops", hops, "must be in 1..=2^31-1"));
        }
        let inner = self.lock()?;
        let sms = inner.ctx.sm_count as usize;
        if sms < 2 {
            return Err(RocketError::Device("the latency probe needs at least 2 SMs".into()));
        }
        let per_cta = stream_bytes / (sms - 1) / 16 * 16;
        if per_cta == 0 {
            return Err(RocketError::invalid_arg("stream_bytes", stream_bytes, format!("need at least {} (16 B per streaming SM)", 16 * (sms - 1))));
        }
        let chain = chain_words(seed);
        let want = walk(&chain, hops);
        let chain_buf = DeviceBuffer::with_data(&inner.ctx, &inner.stream, &chain, "the latency probe's chain")?;
        let host = random_words(per_cta * (sms - 1) / 8, seed ^ 2);
        let src = DeviceBuffer::with_data(&inner.ctx, &inner.stream, &host, "the latency probe's stream")?;
        let out = DeviceBuffer::alloc(&inner.ctx, 16, "the latency probe's result")?;
        let flags = DeviceBuffer::alloc(&inner.ctx, 8, "the latency probe's flags")?;
        let sink = DeviceBuffer::alloc(&inner.ctx, sms * 4, "the latency probe's sink")?;
        let module = probe_module(&inner.ctx)?;
        let f = module.function("l2_latency")?;
        let mut ns = [0f64; 2];
        let mut chain_ok = true;
        for (stream, ns) in ns.iter_mut().enumerate() {
            flags.fill_u8(&inner.stream, 0)?;
            out.fill_u8(&inner.stream, 0xff)?;
            let args = [
                Arg::Ptr(chain_buf.ptr),
                Arg::I32(hops as i32),
                Arg::Ptr(src.ptr),
                Arg::U64((per_cta / 16) as u64),
                Arg::I32(stream as i32),
                Arg::Ptr(out.ptr),
                Arg::Ptr(flags.ptr),
                Arg::Ptr(sink.ptr),
            ];
            // Cooperative: CTA 0 waits for the others to start streaming.
            f.launch_ex(&inner.stream, (sms as u32, 1, 1), 256, 0, true, &args)?;
            inner.stream.sync()?;
            let mut got = [0u64; 2];
            out.download(&inner.stream, 0, &mut got)?;
            chain_ok &= got[1] == want as u64;
            *ns = got[0] as f64 / hops as f64;
        }
        Ok(L2Latency { idle_ns: ns[0], loaded_ns: ns[1], chain_ok })
    }
}

/// What a release and a dependent L2 load cost on an SM whose bulk-copy
/// engine has `inflight` 16 KiB copies landing (kernels/src/latency_probe.cu
/// `fence_cost`), every SM alike: the megakernel's `signal` under its own
/// weight stream.
#[derive(Debug, Clone, PartialEq)]
pub struct FenceCost {
    pub inflight: usize,
    /// ns per store + red.release, mean over the SMs (and the slowest SM's).
    pub release_ns: f64,
    pub release_max_ns: f64,
    /// ns per dependent L2 load, mean over the SMs.
    pub load_ns: f64,
    /// Whether every SM's walk ended where the host's does.
    pub chain_ok: bool,
}

impl CudaBackend {
    /// `fence_cost` at each count of copies in flight (0..=SLOTS), `iters` rounds each.
    pub fn fence_probe(&self, inflight: &[usize], iters: usize, seed: u64) -> Result<Vec<FenceCost>> {
        if iters == 0 || iters > i32::MAX as usize {
            return Err(RocketError::invalid_arg("iters", iters, "must be in 1..=2^31-1"));
        }
        if let Some(&bad) = inflight.iter().find(|&&n| n > SLOTS) {
            return Err(RocketError::invalid_arg("inflight", bad, format!("at most {SLOTS} copies (the ring's slots)")));
        }
        let inner = self.lock()?;
        let sms = inner.ctx.sm_count as usize;
        let src_bytes = 256usize << 20;
        let host = random_words(src_bytes / 8, seed);
        let src = DeviceBuffer::with_data(&inner.ctx, &inner.stream, &host, "the fence probe's stream")?;
        let chain = chain_words(seed ^ 3);
        let want = walk(&chain, iters) as u64;
        let chain_buf = DeviceBuffer::with_data(&inner.ctx, &inner.stream, &chain, "the fence probe's chain")?;
        let out = DeviceBuffer::alloc(&inner.ctx, sms * 3 * 8, "the fence probe's result")?;
        let counters = DeviceBuffer::alloc(&inner.ctx, (2 * sms + 2) * LINE_WORDS * 4, "the fence probe's counters")?;
        let smem = SLOTS * SLOT_BYTES + 96; // the ring, its barriers and the stop flag (latency_probe.cu)
        let module = probe_module(&inner.ctx)?;
        let f = module.function("fence_cost")?;
        f.set_max_dynamic_smem(smem)?;
        let mut costs = Vec::new();
        for &n in inflight {
            out.fill_u8(&inner.stream, 0xff)?;
            counters.fill_u8(&inner.stream, 0)?;
            let args = [
                Arg::Ptr(src.ptr),
                Arg::U64(src_bytes as u64),
                Arg::I32(n as i32),
                Arg::Ptr(chain_buf.ptr),
                Arg::I32(iters as i32),
                Arg::Ptr(out.ptr),
                Arg::Ptr(counters.ptr),
            ];
            f.launch_ex(&inner.stream, (sms as u32, 1, 1), 64, smem as u32, true, &args)?;
            inner.stream.sync()?;
            let mut got = vec![0u64; sms * 3];
            out.download(&inner.stream, 0, &mut got)?;
            let release: Vec<f64> = got.chunks(3).map(|c| c[0] as f64).collect();
            costs.push(FenceCost {
                inflight: n,
                release_ns: release.iter().sum::<f64>() / sms as f64,
                release_max_ns: release.iter().cloned().fold(0.0, f64::max),
                load_ns: got.chunks(3).map(|c| c[1] as f64).sum::<f64>() / sms as f64,
                chain_ok: got.chunks(3).all(|c| c[2] == want),
            });
        }
        Ok(costs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latency_chain_is_one_cycle_through_every_line() {
        let chain = chain_words(7);
        let mut seen = vec![false; CHAIN_LINES];
        let mut at = 0u32;
        for _ in 0..CHAIN_LINES {
            assert_eq!(at as usize % LINE_WORDS, 0, "links point at line starts");
            assert!(!std::mem::replace(&mut seen[at as usize / LINE_WORDS], true), "line {} twice", at as usize / LINE_WORDS);
            at = chain[at as usize];
        }
        assert_eq!(at, 0, "the walk comes back to the start");
        assert_eq!(walk(&chain, CHAIN_LINES), 0);
        assert_ne!(chain_words(7), chain_words(8));
    }
}
