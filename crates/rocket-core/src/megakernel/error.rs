//! How a megakernel launch fails, as values (wrapped by
//! `RocketError::Megakernel`): what the kernel's watchdog reported in its state
//! words, a weight copy that never landed, a launch the host gave up on, and a
//! megakernel taken out of service by an earlier failure.

use super::abi::{self, ERR_AT_LOGPROB_MERGE, ERR_AT_STEP_START, STATE_WORDS};
use super::schedule::{Instr, Schedule, Work};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MegakernelError {
    /// A dependency wait outlasted the watchdog: every SM left the launch.
    #[error("megakernel watchdog: SM {sm} waited over {watchdog_ms} ms at {site} of step {step}: its counter stayed at {value} < {target}")]
    Watchdog { sm: u32, site: StallSite, step: u32, value: u32, target: u32, watchdog_ms: u64 },

    /// A weight copy into SM `sm`'s ring never landed; the kernel trapped, which
    /// loses the CUDA context (`launch_error` is the driver's report).
    #[error(
        "megakernel watchdog: SM {sm} waited over {watchdog_ms} ms for weights the copy engine never delivered; the CUDA \
         context is lost ({launch_error})"
    )]
    CopyFault { sm: u32, watchdog_ms: u64, launch_error: String },

    /// The launch published nothing for `silent_seconds` and did not end: the
    /// host gave up on it, and it may still occupy the GPU.
    #[error(
        "megakernel: it published no token for {silent_seconds:.1} s after step {step} (its watchdog should have ended \
         the launch after {watchdog_ms} ms); the device may be hung"
    )]
    Hung { silent_seconds: f64, step: usize, watchdog_ms: u64 },

    /// The device's step count and the tokens it published disagree.
    #[error("the megakernel ran {device_steps} steps but published {published} tokens")]
    LostTokens { device_steps: usize, published: usize },

    /// An earlier launch failed (`reason`); the megakernel is not launched again.
    #[error("the megakernel is out of service: {reason}")]
    OutOfService { reason: String },

    /// A launch the host gave up on may still run: work queued behind it would never start.
    #[error("the GPU is held by a megakernel launch that never ended; restart the process")]
    GpuHeld,
}

/// Where the watchdog fired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StallSite {
    /// The wait for the step's input embedding.
    StepStart,
    /// The LM head's wait for the host link's logprob record of two steps
    /// before (whose buffers the step reuses).
    LogprobMerge,
    /// Instruction `index` of the SM's list.
    Instr { index: u32, instr: Instr },
    /// An index the schedule does not have (a corrupt report).
    Unknown { index: u32 },
}

impl std::fmt::Display for StallSite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StallSite::StepStart => write!(f, "the start of the step"),
            StallSite::LogprobMerge => write!(f, "the LM head, waiting for the logprob record of two steps before"),
            StallSite::Unknown { index } => write!(f, "instruction {index} (not in the schedule)"),
            StallSite::Instr { instr: i, .. } => match i.work {
                Work::Attn { slot, kv_head, split, .. } => {
                    write!(f, "attention of layer {} (slot {slot}, KV head {kv_head}, split {split})", i.layer)
                }
                Work::Claimed { tiles, .. } => write!(f, "the LM head (claimed tiles, {tiles} per step)"),
                Work::Rows { begin, end, .. } => write!(f, "{:?} of layer {} (rows {begin}..{end})", i.op, i.layer),
            },
        }
    }
}

impl MegakernelError {
    /// The watchdog's report in the device state words after a launch, or None
    /// when it did not fire. `schedule` is the one the launch ran.
    pub fn from_state(state: &[u32; STATE_WORDS], schedule: &Schedule, watchdog_ms: u64) -> Option<Self> {
        if state[abi::ST_ERROR] == 0 {
            return None;
        }
        let (sm, index) = (state[abi::ST_ERR_SM], state[abi::ST_ERR_INSTR]);
        let site = match schedule.per_sm.get(sm as usize).and_then(|l| l.get(index as usize)) {
            _ if index == ERR_AT_STEP_START => StallSite::StepStart,
            _ if index == ERR_AT_LOGPROB_MERGE => StallSite::LogprobMerge,
            Some(&instr) => StallSite::Instr { index, instr },
            None => StallSite::Unknown { index },
        };
        let (step, value, target) = (state[abi::ST_ERR_STEP], state[abi::ST_ERR_VALUE], state[abi::ST_ERR_TARGET]);
        Some(MegakernelError::Watchdog { sm, site, step, value, target, watchdog_ms })
    }

