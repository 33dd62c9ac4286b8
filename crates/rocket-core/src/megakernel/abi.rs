//! The megakernel's host/kernel contract, in one place: the constants of
//! `kernels/src/mk_geometry.cuh`, the launch parameters and layer table of
//! `kernels/src/mk_params.cuh` (`Params`, `LayerPtrs`), and the instruction
//! encoding its `load_instr` decodes. The headers are the source of truth; the
//! tests below parse them and compare every constant (name, value, order, C
//! type), every struct field (name, order, offset, size) and every instruction
//! field (word, shift, width) with this file. The schedule, the verifier, the
//! CPU twin and the CUDA backend all take these from here.

use super::schedule::{Instr, Op, Wait, Work};

/// Declares the constants of mk_geometry.cuh, in the header's order, with the
/// header's C type; the tests compare the list with the header.
macro_rules! header_constants {
    ($($cty:literal $name:ident: $ty:ty = $value:expr;)*) => {
        $(pub const $name: $ty = $value;)*
        /// (C type, name, value) of every namespace-level constant, in order.
        #[cfg(test)]
        const GEOMETRY: &[(&str, &str, i64)] = &[$(($cty, stringify!($name), $name as i64)),*];
    };
}

header_constants! {
    // Warps 0-7 compute; warp 8 streams weights, warp 9 is the host link.
    "int" CONSUMER_WARPS: usize = 8;
    "int" CONSUMERS: usize = CONSUMER_WARPS * 32;
    "int" THREADS: usize = CONSUMERS + 64;
    // Bytes of one weight ring slot: each slot holds whole rows of one matrix.
    "int" SLOT_BYTES: usize = 16384;
    // Slots in the ring (192 KiB of shared memory).
    "int" SLOTS: usize = 12;
    // Per-instruction partial sums a CTA keeps in shared memory (floats): rows x
    // segments (x 2 for gate|up) of one matrix-vector instruction must fit.
    "int" PART_CAP: usize = 2048;
    // A normed input vector (floats): the hidden size at most.
    "int" VEC_CAP: usize = 2048;
    // Attention splits per KV head at most (partials are sized for this).
    "int" MAX_SPLITS: usize = 64;
    // Context positions each attention split the step uses takes at least: a
    // short context is not cut into slivers whose merge costs more than their work.
    "int" SPLIT_POSITIONS: usize = 64;
    // Query heads per KV head at most (registers of the attention instruction).
    "int" MAX_GROUP: usize = 4;
    // u32 words per encoded instruction.
    "int" INSTR_WORDS: usize = 8;
    // The sampler's bins (`crate::race`, 16 per nat): race keys over a 64-nat
    // ring, weights over the 32 nats below an anchor, anchors over 64 levels.
    "int" RACE_KEY_BINS: usize = 1024;
    "int" RACE_MASS_BINS: usize = 512;
    "int" RACE_LEVELS: usize = 64;
    // Top-k: the largest k the SMs sample together, and each SM's list's entries.
    "int" RACE_TOPK_MAX: usize = 64;
    "int" RACE_LIST: usize = RACE_TOPK_MAX;
    // Logprobs in the loop: alternatives per step at most (sampling.rs `MAX_LOGPROBS`), an SM's
    // part (u64 words: length, maximum, sum of exp, list) and a step's record in the
    // host ring (u32 words: the token's logprob, then each alternative's id and logprob).
    "int" LP_MAX: usize = 20;
    "int" LP_PART: usize = 3 + LP_MAX;
    "int" LP_WORDS: usize = 1 + 2 * LP_MAX;
    // Traced steps: the sampler merge's phase stamps after the trace's other words (profile.rs).
    "int" MERGE_STAMPS: usize = 8;
    // Traced steps: each SM's sampler part's phase stamps, after the merge's.
    "int" PART_STAMPS: usize = 4;
    // Opcodes (`Op`).
    "uint32_t" OP_QKV: u32 = 1;
    "uint32_t" OP_ATTN: u32 = 2;
    "uint32_t" OP_OPROJ: u32 = 3;
    "uint32_t" OP_MLP: u32 = 4;
    "uint32_t" OP_LMHEAD: u32 = 6;
    // Counter 0 counts steps whose input is embedded; the sampler sets STOP_BIT in it to end the loop.
    "uint32_t" STEP_COUNTER: u32 = 0;
    "uint32_t" STOP_BIT: u32 = 0x8000_0000;
    // A claimed op's ring chunk that carries no weights.
    "uint32_t" TAG_END: u32 = 0xffff_ffff;
    // Device state words, indices into `Params::state` (the host reads them after the launch).
    "int" ST_ABORT: usize = 0;
    "int" ST_ERROR: usize = 1;
    "int" ST_ERR_SM: usize = 2;
    // Index into the SM's instruction list, `ERR_AT_STEP_START` or `ERR_AT_LOGPROB_MERGE`.
    "int" ST_ERR_INSTR: usize = 3;
    "int" ST_ERR_STEP: usize = 4;
    "int" ST_ERR_VALUE: usize = 5;
    "int" ST_ERR_TARGET: usize = 6;
    "int" ST_STEPS: usize = 7;
    "int" ST_HOST_STOP: usize = 8;
    // Sampled steps whose token the one-CTA sampler picked (the SMs' merge could not).
    "int" ST_ONE_CTA: usize = 9;
    // Steps whose logprob record the host link has built (their buffers are free again).
    "int" ST_LP_MERGED: usize = 10;
    "int" STATE_WORDS: usize = 16;
    // `ST_ERR_INSTR` when the watchdog fired on the LM head's wait for the host link's
    // logprob record of two steps before (whose buffers the step reuses).
    "uint32_t" ERR_AT_LOGPROB_MERGE: u32 = 0xffff_fffe;
    // The host ring (mapped pinned memory): [0, stop, fault, 0, tokens[max_steps],
    // logprobs[max_steps][LP_WORDS]].
    "int" RING_STOP: usize = 1;
    "int" RING_FAULT: usize = 2;
    "int" RING_TOKENS: usize = 4;
    "uint32_t" RING_EMPTY: u32 = 0xffff_ffff;
    // `fault` is RING_FAULT_COPY | SM when a weight copy never landed (the launch then traps).
    "uint32_t" RING_FAULT_COPY: u32 = 0xc0de_0000;
    // The CTA's dynamic shared memory: the ring, its barriers, a vector, partial sums, scalars.
    "int" SMEM_RING: usize = SLOTS * SLOT_BYTES;
    "int" SMEM_BARRIERS: usize = SMEM_RING;
    "int" SMEM_VEC: usize = SMEM_BARRIERS + 2 * SLOTS * 8;
    "int" SMEM_PART: usize = SMEM_VEC + VEC_CAP * 4;
    "int" SMEM_SCALARS: usize = SMEM_PART + PART_CAP * 4;
    "int" SMEM_SCALAR_WORDS: usize = 64;
    // The sampler's per-SM bins: race keys, then weights at two anchors.
    "int" SMEM_RACE: usize = SMEM_SCALARS + SMEM_SCALAR_WORDS * 4;
    "int" SMEM_BYTES: usize = SMEM_RACE + RACE_KEY_BINS * 8 + 2 * RACE_MASS_BINS * 8;
}

