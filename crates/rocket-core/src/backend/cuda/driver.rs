//! A thin, owned layer over the CUDA driver API (cudarc's `result` functions):
//! the context, device and pinned buffers, one stream, events and graphs, each
//! freed on drop. Nothing here panics when the driver is missing: the library
//! is probed first and every failure becomes a `RocketError::Device`.

use std::ffi::{c_void, CString};

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use crate::error::{Result, RocketError};

pub(crate) fn device_err(what: &str, e: DriverError) -> RocketError {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    RocketError::Device(format!("{what}: {name}"))
}

const GIB: f64 = (1u64 << 30) as f64;

/// The primary context of one device, current on the calling thread.
pub(crate) struct Context {
    ctx: sys::CUcontext,
    dev: sys::CUdevice,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub sm_count: i32,
    pub driver_version: i32,
}

// SAFETY: a CUcontext handle may be used from any thread once made current there
// (`bind`), and rocket serialises all work on it behind the backend's lock.
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Context {
    /// The CUDA devices this process sees (after CUDA_VISIBLE_DEVICES).
    pub(crate) fn device_count() -> Result<usize> {
        // SAFETY: only checks whether libcuda can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(RocketError::Device(
                "no CUDA driver: libcuda.so could not be loaded (no NVIDIA driver on this machine?)".into(),
            ));
        }
        result::init().map_err(|e| device_err("cuInit", e))?;
        let count = result::device::get_count().map_err(|e| device_err("cuDeviceGetCount", e))?;
        Ok(count.max(0) as usize)
    }

    /// Opens device `ordinal` (0 is the first visible GPU).
    pub(crate) fn open(ordinal: usize) -> Result<Self> {
        // SAFETY: only checks whether libcuda can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err(RocketError::Device(
                "no CUDA driver: libcuda.so could not be loaded (no NVIDIA driver on this machine?)".into(),
            ));
        }
        result::init().map_err(|e| device_err("cuInit", e))?;
        let mut driver_version = 0;
        // SAFETY: writes one int.
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }.result().map_err(|e| device_err("cuDriverGetVersion", e))?;
        if driver_version < 13000 {
            return Err(RocketError::Device(format!(
                "the NVIDIA driver supports CUDA {}.{}; rocket needs a CUDA 13.0 driver or newer",
                driver_version / 1000,
                driver_version % 1000 / 10
            )));
        }
        let count = result::device::get_count().map_err(|e| device_err("cuDeviceGetCount", e))?;
        if count < 1 {
            return Err(RocketError::Device("no CUDA device found".into()));
        }
        if ordinal >= count as usize {
            return Err(RocketError::invalid_arg("devices", ordinal, format!("this machine has {count} CUDA device(s): ordinals 0..{}", count - 1)));
        }
        let dev = result::device::get(ordinal as i32).map_err(|e| device_err("cuDeviceGet", e))?;
        let attr = |a| {
            // SAFETY: dev is a valid device.
            unsafe { result::device::get_attribute(dev, a) }.map_err(|e| device_err("cuDeviceGetAttribute", e))
        };
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sm_count = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let name = result::device::get_name(dev).map_err(|e| device_err("cuDeviceGetName", e))?;
        if major < 9 {
            return Err(RocketError::Device(format!(
                "{name} has compute capability {major}.{minor}; rocket's kernels need 9.0 (Hopper) or newer"
            )));
        }
        // SAFETY: dev is valid; the retained context is released in Drop.
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(|e| device_err("cuDevicePrimaryCtxRetain", e))?;
        let c = Context { ctx, dev, name, compute_capability: (major, minor), sm_count, driver_version };
        c.bind()?;
        Ok(c)
    }

    /// Makes the context current on this thread (callers may come from any thread).
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: ctx is a live primary context.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| device_err("cuCtxSetCurrent", e))
    }

    /// (free, total) device memory in bytes.
    pub(crate) fn memory(&self) -> Result<(usize, usize)> {
        result::mem_get_info().map_err(|e| device_err("cuMemGetInfo", e))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `open`.
        let _ = unsafe { result::primary_ctx::release(self.dev) };
    }
}