    /// The kernel's note in the ring's fault word after a failed launch, or
    /// None when it left none (the failure was something else).
    pub fn from_fault_word(fault: u32, watchdog_ms: u64, launch_error: &dyn std::fmt::Display) -> Option<Self> {
        (fault & 0xffff_0000 == abi::RING_FAULT_COPY).then(|| MegakernelError::CopyFault { sm: fault & 0xffff, watchdog_ms, launch_error: launch_error.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::megakernel::verify::tests::spec;
    use crate::megakernel::Op;
    use crate::{ErrorKind, RocketError};

    #[test]
    fn the_watchdog_report_names_the_sm_instruction_and_step() {
        let s = Schedule::compile(&spec(576, 1536, 3, 9, 3, 64, 49152), 4).unwrap();
        let mut state = [0u32; STATE_WORDS];
        assert_eq!(MegakernelError::from_state(&state, &s, 200), None);
        let mlp = s.per_sm[2].iter().position(|i| i.op == Op::Mlp).unwrap();
        state[abi::ST_ERROR] = 1;
        state[abi::ST_ERR_SM] = 2;
        state[abi::ST_ERR_INSTR] = mlp as u32;
        state[abi::ST_ERR_STEP] = 1;
        state[abi::ST_ERR_VALUE] = 7;
        state[abi::ST_ERR_TARGET] = 8;
        let e = MegakernelError::from_state(&state, &s, 200).unwrap();
        let MegakernelError::Watchdog { sm: 2, site: StallSite::Instr { index, instr }, step: 1, value: 7, target: 8, watchdog_ms: 200 } = &e else {
            panic!("{e:?}");
        };
        assert_eq!((*index as usize, *instr), (mlp, s.per_sm[2][mlp]));
        let msg = e.to_string();
        assert!(msg.starts_with("megakernel watchdog: SM 2 waited over 200 ms at Mlp of layer ") && msg.ends_with("of step 1: its counter stayed at 7 < 8"), "{msg}");
        state[abi::ST_ERR_INSTR] = ERR_AT_STEP_START;
        assert!(matches!(MegakernelError::from_state(&state, &s, 200), Some(MegakernelError::Watchdog { site: StallSite::StepStart, .. })));
        state[abi::ST_ERR_INSTR] = ERR_AT_LOGPROB_MERGE;
        let e = MegakernelError::from_state(&state, &s, 200).unwrap();
        assert!(matches!(e, MegakernelError::Watchdog { site: StallSite::LogprobMerge, .. }));
        assert!(e.to_string().contains("waiting for the logprob record of two steps before"), "{e}");
        state[abi::ST_ERR_INSTR] = 10_000;
        assert!(matches!(MegakernelError::from_state(&state, &s, 200), Some(MegakernelError::Watchdog { site: StallSite::Unknown { index: 10_000 }, .. })));
    }

    #[test]
    fn a_copy_fault_is_read_from_the_ring() {
        assert_eq!(MegakernelError::from_fault_word(0, 2000, &"x"), None);
        assert_eq!(MegakernelError::from_fault_word(0xc0df_0003, 2000, &"x"), None);
        let e = MegakernelError::from_fault_word(abi::RING_FAULT_COPY | 17, 2000, &"launch failed").unwrap();
        assert_eq!(e, MegakernelError::CopyFault { sm: 17, watchdog_ms: 2000, launch_error: "launch failed".into() });
        // A device error to the front ends (Python's DeviceError), with the same words as before.
        let r: RocketError = e.into();
        assert_eq!(r.kind(), ErrorKind::Device);
        assert!(r.to_string().starts_with("device error: megakernel watchdog: SM 17 waited over 2000 ms for weights"), "{r}");
    }
}
