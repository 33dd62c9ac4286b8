//! Matrix products on cuBLASLt (`MatmulPath::Cublas`): y [rows][n] (+)= x
//! [rows][k] · W[n][k]ᵀ with bf16 inputs, f32 accumulation and an f32 output,
//! for prefill and batched passes. NVIDIA's kernels reach the tensor cores'
//! full rate at prefill sizes (wgmma on Hopper), which rocket's own mma.sync
//! GEMM does not. The activations are rounded to bf16 first (kernels/src/
//! to_bf16.cu), one rounding more than the tensor-core GEMM's hi+lo split.
//!
//! cuBLASLt is loaded at run time (libcublasLt.so from the CUDA toolkit or
//! the `nvidia-cublas` wheel); rocket needs it only when this path is chosen.
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

/// cuBLASLt's recommended workspace on Hopper.
const WORKSPACE_BYTES: usize = 32 << 20;

fn lt_err(what: &str, e: CublasError) -> RocketError {
    RocketError::Device(format!("cuBLASLt {what}: {e}"))
}

/// The descriptors and the chosen algorithm of one product shape.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are plain host objects, used under `Cublas::plans`' lock.
unsafe impl Send for Plan {}

impl Plan {
    fn new(handle: sys::cublasLtHandle_t, n: usize, k: usize, rows: usize) -> std::result::Result<Self, CublasError> {
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)?;
        let mut plan = Plan { desc, a: std::ptr::null_mut(), b: std::ptr::null_mut(), c: std::ptr::null_mut(), algo: unsafe { std::mem::zeroed() } };
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
        plan.a = lt::create_matrix_layout(sys::cudaDataType::CUDA_R_16BF, k as u64, n as u64, k as i64)?;
        plan.b = lt::create_matrix_layout(sys::cudaDataType::CUDA_R_16BF, k as u64, rows as u64, k as i64)?;
        plan.c = lt::create_matrix_layout(sys::cudaDataType::CUDA_R_32F, n as u64, rows as u64, n as i64)?;
        let pref = lt::create_matmul_pref()?;
        let workspace = WORKSPACE_BYTES as u64;
        // SAFETY: every descriptor is live; the preference is destroyed below.
        let heuristic = unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &workspace as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            );
            let found = set.and_then(|()| lt::get_matmul_algo_heuristic(handle, desc, plan.a, plan.b, plan.c, plan.c, pref));
            lt::destroy_matmul_pref(pref)?;
            found?
        };
        plan.algo = heuristic.algo;
        Ok(plan)
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

/// A cuBLASLt handle, its workspace and a plan per product shape.
pub(crate) struct Cublas {
    handle: sys::cublasLtHandle_t,
    workspace: DeviceBuffer,
    plans: Mutex<HashMap<(usize, usize, usize), Plan>>,
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

    /// y [rows][n] (+)= x [rows][k] · W[n][k]ᵀ on `stream`: `w` and `x` bf16,
    /// `y` f32 (added to with `accumulate`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul(&self, stream: &Stream, w: u64, x: u64, y: u64, n: usize, k: usize, rows: usize, accumulate: bool) -> Result<()> {
        let mut plans = self.plans.lock().map_err(|_| RocketError::Internal("the cuBLASLt plans' lock is poisoned".into()))?;
        let plan = match plans.entry((n, k, rows)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Plan::new(self.handle, n, k, rows).map_err(|err| lt_err(&format!("plan for {n}x{k} at {rows} rows"), err))?)
            }
        };
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
                &plan.algo,
                self.workspace.ptr as *mut c_void,
                WORKSPACE_BYTES,
                stream.raw as sys::cudaStream_t,
            )
        }
        .map_err(|e| lt_err(&format!("matmul {n}x{k} at {rows} rows"), e))
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