/// Device memory, freed on drop.
/// The buffer in `slot`, replaced by a new one of `bytes` when it is missing or
/// smaller (the old one is freed first).
pub(crate) fn grown<'a>(slot: &'a mut Option<DeviceBuffer>, ctx: &Context, bytes: usize, what: &str) -> Result<&'a DeviceBuffer> {
    if slot.as_ref().is_none_or(|b| b.bytes < bytes) {
        *slot = None;
        *slot = Some(DeviceBuffer::alloc(ctx, bytes, what)?);
    }
    Ok(slot.as_ref().expect("allocated above"))
}

pub(crate) struct DeviceBuffer {
    pub ptr: sys::CUdeviceptr,
    pub bytes: usize,
    /// Made current again when freeing: a buffer may be dropped on any thread.
    ctx: sys::CUcontext,
}

unsafe impl Send for DeviceBuffer {}
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `bytes` for `what`, saying how much is needed and free when it does not fit.
    pub(crate) fn alloc(ctx: &Context, bytes: usize, what: &str) -> Result<Self> {
        let bytes = bytes.max(256);
        let (free, total) = ctx.memory()?;
        let too_big = || {
            RocketError::DeviceMemory(format!(
                "not enough device memory for {what}: need {:.2} GiB, {:.2} GiB free of {:.2} GiB on {}",
                bytes as f64 / GIB,
                free as f64 / GIB,
                total as f64 / GIB,
                ctx.name
            ))
        };
        if bytes > free {
            return Err(too_big());
        }
        // SAFETY: plain allocation; freed in Drop.
        match unsafe { result::malloc_sync(bytes) } {
            Ok(ptr) => Ok(DeviceBuffer { ptr, bytes, ctx: ctx.ctx }),
            Err(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => Err(too_big()),
            Err(e) => Err(device_err("cuMemAlloc", e)),
        }
    }

    /// A buffer for `what` holding `data`.
    pub(crate) fn with_data<T: Copy>(ctx: &Context, stream: &Stream, data: &[T], what: &str) -> Result<Self> {
        let b = Self::alloc(ctx, std::mem::size_of_val(data), what)?;
        b.upload(stream, 0, data)?;
        Ok(b)
    }

    pub(crate) fn upload<T: Copy>(&self, stream: &Stream, offset: usize, data: &[T]) -> Result<()> {
        assert!(offset + std::mem::size_of_val(data) <= self.bytes, "upload out of bounds");
        // SAFETY: bounds checked; the caller keeps `data` alive until the stream syncs
        // (pinned staging) or uses it synchronously.
        unsafe { result::memcpy_htod_async(self.ptr + offset as u64, data, stream.raw) }.map_err(|e| device_err("cuMemcpyHtoDAsync", e))
    }

    pub(crate) fn download<T: Copy>(&self, stream: &Stream, offset: usize, out: &mut [T]) -> Result<()> {
        assert!(offset + std::mem::size_of_val(out) <= self.bytes, "download out of bounds");
        // SAFETY: bounds checked; synchronised before returning.
        unsafe { result::memcpy_dtoh_async(out, self.ptr + offset as u64, stream.raw) }.map_err(|e| device_err("cuMemcpyDtoHAsync", e))?;
        stream.sync()
    }

    pub(crate) fn copy_from(&self, stream: &Stream, src: &DeviceBuffer) -> Result<()> {
        let n = self.bytes.min(src.bytes);
        // SAFETY: both buffers are at least n bytes.
        unsafe { result::memcpy_dtod_async(self.ptr, src.ptr, n, stream.raw) }.map_err(|e| device_err("cuMemcpyDtoDAsync", e))
    }

    /// Copies the first `bytes` of `src` to the start of this buffer.
    pub(crate) fn copy_prefix_from(&self, stream: &Stream, src: &DeviceBuffer, bytes: usize) -> Result<()> {
        assert!(bytes <= self.bytes && bytes <= src.bytes, "device copy out of bounds");
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both buffers hold at least `bytes` (checked above).
        unsafe { result::memcpy_dtod_async(self.ptr, src.ptr, bytes, stream.raw) }.map_err(|e| device_err("cuMemcpyDtoDAsync", e))
    }

    pub(crate) fn fill_u8(&self, stream: &Stream, value: u8) -> Result<()> {
        // SAFETY: the whole buffer.
        unsafe { result::memset_d8_async(self.ptr, value, self.bytes, stream.raw) }.map_err(|e| device_err("cuMemsetD8Async", e))
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_sync in `ctx` (a primary context, alive while
        // any buffer is), freed once; work using it has been synchronised.
        unsafe {
            let _ = result::ctx::set_current(self.ctx);
            let _ = result::free_sync(self.ptr);
        }
    }
}

/// Page-locked host memory for fast, asynchronous copies.
pub(crate) struct PinnedBuffer {
    ptr: *mut u8,
    pub bytes: usize,
}

unsafe impl Send for PinnedBuffer {}
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    pub(crate) fn alloc(bytes: usize) -> Result<Self> {
        // SAFETY: freed in Drop.
        let ptr = unsafe { result::malloc_host(bytes, 0) }.map_err(|e| device_err("cuMemHostAlloc", e))?;
        Ok(PinnedBuffer { ptr: ptr as *mut u8, bytes })
    }

    pub(crate) fn as_mut_slice<T: Copy>(&mut self) -> &mut [T] {
        // SAFETY: the allocation is `bytes` long and suitably aligned (page-aligned).
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut T, self.bytes / std::mem::size_of::<T>()) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

pub(crate) struct Stream {
    pub raw: sys::CUstream,
}

unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    pub(crate) fn new() -> Result<Self> {
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| device_err("cuStreamCreate", e))?;
        Ok(Stream { raw })
    }

    pub(crate) fn sync(&self) -> Result<()> {
        // SAFETY: live stream.
        unsafe { result::stream::synchronize(self.raw) }.map_err(|e| device_err("kernel execution", e))
    }

    /// Whether everything queued on the stream has finished (an error if it failed).
    pub(crate) fn is_idle(&self) -> Result<bool> {
        // SAFETY: live stream.
        match unsafe { sys::cuStreamQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(device_err("kernel execution", DriverError(e))),
        }
    }

    /// Records everything launched until `end_capture` into a graph.
    pub(crate) fn begin_capture(&self) -> Result<()> {
        // SAFETY: live stream.
        unsafe { result::stream::begin_capture(self.raw, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) }
            .map_err(|e| device_err("cuStreamBeginCapture", e))
    }

    pub(crate) fn end_capture(&self) -> Result<Graph> {
        // SAFETY: live stream in capture mode.
        let graph = unsafe { result::stream::end_capture(self.raw) }.map_err(|e| device_err("cuStreamEndCapture", e))?;
        // SAFETY: graph was just captured; destroyed after instantiation.
        let exec = unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
        unsafe { result::graph::destroy(graph) }.map_err(|e| device_err("cuGraphDestroy", e))?;
        Ok(Graph { exec: exec.map_err(|e| device_err("cuGraphInstantiate", e))? })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: created by stream::create.
        let _ = unsafe { result::stream::destroy(self.raw) };
    }
}

