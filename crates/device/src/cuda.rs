//! The CUDA backend (feature `cuda`): each kernel's CUDA C twin (`src/cuda/`), put together with a
//! header typed for its buffers ([`crate::shader::cuda_source`]) and compiled by NVRTC at first
//! use, once per combination of buffer types; the driver JIT-compiles the PTX for the device's
//! architecture and keeps it in its cache. The libraries are opened at run time (`cudarc`'s
//! dynamic loading), so a build needs no CUDA and a machine without a driver gets one line.

use crate::shader::{cuda_source, Kernel};
use crate::{AdapterInfo, DType, DeviceError};
use cudarc::driver::result as dresult;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{result, sys, Ptx};
use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, CString};
use std::sync::{Arc, Mutex};

/// The shared libraries the backend opens, and the pip wheels that ship them.
pub const NVRTC_HINT: &str = "libnvrtc.so.13 (CUDA 13's NVRTC: the `nvidia-cuda-nvrtc` pip wheel ships it under site-packages/nvidia/cu13/lib; put that directory on LD_LIBRARY_PATH)";
pub const DRIVER_HINT: &str = "libcuda.so.1 (the NVIDIA driver)";

/// Whether NVRTC can be opened.
pub fn nvrtc_present() -> bool {
    // SAFETY: only opens the library (dlopen), calling nothing in it.
    unsafe { sys::is_culib_present() }
}

/// Whether the CUDA driver library can be opened.
pub fn driver_present() -> bool {
    // SAFETY: as `nvrtc_present`.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// `src` compiled by NVRTC for `arch` (`sm_80`, `sm_90`, …): its PTX, or the compiler's log.
/// A warning is an error: any log at all fails the compile.
pub fn compile(src: &str, name: &str, arch: &str) -> Result<Vec<u8>, String> {
    if !nvrtc_present() {
        return Err(format!("NVRTC is not installed: {NVRTC_HINT}"));
    }
    let code = CString::new(src).map_err(|_| format!("kernel {name}: a NUL byte in its source"))?;
    let file = CString::new(format!("{name}.cu")).expect("a kernel name has no NUL");
    let prog = result::create_program(&code, Some(&file)).map_err(|e| format!("kernel {name}: NVRTC could not create the program: {e:?}"))?;
    let options = [format!("--gpu-architecture={arch}"), "--std=c++17".into(), "--fmad=true".into()];
    // SAFETY: `prog` is a live program until destroyed below; the log and PTX are copied out.
    let out = unsafe {
        let compiled = result::compile_program(prog, &options);
        let log = result::get_program_log(prog).map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().trim().to_string()).unwrap_or_default();
        let ptx = compiled.and_then(|_| result::get_ptx(prog));
        let _ = result::destroy_program(prog);
        match ptx {
            Ok(p) if log.is_empty() => Ok(p.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect()),
            Ok(_) => Err(format!("kernel {name} ({arch}) compiled with warnings:\n{log}")),
            Err(e) => Err(format!("kernel {name} ({arch}) failed to compile ({e:?}):\n{log}")),
        }
    };
    out
}

/// Every kernel's source for the buffer types a launch may give it: all fp32 (`u32` buffers
/// are read as words whatever their type), and each buffer it only reads as bf16 and as f16.
fn variants(k: &Kernel) -> Vec<Vec<DType>> {
    let n = k.bindings.len();
    let mut out = vec![vec![DType::F32; n]];
    for half in [DType::Bf16, DType::F16] {
        out.push(k.bindings.iter().map(|b| if k.writes.contains(b) { DType::F32 } else { half }).collect());
    }
    out
}

/// Compiles every kernel of the backend for `arch`, in each of its [`variants`]: the number of
/// programs compiled, or the first failure with its log.
pub fn compile_all(arch: &str) -> Result<usize, DeviceError> {
    let mut n = 0;
    for k in crate::all_kernels() {
        for dtypes in variants(k) {
            compile(&cuda_source(k, &dtypes), k.name, arch).map_err(|e| DeviceError(format!("{e}\n(buffers {dtypes:?})")))?;
            n += 1;
        }
    }
    Ok(n)
}

/// A loaded kernel and its block shape `(x, y)`.
type Loaded = (CudaFunction, (u32, u32));