/// `ST_ERR_INSTR` when the watchdog fired on the wait at the start of a step.
pub const ERR_AT_STEP_START: u32 = 0xffff_ffff;

// Hopper gives a CTA at most 227 KiB of shared memory.
const _: () = assert!(SMEM_BYTES <= 227 * 1024);

/// One layer's weights on the device (mk_params.cuh `LayerPtrs`, same order).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerPtrs {
    pub attn_norm: u64,
    pub qkv: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub o: u64,
    pub mlp_norm: u64,
    pub gate_up: u64,
    /// The down-projection transposed ([ff][hidden], the megakernel's own copy).
    pub down_t: u64,
}

/// The kernel's only parameter (mk_params.cuh `Params`, same order): device
/// pointers as u64, 0 for null. What each field holds is documented there.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Params {
    pub instrs: u64,
    pub sm_start: u64,
    pub counters: u64,
    pub state: u64,
    pub layers: u64,
    pub embed: u64,
    pub lm_head: u64,
    pub final_norm: u64,
    pub inv_freq: u64,
    pub x: u64,
    pub qkv: u64,
    pub mlp_acc: u64,
    pub logits: u64,
    pub part_o: u64,
    pub part_ml: u64,
    pub lm_max: u64,
    pub lm_idx: u64,
    pub kv: u64,
    pub forced: u64,
    pub logits_out: u64,
    pub ring: u64,
    pub end_ids: u64,
    pub trace: u64,
    pub sample: u64,
    pub seen_bits: u64,
    pub gen_counts: u64,
    pub sample_items: u64,
    pub tokens: u64,
    pub race_mass: u64,
    pub race_keys: u64,
    pub lp_parts: u64,
    pub lp_out: u64,
    pub lp_logits: u64,
    pub watchdog_ns: u64,
    pub pos0: i32,
    pub first_token: u32,
    pub max_steps: i32,
    pub n_forced: i32,
    pub n_end: i32,
    pub mask_end_steps: i32,
    pub lm_tiles: i32,
    pub splits: i32,
    pub eps: f32,
    pub trace_step: i32,
    pub poll_spin: i32,
    pub weights_evict_first: i32,
    pub hold_qkv: i32,
    pub hold_oproj: i32,
    pub hold_mlp: i32,
    pub counter_stride: i32,
    pub logprobs: i32,
}