pub(crate) struct Graph {
    exec: sys::CUgraphExec,
}

unsafe impl Send for Graph {}
unsafe impl Sync for Graph {}

impl Graph {
    pub(crate) fn launch(&self, stream: &Stream) -> Result<()> {
        // SAFETY: live executable graph and stream.
        unsafe { result::graph::launch(self.exec, stream.raw) }.map_err(|e| device_err("cuGraphLaunch", e))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: instantiated once, destroyed once.
        let _ = unsafe { result::graph::exec_destroy(self.exec) };
    }
}

pub(crate) struct Event {
    raw: sys::CUevent,
}

unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    pub(crate) fn new() -> Result<Self> {
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(|e| device_err("cuEventCreate", e))?;
        Ok(Event { raw })
    }

    pub(crate) fn record(&self, stream: &Stream) -> Result<()> {
        // SAFETY: live event and stream.
        unsafe { result::event::record(self.raw, stream.raw) }.map_err(|e| device_err("cuEventRecord", e))
    }

    pub(crate) fn sync(&self) -> Result<()> {
        // SAFETY: live event.
        unsafe { result::event::synchronize(self.raw) }.map_err(|e| device_err("cuEventSynchronize", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created by event::create.
        let _ = unsafe { result::event::destroy(self.raw) };
    }
}

/// A loaded module and the functions rocket looks up in it.
pub(crate) struct Module {
    raw: sys::CUmodule,
}

unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    /// `image` is a cubin or a NUL-terminated PTX string.
    pub(crate) fn load(image: &[u8]) -> Result<Self> {
        // SAFETY: the image outlives the call; the driver copies it.
        let raw = unsafe { result::module::load_data(image.as_ptr() as *const c_void) }.map_err(|e| device_err("cuModuleLoadData", e))?;
        Ok(Module { raw })
    }

    pub(crate) fn function(&self, name: &str) -> Result<Function> {
        let cname = CString::new(name).expect("kernel names have no NUL");
        // SAFETY: live module.
        let raw = unsafe { result::module::get_function(self.raw, cname) }.map_err(|e| device_err(&format!("kernel {name}"), e))?;
        Ok(Function { raw })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded once.
        let _ = unsafe { result::module::unload(self.raw) };
    }
}

