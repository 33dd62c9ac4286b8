//! Matrix products on cuBLASLt (`MatmulPath::Cublas`): y [rows][n] (+)= x
//! [rows][k] · W[n][k]ᵀ with 16-bit inputs, f32 accumulation and an f32 output,
//! for prefill and batched passes. NVIDIA's kernels reach the tensor cores'
//! full rate at prefill sizes (wgmma on Hopper), which rocket's own mma.sync
//! GEMM does not.
//!
//! The inputs are fp16: the activations rounded once (kernels/src/to_f16.cu)
//! and an fp16 copy of the layers' matrices, made at the first pass that needs it. fp16 keeps 11
//! significant bits where bf16 keeps 8 (on bf16 activations alone the logits of
//! a tiny checkpoint were 1.1e-2 rel. L2 from the CPU reference, over the 1e-2
//! bar; benches/precision_study.py puts fp16 operands within ~2e-4 of the bf16
//! KV cache's own error). fp16's range is narrower: a pass whose activations
//! leave it is redone, and every later pass runs, on the weights' bf16 with
//! each activation split into bf16 hi and lo parts (kernels/src/to_bf16.cu),
//! two products the second adding to the first: twice the arithmetic, ~16 bits
//! of each activation, as the tensor-core GEMM's hi+lo split keeps.
//!
//! cuBLASLt is loaded at run time (libcublasLt.so from the CUDA toolkit or
//! the `nvidia-cublas` wheel): `matmul cublas` needs it, `matmul auto` uses it
//! for long prefills where it is found.
//!
//! In cuBLAS's column-major terms the product is Yᵀ = W · Xᵀ: A = W stored as
//! a k × n matrix (the row-major [n][k]) used transposed, B = x as k × rows,
//! C = D = y as n × rows. Every call runs on the backend's stream, so it is
//! recorded into the pass's CUDA graph like the other kernels; the workspace is
//! the backend's own, so nothing is allocated during capture.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;

use super::driver::{Context, DeviceBuffer, Stream};
use crate::error::{Result, RocketError};

/// Whether `Cublas::matmul_pinned` has said it fell back (once per process).
static PINNED_REFUSAL_SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// cuBLASLt's recommended workspace on Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;

fn lt_err(what: &str, e: CublasError) -> RocketError {
    RocketError::Device(format!("cuBLASLt {what}: {e}"))
}

/// The alignment cuBLASLt may assume of a pointer: the largest power of two
/// dividing it, up to the 256 bytes its heuristics assume unless told.
fn alignment(ptr: u64) -> u32 {
    1 << ptr.trailing_zeros().min(8)
}

/// The type of a product's two inputs (W and x).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Operands {
    Bf16,
    F16,
}

impl Operands {
    fn data_type(self) -> sys::cudaDataType {
        match self {
            Operands::Bf16 => sys::cudaDataType::CUDA_R_16BF,
            Operands::F16 => sys::cudaDataType::CUDA_R_16F,
        }
    }
}

/// One product's input type, shape and pointers' alignments: what a plan depends on.
type PlanKey = (Operands, usize, usize, usize, [u32; 3]);

/// The descriptors and the candidate algorithms of one product shape.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    /// cuBLASLt's heuristic's candidates, best first (never empty): the forward
    /// pass runs the first.
    candidates: Vec<sys::cublasLtMatmulAlgo_t>,
}

/// Candidates asked of cuBLASLt's heuristic per plan.
const CANDIDATES: usize = 16;

/// Which algorithm a product runs: the heuristic's `candidate`-th (0: its best)
/// for the product at `rows` rows (None: the product's own row count).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct AlgoChoice {
    pub rows: Option<usize>,
    pub candidate: usize,
}

impl AlgoChoice {
    /// What the forward pass runs: the heuristic's best for the product's own rows.
    pub const FIRST: AlgoChoice = AlgoChoice { rows: None, candidate: 0 };

    /// The row count a product of `rows` rows picks its kernel for (cuBLASLt or
    /// another, `matmul_kernel`): a pass pinned to a longer pass's algorithms
    /// takes that pass's kernels too (on the bf16 hi+lo products, cuBLASLt's
    /// share depends on the rows), so its rows get that pass's bits.
    pub(crate) fn kernel_rows(self, rows: usize) -> usize {
        self.rows.map_or(rows, |r| r.max(rows))
    }
}