/// One device allocation: the slice that owns it and its address.
pub(crate) struct Mem {
    _slice: CudaSlice<u32>,
    pub ptr: u64,
}

/// The argument block every kernel takes by value: the shape words, then the buffers'
/// addresses in binding order (`shader::cuda_source`'s `KilnParams`).
#[repr(C)]
#[derive(Clone, Copy)]
struct KilnParams {
    a: [u32; crate::shader::MAX_ARGS],
    b: [u64; crate::shader::MAX_BUFFERS],
}

// SAFETY: plain words and addresses, laid out as the CUDA C struct.
unsafe impl DeviceRepr for KilnParams {}

/// An open CUDA device: its context, one stream every kernel, copy and write is ordered on,
/// and the kernels compiled so far (per combination of buffer types).
pub(crate) struct Cu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
    /// Each compiled kernel with its block shape (its WGSL workgroup's), per buffer types.
    functions: Mutex<HashMap<String, Loaded>>,
    arg_lists: Mutex<HashSet<Vec<u32>>>,
}

fn driver_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> DeviceError + '_ {
    move |e| DeviceError(format!("CUDA: {what}: {e:?}"))
}


/// Every CUDA device, as `kiln doctor` lists them; why there are none when the driver or NVRTC
/// cannot be opened.
pub fn devices() -> Result<Vec<AdapterInfo>, DeviceError> {
    if !driver_present() {
        return Err(DeviceError(format!("no CUDA driver: {DRIVER_HINT} could not be opened")));
    }
    cudarc::driver::result::init().map_err(driver_err("cuInit"))?;
    let n = cudarc::driver::result::device::get_count().map_err(driver_err("counting devices"))?;
    (0..n.max(0) as usize).map(|i| info(i, &*CudaContext::new(i).map_err(driver_err("opening a context"))?)).collect()
}

fn info(index: usize, ctx: &CudaContext) -> Result<AdapterInfo, DeviceError> {
    let (major, minor) = ctx.compute_capability().map_err(driver_err("reading the compute capability"))?;
    let mem = ctx.total_mem().map_err(driver_err("reading the memory size"))? as u64;
    Ok(AdapterInfo {
        backend: "cuda",
        index,
        name: ctx.name().map_err(driver_err("reading the name"))?,
        kind: format!("compute capability {major}.{minor}"),
        driver: "CUDA driver".into(),
        max_buffer: mem,
        max_binding: mem,
        shader_f16: true,
    })
}

impl Cu {
    /// Device `index`, with what it is; refused with one line when the driver, NVRTC or the
    /// device is missing.
    pub fn open(index: usize) -> Result<(Cu, AdapterInfo), DeviceError> {
        let all = devices().map_err(|e| DeviceError(format!("--device cuda:{index}: {}", e.0)))?;
        if !nvrtc_present() {
            return Err(DeviceError(format!("--device cuda:{index}: NVRTC is missing: {NVRTC_HINT}")));
        }
        let Some(info) = all.get(index).cloned() else {
            let names: Vec<String> = all.iter().map(|a| format!("cuda:{} {}", a.index, a.name)).collect();
            return Err(DeviceError(format!("--device cuda:{index}: no such device; found {}", if names.is_empty() { "none".into() } else { names.join(", ") })));
        };
        let ctx = CudaContext::new(index).map_err(driver_err("opening a context"))?;
        let (major, minor) = ctx.compute_capability().map_err(driver_err("reading the compute capability"))?;
        let arch = format!("sm_{major}{minor}");
        let stream = ctx.default_stream();
        Ok((Cu { ctx, stream, arch, functions: Mutex::default(), arg_lists: Mutex::default() }, info))
    }

    pub fn alloc(&self, words: usize) -> Result<Mem, DeviceError> {
        let slice = self.stream.alloc_zeros::<u32>(words.max(1)).map_err(driver_err("allocating"))?;
        let (ptr, guard) = slice.device_ptr(&self.stream);
        drop(guard);
        Ok(Mem { _slice: slice, ptr })
    }

    pub(crate) fn cu_stream(&self) -> cudarc::driver::sys::CUstream {
        self.stream.cu_stream()
    }