// mk_params.cuh asserts the same size (a test reads its static_assert).
const _: () = assert!(std::mem::size_of::<Params>() == 344);

impl Op {
    /// The kernel's opcode.
    pub const fn code(self) -> u32 {
        self as u32
    }

    /// The op with opcode `code`, if any.
    pub fn from_code(code: u32) -> Option<Op> {
        [Op::Qkv, Op::Attn, Op::OProj, Op::Mlp, Op::LmHead].into_iter().find(|op| op.code() == code)
    }
}

/// Where a field of `mk::Instr` sits in the encoded words: word `word`, bits
/// `shift..shift + bits` (mk_params.cuh `load_instr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field {
    pub word: usize,
    pub shift: u32,
    pub bits: u32,
}

impl Field {
    const fn new(word: usize, shift: u32, bits: u32) -> Self {
        Field { word, shift, bits }
    }

    fn mask(self) -> u32 {
        if self.bits == 32 { u32::MAX } else { (1 << self.bits) - 1 }
    }

    fn put(self, words: &mut [u32; INSTR_WORDS], value: u32) {
        debug_assert!(value & !self.mask() == 0, "{value} does not fit {} bits", self.bits);
        words[self.word] |= (value & self.mask()) << self.shift;
    }

    fn get(self, words: &[u32; INSTR_WORDS]) -> u32 {
        (words[self.word] >> self.shift) & self.mask()
    }
}

/// The kernel's instruction fields, in `mk::Instr`'s order. `a`..`d` carry an
/// op's own fields (`Work`): for the matrix-vector ops (Qkv, OProj, Mlp) rows
/// `begin`, `end` and `tile`; for attention `kv_head`, `split`, `splits` and
/// `slot` (always 0 for the GPU kernel, which runs one sequence); for the LM
/// head `tile_rows`, `tiles` and the claim counter `claims`. `d` of the other
/// ops and the last two words are reserved (0).
pub const INSTR_FIELDS: [(&str, Field); 9] = [
    ("op", Field::new(0, 0, 8)),
    ("layer", Field::new(0, 8, 8)),
    ("signal", Field::new(0, 16, 16)),
    ("wait", Field::new(1, 0, 16)),
    ("per_step", Field::new(1, 16, 16)),
    ("a", Field::new(2, 0, 32)),
    ("b", Field::new(3, 0, 32)),
    ("c", Field::new(4, 0, 32)),
    ("d", Field::new(5, 0, 32)),
];
const OP: Field = INSTR_FIELDS[0].1;
const LAYER: Field = INSTR_FIELDS[1].1;
const SIGNAL: Field = INSTR_FIELDS[2].1;
const WAIT: Field = INSTR_FIELDS[3].1;
const PER_STEP: Field = INSTR_FIELDS[4].1;
const OPERANDS: [Field; 4] = [INSTR_FIELDS[5].1, INSTR_FIELDS[6].1, INSTR_FIELDS[7].1, INSTR_FIELDS[8].1];