// SAFETY: the descriptors are plain host objects, used under `Cublas::plans`' lock.
unsafe impl Send for Plan {}

impl Plan {
    fn new(handle: sys::cublasLtHandle_t, (operands, n, k, rows, aligned): PlanKey) -> std::result::Result<Self, CublasError> {
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)?;
        let mut plan = Plan { desc, a: std::ptr::null_mut(), b: std::ptr::null_mut(), c: std::ptr::null_mut(), candidates: Vec::new() };
        // Transposed A: 1 is CUBLAS_OP_T.
        let transpose: i32 = 1;
        // SAFETY: desc is live; the attribute is an i32 as cuBLASLt documents.
        unsafe {
            lt::set_matmul_desc_attribute(
                desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                &transpose as *const i32 as *const c_void,
                std::mem::size_of::<i32>(),
            )?;
        }
        plan.a = lt::create_matrix_layout(operands.data_type(), k as u64, n as u64, k as i64)?;
        plan.b = lt::create_matrix_layout(operands.data_type(), k as u64, rows as u64, k as i64)?;
        plan.c = lt::create_matrix_layout(sys::cudaDataType::CUDA_R_32F, n as u64, rows as u64, n as i64)?;
        let pref = lt::create_matmul_pref()?;
        let workspace = WORKSPACE_BYTES as u64;
        // SAFETY: every descriptor is live; the preference is destroyed below.
        let heuristic = unsafe {
            use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
            let mut set = lt::set_matmul_pref_attribute(
                pref,
                Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &workspace as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            );
            // Only algorithms that work at the pointers' alignment (W, x, then y as C and D).
            let [w_align, x_align, y_align] = aligned;
            for (attr, bytes) in [
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, w_align),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, x_align),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, y_align),
                (Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, y_align),
            ] {
                set = set.and_then(|()| lt::set_matmul_pref_attribute(pref, attr, &bytes as *const u32 as *const c_void, std::mem::size_of::<u32>()));
            }
            let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> = vec![std::mem::zeroed(); CANDIDATES];
            let mut returned: i32 = 0;
            let found = set.and_then(|()| {
                sys::cublasLtMatmulAlgoGetHeuristic(handle, desc, plan.a, plan.b, plan.c, plan.c, pref, CANDIDATES as i32, results.as_mut_ptr(), &mut returned).result()
            });
            lt::destroy_matmul_pref(pref)?;
            found?;
            results.truncate(returned.max(0) as usize);
            results
        };
        plan.candidates = heuristic.iter().filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).map(|r| r.algo).collect();
        if plan.candidates.is_empty() {
            return Err(CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED));
        }
        Ok(plan)
    }
}