#[derive(Clone, Copy)]
pub(crate) struct Function {
    raw: sys::CUfunction,
}

unsafe impl Send for Function {}
unsafe impl Sync for Function {}

/// One kernel argument: its bytes, passed by pointer as cuLaunchKernel expects.
#[derive(Clone, Copy)]
pub(crate) enum Arg {
    Ptr(u64),
    /// Only the probes (feature `diagnostics`) pass a 64-bit count.
    #[cfg(feature = "diagnostics")]
    U64(u64),
    I32(i32),
    F32(f32),
}

impl Function {
    /// A launch with `smem` bytes of dynamic shared memory; with `early`, a programmatic dependent launch
    /// (sm_90): the kernel's CTAs may start while the previous kernel in the
    /// stream still runs, so the kernel must call `pdl_wait()` (common.cuh)
    /// before it touches anything an earlier kernel writes. Graph capture
    /// records it as a programmatic edge.
    pub(crate) fn launch_ex(&self, stream: &Stream, grid: (u32, u32, u32), block: u32, smem: u32, early: bool, args: &[Arg]) -> Result<()> {
        self.launch_in_clusters(stream, grid, 1, block, smem, early, args)
    }

    /// `launch_ex` with the grid's z dimension in thread block clusters of
    /// `cluster_z` CTAs (sm_90; it must divide grid.2): a cluster's CTAs run at
    /// once on one GPC and may read each other's shared memory.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_in_clusters(&self, stream: &Stream, grid: (u32, u32, u32), cluster_z: u32, block: u32, smem: u32, early: bool, args: &[Arg]) -> Result<()> {
        let mut storage: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut b = [0u8; 8];
                match a {
                    Arg::Ptr(p) => b.copy_from_slice(&p.to_ne_bytes()),
                    #[cfg(feature = "diagnostics")]
                    Arg::U64(p) => b.copy_from_slice(&p.to_ne_bytes()),
                    Arg::I32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                    Arg::F32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
                }
                b
            })
            .collect();
        let mut params: Vec<*mut c_void> = storage.iter_mut().map(|b| b.as_mut_ptr() as *mut c_void).collect();
        if !early && cluster_z <= 1 {
            // SAFETY: the argument list matches the kernel's signature (each kernels.rs
            // launcher mirrors its .cu contract); buffers outlive the stream's work.
            return unsafe { result::launch_kernel(self.raw, grid, (block, 1, 1), smem, stream.raw, &mut params) }
                .map_err(|e| device_err("cuLaunchKernel", e));
        }
        if cluster_z > 1 && grid.2 % cluster_z != 0 {
            return Err(RocketError::Internal(format!("clusters of {cluster_z} do not tile a grid {grid:?}")));
        }
        let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
        if early {
            // SAFETY: plain-old-data attribute; zero is a valid bit pattern for every field.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            attrs.push(attr);
        }
        if cluster_z > 1 {
            // SAFETY: as above.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attr.value.clusterDim.x = 1;
            attr.value.clusterDim.y = 1;
            attr.value.clusterDim.z = cluster_z;
            attrs.push(attr);
        }
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream.raw,
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as u32,
        };
        // SAFETY: as for launch_kernel above; `config` and `attrs` outlive the call.
        unsafe { sys::cuLaunchKernelEx(&config, self.raw, params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| device_err("cuLaunchKernelEx (programmatic dependent launch or clusters)", e))
    }
}