    pub fn write_words(&self, dst: &Mem, at: usize, data: &[u32]) {
        // SAFETY: `dst` holds `at + data.len()` words (checked by the caller); a pageable source
        // is staged by the driver before the call returns.
        unsafe { dresult::memcpy_htod_async(dst.ptr + 4 * at as u64, data, self.cu_stream()) }.unwrap_or_else(|e| panic!("CUDA write: {e:?}"));
    }

    pub fn download_words(&self, src: &Mem, start: usize, len: usize) -> Vec<u32> {
        let mut out = vec![0u32; len];
        // SAFETY: `src` holds `start + len` words; the stream is synchronised before `out` is read.
        unsafe { dresult::memcpy_dtoh_async(&mut out, src.ptr + 4 * start as u64, self.cu_stream()) }.unwrap_or_else(|e| panic!("CUDA download: {e:?}"));
        self.sync();
        out
    }

    pub fn copy_words(&self, dst: &Mem, dst_at: usize, src: &Mem, src_at: usize, len: usize) {
        // SAFETY: both ranges lie inside their buffers (checked by the caller).
        unsafe { dresult::memcpy_dtod_async(dst.ptr + 4 * dst_at as u64, src.ptr + 4 * src_at as u64, 4 * len, self.cu_stream()) }.unwrap_or_else(|e| panic!("CUDA copy: {e:?}"));
    }

    pub fn clear(&self, b: &Mem, words: usize) {
        // SAFETY: the buffer holds `words` words.
        unsafe { dresult::memset_d8_async(b.ptr, 0, 4 * words.max(1), self.cu_stream()) }.unwrap_or_else(|e| panic!("CUDA clear: {e:?}"));
    }

    pub fn sync(&self) {
        self.stream.synchronize().unwrap_or_else(|e| panic!("CUDA: the device failed: {e:?}"));
    }

    pub fn arg_lists(&self) -> usize {
        self.arg_lists.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Kernel `k` compiled for its buffers' types and loaded, with its block shape (once per
    /// combination).
    fn function(&self, k: &Kernel, dtypes: &[DType]) -> Loaded {
        let key = format!("{}:{dtypes:?}", k.name);
        let mut cache = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = cache.get(&key) {
            return f.clone();
        }
        let ptx = compile(&cuda_source(k, dtypes), k.name, &self.arch).unwrap_or_else(|e| panic!("{e}"));
        let ptx = String::from_utf8(ptx).expect("PTX is text");
        let module = self.ctx.load_module(Ptx::from_src(ptx)).unwrap_or_else(|e| panic!("CUDA: loading kernel {}: {e:?}", k.name));
        let f = module.load_function(k.name).unwrap_or_else(|e| panic!("CUDA: kernel {}: {e:?}", k.name));
        let entry = (f, crate::shader::workgroup_size(k));
        cache.insert(key, entry.clone());
        entry
    }

    /// Launches kernel `k` over `groups` blocks of its workgroup's shape, with `args` and the
    /// buffers `bufs` (binding order, each with its type), in stream order. Returns whether the
    /// argument list is new.
    pub fn launch(&self, k: &Kernel, groups: [u32; 3], args: &[u32], bufs: &[(&Mem, DType)]) -> bool {
        let dtypes: Vec<DType> = bufs.iter().map(|b| b.1).collect();
        let (f, (x, y)) = self.function(k, &dtypes);
        let mut p = KilnParams { a: [0; crate::shader::MAX_ARGS], b: [0; crate::shader::MAX_BUFFERS] };
        p.a[..args.len()].copy_from_slice(args);
        for (slot, (m, _)) in p.b.iter_mut().zip(bufs) {
            *slot = m.ptr;
        }
        let cfg = LaunchConfig { grid_dim: (groups[0], groups[1], groups[2]), block_dim: (x, y, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&f);
        b.arg(&p);
        // SAFETY: the kernel's parameter is one `KilnParams`, and every address in it is a live
        // allocation of at least the extent the launcher checked.
        unsafe { b.launch(cfg) }.unwrap_or_else(|e| panic!("CUDA: launching {}: {e:?}", k.name));
        self.arg_lists.lock().unwrap_or_else(|e| e.into_inner()).insert(args.to_vec())
    }
}