impl Work {
    /// The op's own fields as the kernel's `a, b, c, d`.
    fn operands(&self) -> [u32; 4] {
        match *self {
            Work::Rows { begin, end, tile } => [begin, end, tile, 0],
            Work::Attn { slot, kv_head, split, splits } => [kv_head, split, splits, slot],
            Work::Claimed { tile_rows, tiles, claims } => [tile_rows, tiles, claims as u32, 0],
        }
    }

    /// The fields `op` carries, from the kernel's `a, b, c, d`.
    fn from_operands(op: Op, [a, b, c, d]: [u32; 4]) -> Result<Work, String> {
        if d != 0 && op != Op::Attn {
            return Err(format!("{op:?} with reserved operand d = {d}"));
        }
        Ok(match op {
            Op::Qkv | Op::OProj | Op::Mlp => Work::Rows { begin: a, end: b, tile: c },
            Op::Attn => Work::Attn { slot: d, kv_head: a, split: b, splits: c },
            Op::LmHead => Work::Claimed { tile_rows: a, tiles: b, claims: u16::try_from(c).map_err(|_| format!("claim counter {c} over 16 bits"))? },
        })
    }
}

impl Instr {
    /// The device encoding (mk_params.cuh `load_instr`, laid out by `INSTR_FIELDS`).
    pub fn encode(&self) -> [u32; INSTR_WORDS] {
        let mut w = [0u32; INSTR_WORDS];
        OP.put(&mut w, self.op.code());
        LAYER.put(&mut w, self.layer as u32);
        SIGNAL.put(&mut w, self.signal as u32);
        WAIT.put(&mut w, self.wait.counter as u32);
        PER_STEP.put(&mut w, self.wait.per_step as u32);
        for (field, v) in OPERANDS.into_iter().zip(self.work.operands()) {
            field.put(&mut w, v);
        }
        w
    }