impl Function {
    /// Lets the kernel use `bytes` of dynamic shared memory (over the 48 KiB default).
    pub(crate) fn set_max_dynamic_smem(&self, bytes: usize) -> Result<()> {
        let attr = sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        // SAFETY: live function; the driver validates the value.
        unsafe { result::function::set_function_attribute(self.raw, attr, bytes as i32) }
            .map_err(|e| device_err("cuFuncSetAttribute(max dynamic shared memory)", e))
    }

    /// CTAs of `block` threads and `smem` dynamic shared memory that fit on one SM.
    pub(crate) fn max_active_blocks(&self, block: u32, smem: usize) -> Result<i32> {
        // SAFETY: live function.
        unsafe { result::occupancy::max_active_block_per_multiprocessor(self.raw, block as i32, smem) }
            .map_err(|e| device_err("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))
    }

    /// A cooperative launch (every CTA resident at once, or an error) of a kernel
    /// whose only parameter is the plain-data struct `params`, passed by value.
    pub(crate) fn launch_cooperative<P: Copy>(&self, stream: &Stream, grid: u32, block: u32, smem: usize, params: &P) -> Result<()> {
        let mut args = [params as *const P as *mut c_void];
        // SAFETY: the kernel's single parameter has P's layout (checked by a size
        // assertion on both sides); buffers it points to outlive the launch.
        unsafe { result::launch_cooperative_kernel(self.raw, (grid, 1, 1), (block, 1, 1), smem as u32, stream.raw, &mut args) }
            .map_err(|e| device_err("cuLaunchCooperativeKernel", e))
    }
}

/// Pinned host memory the device reads and writes directly (the megakernel's
/// token ring): the host side is accessed with volatile reads and writes.
pub(crate) struct MappedBuffer {
    host: *mut u32,
    pub device_ptr: u64,
    pub words: usize,
}

unsafe impl Send for MappedBuffer {}
unsafe impl Sync for MappedBuffer {}

impl MappedBuffer {
    pub(crate) fn alloc(words: usize) -> Result<Self> {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: freed in Drop.
        let host = unsafe { result::malloc_host(words * 4, flags) }.map_err(|e| device_err("cuMemHostAlloc(mapped)", e))? as *mut u32;
        let mut device_ptr = 0;
        // SAFETY: host was allocated with DEVICEMAP just above.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device_ptr, host as *mut c_void, 0) };
        let buffer = MappedBuffer { host, device_ptr, words };
        r.result().map_err(|e| device_err("cuMemHostGetDevicePointer", e))?;
        Ok(buffer)
    }

    pub(crate) fn read(&self, i: usize) -> u32 {
        assert!(i < self.words, "mapped read out of bounds");
        // SAFETY: in bounds; the device writes these words concurrently, hence volatile.
        unsafe { std::ptr::read_volatile(self.host.add(i)) }
    }

    pub(crate) fn write(&self, i: usize, v: u32) {
        assert!(i < self.words, "mapped write out of bounds");
        // SAFETY: in bounds; the device reads these words concurrently, hence volatile.
        unsafe { std::ptr::write_volatile(self.host.add(i), v) }
    }
}

impl Drop for MappedBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host; the launches using it have finished.
        let _ = unsafe { result::free_host(self.host as *mut c_void) };
    }
}

/// An event that records time, for benchmarks.
pub(crate) struct TimedEvent {
    raw: sys::CUevent,
}

impl TimedEvent {
    pub(crate) fn new() -> Result<Self> {
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(|e| device_err("cuEventCreate", e))?;
        Ok(TimedEvent { raw })
    }

    pub(crate) fn record(&self, stream: &Stream) -> Result<()> {
        // SAFETY: live event and stream.
        unsafe { result::event::record(self.raw, stream.raw) }.map_err(|e| device_err("cuEventRecord", e))
    }

    /// Milliseconds from `self` to `end` (both recorded and complete).
    pub(crate) fn elapsed_ms(&self, end: &TimedEvent) -> Result<f32> {
        // SAFETY: live events.
        unsafe { result::event::elapsed(self.raw, end.raw) }.map_err(|e| device_err("cuEventElapsedTime", e))
    }
}

impl Drop for TimedEvent {
    fn drop(&mut self) {
        // SAFETY: created by event::create.
        let _ = unsafe { result::event::destroy(self.raw) };
    }
}