#[cfg(feature = "diagnostics")]
impl Plan {
    /// `algo` made to split K `splits` ways under the reduction `scheme`, checked
    /// by cuBLASLt for this plan's shapes and the workspace; or why it refused.
    /// One split is `algo` as the heuristic made it (which may split K itself).
    fn split_algo(&self, handle: sys::cublasLtHandle_t, mut algo: sys::cublasLtMatmulAlgo_t, splits: u32, scheme: u32) -> std::result::Result<sys::cublasLtMatmulAlgo_t, String> {
        if splits <= 1 {
            return Ok(algo);
        }
        use sys::cublasLtMatmulAlgoCapAttributes_t as Cap;
        use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
        let cap = |attr: Cap| -> u32 {
            let (mut v, mut written) = (0u32, 0usize);
            // SAFETY: both capabilities read are 32-bit values per cuBLASLt's documentation.
            let ok = unsafe { sys::cublasLtMatmulAlgoCapGetAttribute(&algo, attr, &mut v as *mut u32 as *mut c_void, 4, &mut written) };
            if ok == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS { v } else { 0 }
        };
        if cap(Cap::CUBLASLT_ALGO_CAP_SPLITK_SUPPORT) == 0 {
            return Err("no split-K support".into());
        }
        let mask = cap(Cap::CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
        if mask & scheme == 0 {
            return Err(format!("reduction scheme {scheme} not in the algorithm's mask {mask}"));
        }
        for (attr, v) in [(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, splits), (A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, scheme)] {
            // SAFETY: both attributes are 32-bit values per cuBLASLt's documentation.
            let set = unsafe { sys::cublasLtMatmulAlgoConfigSetAttribute(&mut algo, attr, &v as *const u32 as *const c_void, 4) };
            if set != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(format!("{attr:?} = {v}: {set:?}"));
            }
        }
        // SAFETY: zero is a valid bit pattern for the plain-old-data result.
        let mut checked: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: the plan's descriptors are live.
        let status = unsafe { sys::cublasLtMatmulAlgoCheck(handle, self.desc, self.a, self.b, self.c, self.c, &algo, &mut checked) };
        if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(format!("check: {status:?}"));
        }
        if checked.workspaceSize > WORKSPACE_BYTES {
            return Err(format!("needs {} bytes of workspace", checked.workspaceSize));
        }
        Ok(algo)
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each descriptor was made by this plan and is destroyed once.
        unsafe {
            for layout in [self.a, self.b, self.c] {
                if !layout.is_null() {
                    let _ = lt::destroy_matrix_layout(layout);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// An algorithm's configuration as cuBLASLt reports it: tile, split-K count,
/// reduction scheme, swizzle, stages and cluster shape (cuBLASLt's enum values).
#[cfg(feature = "diagnostics")]
pub(crate) fn describe_algo(algo: &sys::cublasLtMatmulAlgo_t) -> String {
    use sys::cublasLtMatmulAlgoConfigAttributes_t as A;
    let get = |attr: A| {
        let mut v: u32 = 0;
        let mut written = 0usize;
        // SAFETY: every attribute read is a 32-bit value per cuBLASLt's documentation.
        let ok = unsafe { sys::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, &mut v as *mut u32 as *mut c_void, 4, &mut written) };
        if ok == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS { v as i64 } else { -1 }
    };
    format!(
        "algo {} tile {} splitk {} reduction {} swizzle {} stages {} cluster {}",
        get(A::CUBLASLT_ALGO_CONFIG_ID),
        get(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
        get(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
        get(A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
        get(A::CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
        get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        get(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
    )
}

/// The plan for `key`, made at its first use.
fn plan(plans: &mut HashMap<PlanKey, Plan>, handle: sys::cublasLtHandle_t, key: PlanKey) -> Result<&mut Plan> {
    Ok(match plans.entry(key) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            let (operands, n, k, rows, _) = key;
            e.insert(Plan::new(handle, key).map_err(|err| lt_err(&format!("plan for {operands:?} {n}x{k} at {rows} rows"), err))?)
        }
    })
}

/// A cuBLASLt handle, its workspace and a plan per product shape.
pub(crate) struct Cublas {
    handle: sys::cublasLtHandle_t,
    workspace: DeviceBuffer,
    plans: Mutex<HashMap<PlanKey, Plan>>,
}

// SAFETY: cuBLASLt handles may be used from any thread, one call at a time;
// the backend calls it under its own lock, and the plans have theirs.
unsafe impl Send for Cublas {}
unsafe impl Sync for Cublas {}

impl Cublas {
    /// Loads cuBLASLt for the current context, or says why it cannot.
    pub(crate) fn new(ctx: &Context) -> Result<Self> {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(RocketError::Device(
                "matmul cublas needs cuBLASLt (libcublasLt.so), which was not found: install the CUDA toolkit's \
                 cuBLAS or `pip install nvidia-cublas`, and put the folder holding libcublasLt.so on LD_LIBRARY_PATH \
                 (matmul auto, tensor and gemv need no library)"
                    .into(),
            ));
        }
        let handle = lt::create_handle().map_err(|e| lt_err("create", e))?;
        let workspace = DeviceBuffer::alloc(ctx, WORKSPACE_BYTES, "the cuBLASLt workspace")?;
        Ok(Cublas { handle, workspace, plans: Mutex::new(HashMap::new()) })
    }

    /// y [rows][n] (+)= x [rows][k] · W[n][k]ᵀ on `stream`: `w` and `x` both of
    /// the `operands` type, `y` f32 (added to with `accumulate`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul(&self, stream: &Stream, operands: Operands, w: u64, x: u64, y: u64, n: usize, k: usize, rows: usize, accumulate: bool) -> Result<()> {
        self.matmul_with(stream, operands, w, x, y, n, k, rows, accumulate, AlgoChoice::FIRST).map(|_| ())
    }

    fn lock_plans(&self) -> Result<std::sync::MutexGuard<'_, HashMap<PlanKey, Plan>>> {
        self.plans.lock().map_err(|_| RocketError::Internal("the cuBLASLt plans' lock is poisoned".into()))
    }

    /// `matmul` on the algorithm `choice` names; returns it (`describe_algo` says
    /// what it is), or None (and runs nothing) where the heuristic offered fewer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_with(
        &self,
        stream: &Stream,
        operands: Operands,
        w: u64,
        x: u64,
        y: u64,
        n: usize,
        k: usize,
        rows: usize,
        accumulate: bool,
        choice: AlgoChoice,
    ) -> Result<Option<sys::cublasLtMatmulAlgo_t>> {
        let mut plans = self.lock_plans()?;
        let aligned = [alignment(w), alignment(x), alignment(y)];
        let key = |rows: usize| (operands, n, k, rows, aligned);
        // Another row count's pick: its plan first (the forward pass's own pick needs one lookup).
        let pinned = match choice.rows {
            Some(r) if r != rows => match plan(&mut plans, self.handle, key(r))?.candidates.get(choice.candidate) {
                Some(&algo) => Some(algo),
                None => return Ok(None),
            },
            _ => None,
        };
        let plan = plan(&mut plans, self.handle, key(rows))?;
        let Some(algo) = pinned.or_else(|| plan.candidates.get(choice.candidate).copied()) else { return Ok(None) };
        self.launch(stream, plan, &algo, w, x, y, accumulate).map_err(|e| lt_err(&format!("matmul {n}x{k} at {rows} rows"), e))?;
        Ok(Some(algo))
    }

    /// `matmul` on fp16 operands with the heuristic's `candidate`-th algorithm
    /// made to split K `splits` ways under the reduction `scheme` (cuBLASLt's
    /// `CUBLASLT_REDUCTION_SCHEME_*` value): what splitting would buy the short
    /// prompts' products, whose picks rarely split. Returns the algorithm that ran,
    /// or why cuBLASLt refused it (and runs nothing).
    #[cfg(feature = "diagnostics")]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_split_k(
        &self,
        stream: &Stream,
        w: u64,
        x: u64,
        y: u64,
        n: usize,
        k: usize,
        rows: usize,
        accumulate: bool,
        candidate: usize,
        splits: u32,
        scheme: u32,
    ) -> Result<std::result::Result<sys::cublasLtMatmulAlgo_t, String>> {
        let mut plans = self.lock_plans()?;
        let key = (Operands::F16, n, k, rows, [alignment(w), alignment(x), alignment(y)]);
        let plan = plan(&mut plans, self.handle, key)?;
        let Some(&algo) = plan.candidates.get(candidate) else { return Ok(Err("fewer candidates".into())) };
        let algo = match plan.split_algo(self.handle, algo, splits, scheme) {
            Ok(algo) => algo,
            Err(why) => return Ok(Err(why)),
        };
        self.launch(stream, plan, &algo, w, x, y, accumulate).map_err(|e| lt_err(&format!("split-K matmul {n}x{k} at {rows} rows"), e))?;
        Ok(Ok(algo))
    }

    /// y (+)= x · Wᵀ under `plan` on `algo`, on `stream`.
    #[allow(clippy::too_many_arguments)]
    fn launch(&self, stream: &Stream, plan: &Plan, algo: &sys::cublasLtMatmulAlgo_t, w: u64, x: u64, y: u64, accumulate: bool) -> std::result::Result<(), CublasError> {
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0f32 });
        // SAFETY: the plan's layouts describe these buffers (the caller's
        // pointers hold n·k, rows·k and rows·n elements); the workspace is ours
        // and lives as long as the handle; the stream is the backend's.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                w as *const c_void,
                plan.a,
                x as *const c_void,
                plan.b,
                y as *const c_void,
                plan.c,
                y as *mut c_void,
                plan.c,
                algo,
                self.workspace.ptr as *mut c_void,
                WORKSPACE_BYTES,
                stream.raw as sys::cudaStream_t,
            )
        }
    }

    /// One small product of each operand type on `stream`, checked: a library that
    /// opens but cannot plan or run for this GPU (too old, the wrong one) fails
    /// here, at load, not in the first long prefill.
    pub(crate) fn smoke_test(&self, ctx: &Context, stream: &Stream) -> Result<()> {
        let (n, k, rows) = (128usize, 64usize, 128usize);
        // 1.0 in bf16 and in fp16.
        for (operands, one) in [(Operands::Bf16, 0x3f80u16), (Operands::F16, 0x3c00u16)] {
            let w = DeviceBuffer::with_data(ctx, stream, &vec![one; n * k], "the cuBLASLt check's weights")?;
            let x = DeviceBuffer::with_data(ctx, stream, &vec![one; rows * k], "the cuBLASLt check's inputs")?;
            let y = DeviceBuffer::with_data(ctx, stream, &vec![f32::NAN; rows * n], "the cuBLASLt check's outputs")?;
            self.matmul(stream, operands, w.ptr, x.ptr, y.ptr, n, k, rows, false)?;
            // Accumulating: y = 2k.
            self.matmul(stream, operands, w.ptr, x.ptr, y.ptr, n, k, rows, true)?;
            let mut got = vec![0f32; rows * n];
            y.download(stream, 0, &mut got)?;
            stream.sync()?;
            if let Some(v) = got.iter().find(|&&v| v != (2 * k) as f32) {
                return Err(RocketError::Device(format!("cuBLASLt's {operands:?} check product gave {v}, not {}", 2 * k)));
            }
        }
        Ok(())
    }

    /// y (+)= (hi + lo) · Wᵀ: the product on the activations' bf16 hi and lo
    /// parts (`matmul` twice, the second accumulating).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_split(&self, stream: &Stream, w: u64, hi: u64, lo: u64, y: u64, n: usize, k: usize, rows: usize, choice: AlgoChoice, accumulate: bool) -> Result<()> {
        self.matmul_pinned(stream, Operands::Bf16, w, hi, y, n, k, rows, accumulate, choice)?;
        self.matmul_pinned(stream, Operands::Bf16, w, lo, y, n, k, rows, true, choice)
    }

    /// `matmul` on the algorithm `choice` pins, for the forward pass: where
    /// cuBLASLt refuses it at this row count (as it refused a split-K pick of 128
    /// rows at 2,048) or offers fewer candidates, the product runs on its own row
    /// count's pick instead, said once per process: the pass runs, but its rows
    /// may then lose the bits prefix reuse rests on. A refusal comes before
    /// anything is queued, so nothing runs twice.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_pinned(&self, stream: &Stream, operands: Operands, w: u64, x: u64, y: u64, n: usize, k: usize, rows: usize, accumulate: bool, choice: AlgoChoice) -> Result<()> {
        if choice != AlgoChoice::FIRST {
            let why = match self.matmul_with(stream, operands, w, x, y, n, k, rows, accumulate, choice) {
                Ok(Some(_)) => return Ok(()),
                Ok(None) => "fewer candidates".to_string(),
                Err(RocketError::Device(e)) => e,
                Err(e) => return Err(e),
            };
            if !PINNED_REFUSAL_SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    product = format!("{operands:?} {n}x{k} at {rows} rows"),
                    ?choice,
                    why,
                    "cuBLASLt refused the pinned algorithm: this product runs on its own pick, and a prefix reuse may then change outputs"
                );
            }
        }
        self.matmul(stream, operands, w, x, y, n, k, rows, accumulate)
    }
}

impl Drop for Cublas {
    fn drop(&mut self) {
        if let Ok(mut plans) = self.plans.lock() {
            plans.clear();
        }
        // SAFETY: the handle is destroyed once, after its plans.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0100), 256);
        assert_eq!(alignment(0x7f00_0000_0080), 128);
        assert_eq!(alignment(0x7f00_0000_0010), 16);
        assert_eq!(alignment(0x7f00_0000_0002), 2);
        assert_eq!(alignment(0x7f00_0000_0001), 1);
    }
}