    /// The instruction `words` encode, as the kernel reads them; an error for
    /// an unknown opcode, a reserved word that is not 0, or fields that do not
    /// fit `Instr`.
    pub fn decode(words: &[u32; INSTR_WORDS]) -> Result<Instr, String> {
        let op = Op::from_code(OP.get(words)).ok_or_else(|| format!("unknown opcode {}", OP.get(words)))?;
        let used: Vec<usize> = INSTR_FIELDS.iter().map(|(_, f)| f.word).collect();
        if let Some(i) = (0..INSTR_WORDS).find(|i| !used.contains(i) && words[*i] != 0) {
            return Err(format!("reserved word {i} is {:#x}", words[i]));
        }
        let layer = u16::try_from(LAYER.get(words)).expect("8 bits");
        let narrow = |v: u32| u16::try_from(v).expect("16 bits");
        let wait = Wait { counter: narrow(WAIT.get(words)), per_step: narrow(PER_STEP.get(words)) };
        let work = Work::from_operands(op, OPERANDS.map(|f| f.get(words)))?;
        Ok(Instr { op, layer, signal: narrow(SIGNAL.get(words)), wait, work })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::megakernel::verify::tests::spec;
    use crate::megakernel::Schedule;

    const GEOMETRY_CUH: &str = include_str!("../../../../kernels/src/mk_geometry.cuh");
    const PARAMS_CUH: &str = include_str!("../../../../kernels/src/mk_params.cuh");

    /// The value of a constant expression of the header: numbers (decimal or
    /// hex, with a `u` suffix), names defined before, `+` and `*`.
    fn eval(expr: &str, known: &[(String, String, i64)]) -> i64 {
        expr.split('+')
            .map(|term| {
                term.split('*')
                    .map(|f| {
                        let f = f.trim();
                        let digits = f.trim_end_matches('u');
                        let parsed = match digits.strip_prefix("0x") {
                            Some(hex) => i64::from_str_radix(hex, 16).ok(),
                            None => digits.parse().ok(),
                        };
                        parsed
                            .or_else(|| known.iter().find(|(_, n, _)| n == f).map(|c| c.2))
                            .unwrap_or_else(|| panic!("cannot evaluate `{f}` in `{expr}`"))
                    })
                    .product::<i64>()
            })
            .sum()
    }

    /// (C type, name, value) of every namespace-level `constexpr` of `header`,
    /// in order (`constexpr T A = 1, B = A * 2;` gives two).
    fn header_constants(header: &str) -> Vec<(String, String, i64)> {
        let mut out: Vec<(String, String, i64)> = Vec::new();
        for line in header.lines() {
            let Some(decl) = line.split("//").next().unwrap().trim().strip_prefix("constexpr ") else { continue };
            let decl = decl.strip_suffix(';').unwrap_or_else(|| panic!("one declaration per line: {line}"));
            let (ty, rest) = decl.split_once(' ').unwrap();
            for item in rest.split(',') {
                let (name, expr) = item.split_once('=').unwrap_or_else(|| panic!("`{item}` has no value"));
                let value = eval(expr, &out);
                out.push((ty.to_string(), name.trim().to_string(), value));
            }
        }
        out
    }

    fn check_constants(header: &str) -> Result<(), String> {
        let kernel = header_constants(header);
        let rust: Vec<(String, String, i64)> = GEOMETRY.iter().map(|&(t, n, v)| (t.to_string(), n.to_string(), v)).collect();
        if kernel == rust {
            return Ok(());
        }
        let first = kernel.iter().zip(&rust).position(|(k, r)| k != r).unwrap_or(kernel.len().min(rust.len()));
        Err(format!("first difference at constant {first}: header {:?}, abi.rs {:?}", kernel.get(first), rust.get(first)))
    }

    #[test]
    fn constants_match_mk_geometry_cuh() {
        check_constants(GEOMETRY_CUH).unwrap();
        // Every C type is one the Rust side mirrors with a type of its width or wider.
        assert!(GEOMETRY.iter().all(|(t, _, _)| ["int", "uint32_t"].contains(t)));
    }

    #[test]
    fn a_changed_header_constant_is_caught() {
        let changed = GEOMETRY_CUH.replace("constexpr int SLOTS = 12;", "constexpr int SLOTS = 11;");
        assert_ne!(changed, GEOMETRY_CUH);
        let e = check_constants(&changed).unwrap_err();
        assert!(e.contains("SLOTS"), "{e}");
        // A derived constant follows what it is made of.
        let derived = GEOMETRY_CUH.replace("THREADS = CONSUMERS + 64;", "THREADS = CONSUMERS + 32;");
        assert!(check_constants(&derived).unwrap_err().contains("THREADS"));
        let renumbered = GEOMETRY_CUH.replace("OP_LMHEAD = 6", "OP_LMHEAD = 5");
        assert!(check_constants(&renumbered).unwrap_err().contains("OP_LMHEAD"));
        let dropped = GEOMETRY_CUH.replace("constexpr int ST_HOST_STOP = 8; ", "");
        assert!(check_constants(&dropped).is_err());
    }

    /// (name, offset, size) of each field of `struct NAME { ... };` in `header`,
    /// and the struct's size, under the C ABI (pointers and `unsigned long
    /// long` 8 bytes, the rest 4, each aligned to its size).
    fn header_struct(header: &str, name: &str) -> (Vec<(String, usize, usize)>, usize) {
        let body = &header[header.find(&format!("struct {name} {{")).unwrap_or_else(|| panic!("{name} not in the header"))..];
        let body = &body[..body.find("};").expect("end of the struct")];
        let (mut offset, mut fields) = (0usize, Vec::new());
        for line in body.lines().skip(1) {
            let decl = line.split("//").next().unwrap_or("").trim();
            let Some(decl) = decl.strip_suffix(';') else { continue };
            let (ty, names) = decl.split_once(|c: char| c == ' ').expect("a field declaration");
            let ty = if ty == "const" || ty == "unsigned" { decl } else { ty };
            for n in names.split(',') {
                let pointer = n.contains('*') || ty.contains('*');
                let size = if pointer || ty.contains("long long") { 8 } else { 4 };
                offset = offset.next_multiple_of(size);
                fields.push((n.trim().trim_start_matches('*').trim().rsplit(' ').next().unwrap().to_string(), offset, size));
                offset += size;
            }
        }
        let size = offset.next_multiple_of(fields.iter().map(|f| f.2).max().unwrap_or(1));
        (fields, size)
    }

    macro_rules! rust_fields {
        ($s:ty: $($f:ident),* $(,)?) => {{
            let v: $s = Default::default();
            vec![$((stringify!($f).to_string(), std::mem::offset_of!($s, $f), std::mem::size_of_val(&v.$f))),*]
        }};
    }

    #[test]
    fn params_match_mk_params_cuh() {
        let (kernel, size) = header_struct(PARAMS_CUH, "Params");
        let rust = rust_fields![Params:
            instrs, sm_start, counters, state, layers, embed, lm_head, final_norm, inv_freq, x, qkv, mlp_acc, logits,
            part_o, part_ml, lm_max, lm_idx, kv, forced, logits_out, ring, end_ids, trace, sample, seen_bits,
            gen_counts, sample_items, tokens, race_mass, race_keys, lp_parts, lp_out, lp_logits, watchdog_ns, pos0, first_token, max_steps, n_forced, n_end,
            mask_end_steps, lm_tiles, splits, eps, trace_step, poll_spin, weights_evict_first, hold_qkv, hold_oproj,
            hold_mlp, counter_stride, logprobs,
        ];
        assert_eq!(kernel, rust);
        assert_eq!(size, std::mem::size_of::<Params>());
        let assert_line = format!("static_assert(sizeof(Params) == {}, ", std::mem::size_of::<Params>());
        assert!(PARAMS_CUH.contains(&assert_line), "mk_params.cuh lacks `{assert_line}`");

        let (kernel, size) = header_struct(PARAMS_CUH, "LayerPtrs");
        let rust = rust_fields![LayerPtrs: attn_norm, qkv, q_norm, k_norm, o, mlp_norm, gate_up, down_t];
        assert_eq!(kernel, rust);
        assert_eq!(size, std::mem::size_of::<LayerPtrs>());
    }

    #[test]
    fn struct_parsing_sees_a_moved_field() {
        let swapped = PARAMS_CUH.replace("    int hold_oproj;\n    int hold_mlp;\n", "    int hold_mlp;\n    int hold_oproj;\n");
        assert_ne!(swapped, PARAMS_CUH);
        let (k, _) = header_struct(&swapped, "Params");
        let (orig, _) = header_struct(PARAMS_CUH, "Params");
        assert_ne!(k, orig);
        let widened = PARAMS_CUH.replace("    int counter_stride;", "    unsigned long long counter_stride;");
        assert_ne!(header_struct(&widened, "Params").1, std::mem::size_of::<Params>());
    }

    /// `mk::Instr`'s fields in order, and where `load_instr` takes each from:
    /// `in.NAME = wK.C [>> S] [& MASK];`.
    fn header_instr_fields(header: &str) -> Vec<(String, Field)> {
        let decl = header[header.find("struct Instr {").expect("Instr")..].lines().nth(1).unwrap().trim();
        let names: Vec<String> = decl.strip_prefix("uint32_t ").unwrap().trim_end_matches(';').split(',').map(|n| n.trim().to_string()).collect();
        let body = &header[header.find("load_instr(").expect("load_instr")..];
        names
            .into_iter()
            .map(|name| {
                let line = body.lines().find(|l| l.trim().starts_with(&format!("in.{name} = "))).unwrap_or_else(|| panic!("load_instr never sets {name}"));
                let rhs = line.split('=').nth(1).unwrap().trim().trim_end_matches(';').replace(['(', ')'], "");
                let mut parts = rhs.split_whitespace();
                let src = parts.next().unwrap();
                let (vec, comp) = src.split_once('.').unwrap();
                let word = vec.trim_start_matches('w').parse::<usize>().unwrap() * 4 + "xyzw".find(comp).unwrap();
                let (mut shift, mut bits) = (0, 32);
                while let (Some(op), Some(arg)) = (parts.next(), parts.next()) {
                    let n = u32::from_str_radix(arg.trim_start_matches("0x"), if arg.starts_with("0x") { 16 } else { 10 }).unwrap();
                    match op {
                        ">>" => {
                            shift = n;
                            bits = 32 - n;
                        }
                        "&" => bits = bits.min(n.count_ones()),
                        _ => panic!("load_instr: `{rhs}`"),
                    }
                }
                (name, Field { word, shift, bits })
            })
            .collect()
    }

    #[test]
    fn instruction_fields_match_load_instr() {
        let kernel = header_instr_fields(PARAMS_CUH);
        let rust: Vec<(String, Field)> = INSTR_FIELDS.iter().map(|&(n, f)| (n.to_string(), f)).collect();
        assert_eq!(kernel, rust);
        // The kernel reads two uint4 per instruction.
        assert!(PARAMS_CUH.contains("p.instrs + 2 * i), w1 = __ldg(p.instrs + 2 * i + 1)") && INSTR_WORDS == 8);
        let moved = PARAMS_CUH.replace("in.layer = (w0.x >> 8) & 0xff;", "in.layer = (w0.x >> 8) & 0xf;");
        assert_ne!(header_instr_fields(&moved), rust);
    }

    #[test]
    fn every_op_round_trips_through_the_encoding() {
        let wait = Wait { counter: 0xfffe, per_step: 0xffff };
        let cases = [
            Instr { op: Op::Qkv, layer: 255, signal: 0xffff, wait, work: Work::Rows { begin: 0, end: u32::MAX, tile: 7 } },
            Instr { op: Op::Attn, layer: 7, signal: 300, wait, work: Work::Attn { slot: 0, kv_head: 3, split: 5, splits: 16 } },
            Instr { op: Op::Attn, layer: 2, signal: 40, wait, work: Work::Attn { slot: 63, kv_head: 1, split: 0, splits: 44 } },
            Instr { op: Op::OProj, layer: 0, signal: 1, wait, work: Work::Rows { begin: 10, end: 20, tile: 4 } },
            Instr { op: Op::Mlp, layer: 1, signal: 2, wait, work: Work::Rows { begin: 1, end: 2, tile: 3 } },
            Instr { op: Op::LmHead, layer: 16, signal: 9, wait, work: Work::Claimed { tile_rows: 32, tiles: 4748, claims: 115 } },
        ];
        for i in cases {
            assert_eq!(Instr::decode(&i.encode()), Ok(i), "{i:?}");
        }
        // Where the kernel reads them: op | layer << 8 | signal << 16, wait | per_step << 16, a, b, c, d, 0, 0.
        assert_eq!(cases[1].encode(), [2 | 7 << 8 | 300 << 16, 0xfffe | 0xffff << 16, 3, 5, 16, 0, 0, 0]);
        assert_eq!(cases[2].encode()[2..6], [1, 0, 44, 63]); // the slot in d
        assert_eq!(cases[5].encode()[2..6], [32, 4748, 115, 0]);
        // Every instruction of real schedules too.
        for sms in [1, 7, 132] {
            let s = Schedule::compile(&spec(576, 1536, 3, 9, 3, 64, 49152), sms).unwrap();
            let (words, _) = s.encode();
            let decoded: Vec<Instr> = words.chunks_exact(INSTR_WORDS).map(|w| Instr::decode(w.try_into().unwrap()).unwrap()).collect();
            assert_eq!(decoded, s.per_sm.concat());
        }
    }

    #[test]
    fn decoding_rejects_what_the_kernel_would_misread() {
        let good = Instr { op: Op::Mlp, layer: 1, signal: 2, wait: Wait { counter: 1, per_step: 1 }, work: Work::Rows { begin: 1, end: 2, tile: 3 } }.encode();
        let mut gap = good;
        gap[0] = (gap[0] & !0xff) | 5; // the unused opcode
        assert!(Instr::decode(&gap).unwrap_err().contains("opcode 5"));
        let mut reserved = good;
        reserved[6] = 1;
        assert!(Instr::decode(&reserved).unwrap_err().contains("reserved word 6"));
        let mut d = good;
        d[5] = 1;
        assert!(Instr::decode(&d).is_err());
        // The op decides which fields the operands are.
        let mut head = good;
        head[0] = (head[0] & !0xff) | OP_LMHEAD;
        assert!(matches!(Instr::decode(&head).unwrap().work, Work::Claimed { tile_rows: 1, tiles: 2, claims: 3 }));
    }

    #[test]
    fn opcodes_are_the_headers() {
        for (op, code) in [(Op::Qkv, OP_QKV), (Op::Attn, OP_ATTN), (Op::OProj, OP_OPROJ), (Op::Mlp, OP_MLP), (Op::LmHead, OP_LMHEAD)] {
            assert_eq!(op.code(), code);
            assert_eq!(Op::from_code(code), Some(op));
        }
        assert_eq!(Op::from_code(0), None);
        assert_eq!(Op::from_code(5), None);
    }
}
