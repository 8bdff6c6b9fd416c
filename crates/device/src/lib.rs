//! kiln's kernels on a GPU: WGSL compute shaders run through `wgpu` on Vulkan (any vendor:
//! NVIDIA, AMD, Intel, and Mesa's lavapipe on a CPU, which is how CI tests them).
//!
//! The seam is llm.c's, moved onto a device: a [`Gpu`] owns the adapter, queue and compiled
//! kernels; a [`Buf`] is a flat device buffer of one [`DType`]; each kernel is a method
//! `Gpu::<op>_forward` / `<op>_backward` with the same argument order, conventions (outputs
//! first; forwards overwrite; backwards accumulate) and results as its CPU twin in `tensor`.
//! Kernels are recorded into one command stream and submitted together at [`Gpu::sync`] or at a
//! download, so a batch of dispatches is one submission.
//!
//! Storage: fp32 as `f32`; bf16 and f16 as packed pairs in `u32` words (element `2j` in the low
//! half), read into fp32 arithmetic by every kernel. f16 goes through WGSL's core
//! `unpack2x16float`, so it needs no `SHADER_F16`; the adapter's `SHADER_F16` is reported by
//! [`adapters`] all the same. Token ids and other integers are [`DType::U32`].
//!
//! Host↔device traffic is counted ([`Gpu::traffic`]), and a kernel's shape arguments are
//! uploaded once per distinct list and cached.

mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
mod head;
#[cfg(feature = "cuda")]
pub mod nccl;
mod kernels;
mod moe;
mod ops;
mod quant;
mod shader;
mod vk;

use std::sync::atomic::{AtomicU64, Ordering};
use tensor::precision::{from_bits16, round, to_bits16, Format};

pub use attention::{KvBlock, MAX_HEAD_SIZE};
pub use head::{slot, Offsets};
pub use kernels::{Gemm, MatSpec, Ragged};
pub use moe::Routing;
pub use ops::{RopePos, ALL_ROWS};
pub use quant::QBuf;

/// Every kernel of the backend, in its module's order.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn all_kernels() -> impl Iterator<Item = &'static shader::Kernel> {
    [kernels::KERNELS, ops::KERNELS, attention::KERNELS, head::KERNELS, moe::KERNELS, quant::KERNELS].into_iter().flatten().copied()
}

/// Why a device could not be opened or used: one line, naming what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceError(pub String);

impl std::fmt::Display for DeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DeviceError {}

/// The element type of a device buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    /// bfloat16, two to a `u32` word; arithmetic in fp32.
    Bf16,
    /// IEEE half, two to a `u32` word; arithmetic in fp32.
    F16,
    /// Token ids, targets, counts.
    U32,
}

impl DType {
    /// `u32` words holding `len` elements.
    pub fn words(self, len: usize) -> usize {
        match self {
            DType::Bf16 | DType::F16 => len.div_ceil(2),
            DType::F32 | DType::U32 => len,
        }
    }

    /// The storage format of a 16-bit type.
    pub fn format(self) -> Option<Format> {
        match self {
            DType::Bf16 => Some(Format::Bf16),
            DType::F16 => Some(Format::Fp16),
            DType::F32 | DType::U32 => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::U32 => "u32",
        }
    }
}

/// What the Vulkan loader (or the CUDA driver) reports about one adapter (`kiln doctor`).
#[derive(Debug, Clone)]
pub struct AdapterInfo {
    /// `vulkan` or `cuda`.
    pub backend: &'static str,
    /// Its index in [`adapters`]' order (or the CUDA driver's): what `--device vulkan:N`
    /// (`cuda:N`) names.
    pub index: usize,
    pub name: String,
    /// Discrete, integrated, virtual, CPU (lavapipe) or other.
    pub kind: String,
    pub driver: String,
    /// The largest single buffer this adapter allows, in bytes.
    pub max_buffer: u64,
    /// The largest buffer one kernel may bind, in bytes.
    pub max_binding: u64,
    pub shader_f16: bool,
}

impl AdapterInfo {
    /// One line: `vulkan:0  NVIDIA H100 (discrete GPU), f16, max buffer 64 GiB, driver …`.
    pub fn describe(&self) -> String {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        format!(
            "{}:{}  {} ({}), shader f16 {}, max buffer {:.2} GiB, max binding {:.2} GiB, driver {}",
            self.backend,
            self.index,
            self.name,
            self.kind,
            if self.shader_f16 { "yes" } else { "no" },
            gib(self.max_buffer),
            gib(self.max_binding),
            self.driver
        )
    }
}

/// Every Vulkan adapter the loader finds, discrete GPUs first (the order `--device vulkan:N`
/// indexes). Empty when there is no loader or no driver.
pub fn adapters() -> Vec<AdapterInfo> {
    vk::sorted_adapters().into_iter().map(|(i, _)| i).collect()
}

/// What to install when no adapter is found: the loader and a driver.
pub const INSTALL_HINT: &str = "install a Vulkan loader and driver (Debian/Ubuntu: `apt-get install libvulkan1 mesa-vulkan-drivers` for Mesa's drivers, lavapipe among them, which runs on the CPU; on NVIDIA or AMD the vendor's driver), or pass --device cpu";

/// A device buffer of `len` elements of `dtype`.
pub struct Buf {
    raw: Raw,
    len: usize,
    dtype: DType,
}

impl Buf {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The view from element `off` (a parameter inside the flat parameter buffer).
    pub fn at(&self, off: usize) -> At<'_> {
        assert!(off <= self.len, "offset {off} past a buffer of {}", self.len);
        At { buf: self, off }
    }

    /// Whether two handles name one device buffer.
    /// A CUDA buffer's device address (`None` on Vulkan).
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_ptr(&self) -> Option<u64> {
        match &self.raw {
            Raw::Cu(m) => Some(m.ptr),
            _ => None,
        }
    }

    pub fn same(&self, other: &Buf) -> bool {
        self.raw == other.raw
    }
}

/// A view of a buffer from element `off` on: how kernels address one parameter of a flat
/// buffer (a whole buffer converts with `.into()`).
#[derive(Clone, Copy)]
pub struct At<'a> {
    pub buf: &'a Buf,
    pub off: usize,
}

impl At<'_> {
    /// Whether `n` elements from `off` lie inside the buffer.
    pub fn fits(&self, n: usize) -> bool {
        self.off + n <= self.buf.len
    }
}

impl<'a> From<&'a Buf> for At<'a> {
    fn from(buf: &'a Buf) -> At<'a> {
        At { buf, off: 0 }
    }
}

/// Where a kernel reads its dropout mask's seed: the `u64` at words `at, at + 1` of `buf` (low
/// word first), turned into site `site`'s seed on the device when given (the CPU model's
/// per-site seeds). A training step writes its pass's seed once; its launches never change.
#[derive(Clone, Copy)]
pub struct Seed<'a> {
    pub buf: &'a Buf,
    pub at: usize,
    pub site: Option<u32>,
}

/// Bytes moved between host and device since the device was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    pub to_device: u64,
    pub to_host: u64,
}

/// One buffer as its backend holds it.
enum Raw {
    Vk(wgpu::Buffer),
    #[cfg(feature = "cuda")]
    Cu(cuda::Mem),
}

impl PartialEq for Raw {
    fn eq(&self, other: &Raw) -> bool {
        match (self, other) {
            (Raw::Vk(a), Raw::Vk(b)) => a == b,
            #[cfg(feature = "cuda")]
            (Raw::Cu(a), Raw::Cu(b)) => a.ptr == b.ptr,
            #[cfg(feature = "cuda")]
            _ => false,
        }
    }
}

/// A zeroed allocation of `bytes` on `backend`.
fn raw_alloc(backend: &Backend, bytes: u64) -> Result<Raw, DeviceError> {
    Ok(match backend {
        Backend::Vk(v) => Raw::Vk(v.storage(bytes)),
        #[cfg(feature = "cuda")]
        Backend::Cu(c) => Raw::Cu(c.alloc(bytes.div_ceil(4) as usize)?),
    })
}

/// The kernel set a device runs: WGSL on Vulkan, or CUDA C on an NVIDIA GPU.
enum Backend {
    Vk(vk::Vk),
    #[cfg(feature = "cuda")]
    Cu(cuda::Cu),
}

/// An open device: its backend (adapter or context, compiled kernels, the stream being
/// recorded) and kiln's counters.
pub struct Gpu {
    pub info: AdapterInfo,
    backend: Backend,
    /// Dispatches recorded since the device was opened, and submissions made.
    dispatches: AtomicU64,
    submissions: AtomicU64,
    to_device: AtomicU64,
    to_host: AtomicU64,
    /// Bytes of the buffers [`Gpu::alloc`] made (kiln's, not the driver's own).
    allocated: AtomicU64,
    /// Bound where a kernel's optional buffer is absent.
    dummy: Buf,
    /// The seed of a kernel called with one directly (written in stream order before it).
    seeds: Buf,
}

/// `Gpu::open`'s answer when the adapter asked for is not there: the adapters found, and what
/// to install when there are none.
pub fn missing(index: usize, found: &[AdapterInfo]) -> DeviceError {
    if found.is_empty() {
        return DeviceError(format!("--device vulkan:{index}: no Vulkan adapter found; {INSTALL_HINT}"));
    }
    let names: Vec<String> = found.iter().map(|a| format!("vulkan:{} {} ({})", a.index, a.name, a.kind)).collect();
    DeviceError(format!("--device vulkan:{index}: no such adapter; found {}", names.join(", ")))
}

impl Gpu {
    /// Opens Vulkan adapter `index` of [`adapters`]' order.
    pub fn open(index: usize) -> Result<Gpu, DeviceError> {
        let all = vk::sorted_adapters();
        let Some((info, adapter)) = all.get(index) else {
            return Err(missing(index, &all.into_iter().map(|(i, _)| i).collect::<Vec<_>>()));
        };
        let backend = Backend::Vk(vk::Vk::open(index, info, adapter)?);
        Gpu::with(backend, info.clone())
    }

    /// Opens CUDA device `index`: one line naming what is missing when the driver, NVRTC or the
    /// device is not there.
    #[cfg(feature = "cuda")]
    pub fn open_cuda(index: usize) -> Result<Gpu, DeviceError> {
        let (cu, info) = cuda::Cu::open(index)?;
        Gpu::with(Backend::Cu(cu), info)
    }

    /// A CUDA device's stream, which every kernel, copy and collective is ordered on (`None`
    /// on Vulkan).
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_stream(&self) -> Option<cudarc::driver::sys::CUstream> {
        match &self.backend {
            Backend::Cu(c) => Some(c.cu_stream()),
            _ => None,
        }
    }

    fn with(backend: Backend, info: AdapterInfo) -> Result<Gpu, DeviceError> {
        let dummy = Buf { raw: raw_alloc(&backend, 4)?, len: 1, dtype: DType::F32 };
        let seeds = Buf { raw: raw_alloc(&backend, 8)?, len: 2, dtype: DType::U32 };
        Ok(Gpu {
            info,
            backend,
            dispatches: AtomicU64::new(0),
            submissions: AtomicU64::new(0),
            to_device: AtomicU64::new(0),
            to_host: AtomicU64::new(0),
            allocated: AtomicU64::new(0),
            dummy,
            seeds,
        })
    }

    /// The backend's name: `vulkan` or `cuda`.
    pub fn backend(&self) -> &'static str {
        self.info.backend
    }

    /// A zeroed buffer of `len` elements of `dtype`, refused (not allocated) past the adapter's
    /// largest buffer.
    pub fn alloc(&self, len: usize, dtype: DType) -> Result<Buf, DeviceError> {
        let bytes = (dtype.words(len).max(1) * 4) as u64;
        if bytes > self.info.max_buffer {
            return Err(DeviceError(format!(
                "a buffer of {len} {} elements ({bytes} bytes) exceeds {}'s largest buffer ({} bytes)",
                dtype.name(),
                self.info.name,
                self.info.max_buffer
            )));
        }
        let raw = raw_alloc(&self.backend, bytes)?;
        self.allocated.fetch_add(bytes, Ordering::Relaxed);
        Ok(Buf { raw, len, dtype })
    }

    /// A zeroed fp32 buffer of `len` elements (panics past the adapter's largest buffer: callers
    /// that size buffers from user input use [`Gpu::alloc`]).
    pub fn zeros(&self, len: usize) -> Buf {
        self.zeros_of(len, DType::F32)
    }

    /// A zeroed buffer of `len` elements of `dtype`.
    pub fn zeros_of(&self, len: usize, dtype: DType) -> Buf {
        self.alloc(len, dtype).unwrap_or_else(|e| panic!("{e}"))
    }

    /// An fp32 buffer holding `data`.
    pub fn upload(&self, data: &[f32]) -> Buf {
        self.upload_as(data, DType::F32)
    }

    /// A buffer of `dtype` holding `data`, each value rounded to it (to nearest, ties to even:
    /// `tensor::precision::round`, what the CPU's mixed precision does).
    pub fn upload_as(&self, data: &[f32], dtype: DType) -> Buf {
        let b = self.zeros_of(data.len(), dtype);
        self.write(&b, data);
        b
    }

    /// A `u32` buffer holding `data` (token ids, targets).
    pub fn upload_u32(&self, data: &[u32]) -> Buf {
        let b = self.zeros_of(data.len(), DType::U32);
        self.write_words(&b, 0, data);
        b
    }

    /// Overwrites `dst[..data.len()]` with `data` in `dst`'s type, ordered after everything
    /// recorded so far.
    pub fn write(&self, dst: &Buf, data: &[f32]) {
        assert!(data.len() <= dst.len, "write of {} elements into a buffer of {}", data.len(), dst.len);
        match dst.dtype.format() {
            None => self.write_words(dst, 0, &data.iter().map(|x| x.to_bits()).collect::<Vec<_>>()),
            Some(fmt) => self.write_words(dst, 0, &pack(data, fmt)),
        }
    }

    /// Overwrites words `at..at + data.len()` of `dst` with `data` (bits), ordered after
    /// everything recorded so far: a step's few scalars, written into one small buffer.
    pub fn write_words(&self, dst: &Buf, at: usize, data: &[u32]) {
        assert!(at + data.len() <= dst.dtype.words(dst.len), "write of {} words at {at} past the buffer", data.len());
        if data.is_empty() {
            return;
        }
        match (&self.backend, &dst.raw) {
            (Backend::Vk(v), Raw::Vk(b)) => v.write_words(b, at, data),
            #[cfg(feature = "cuda")]
            (Backend::Cu(c), Raw::Cu(b)) => c.write_words(b, at, data),
            #[cfg(feature = "cuda")]
            _ => panic!("a buffer of another device"),
        }
        self.to_device.fetch_add(data.len() as u64 * 4, Ordering::Relaxed);
    }

    /// Elements `at..at + data.len()` of an fp32 buffer overwritten with `data`.
    pub fn write_f32(&self, dst: &Buf, at: usize, data: &[f32]) {
        assert!(dst.dtype == DType::F32, "write_f32 into a {:?} buffer", dst.dtype);
        self.write_words(dst, at, &data.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    }

    /// Elements `start..start + len` of an fp32 buffer (waits for every recorded kernel).
    pub fn download_f32(&self, src: &Buf, start: usize, len: usize) -> Vec<f32> {
        assert!(src.dtype == DType::F32, "download_f32 of a {:?} buffer", src.dtype);
        self.download_words(src, start, len).into_iter().map(f32::from_bits).collect()
    }

    /// The buffer's contents as fp32 (waits for every recorded kernel).
    pub fn download(&self, src: &Buf) -> Vec<f32> {
        let words = self.download_words(src, 0, src.dtype.words(src.len));
        match src.dtype.format() {
            None => words.into_iter().map(f32::from_bits).collect(),
            Some(fmt) => unpack(&words, src.len, fmt),
        }
    }

    /// A `u32` buffer's contents.
    pub fn download_u32(&self, src: &Buf) -> Vec<u32> {
        self.download_words(src, 0, src.dtype.words(src.len))
    }

    /// Words `start..start + len` of `src`.
    pub fn download_words(&self, src: &Buf, start: usize, len: usize) -> Vec<u32> {
        assert!(start + len <= src.dtype.words(src.len));
        if len == 0 {
            return Vec::new();
        }
        let (out, submitted) = match (&self.backend, &src.raw) {
            (Backend::Vk(v), Raw::Vk(b)) => v.download_words(b, start, len),
            #[cfg(feature = "cuda")]
            (Backend::Cu(c), Raw::Cu(b)) => (c.download_words(b, start, len), true),
            #[cfg(feature = "cuda")]
            _ => panic!("a buffer of another device"),
        };
        if submitted {
            self.submissions.fetch_add(1, Ordering::Relaxed);
        }
        self.to_host.fetch_add(len as u64 * 4, Ordering::Relaxed);
        out
    }

    /// `dst` words `dst_at..dst_at + len` = `src` words `src_at..`, on the device, in order with
    /// the kernels around it.
    pub fn copy_words(&self, dst: &Buf, dst_at: usize, src: &Buf, src_at: usize, len: usize) {
        assert!(dst_at + len <= dst.dtype.words(dst.len) && src_at + len <= src.dtype.words(src.len), "copy past a buffer");
        if len == 0 {
            return;
        }
        match (&self.backend, &dst.raw, &src.raw) {
            (Backend::Vk(v), Raw::Vk(d), Raw::Vk(s)) => v.copy_words(d, dst_at, s, src_at, len),
            #[cfg(feature = "cuda")]
            (Backend::Cu(c), Raw::Cu(d), Raw::Cu(s)) => c.copy_words(d, dst_at, s, src_at, len),
            #[cfg(feature = "cuda")]
            _ => panic!("a buffer of another device"),
        }
    }

    /// `seed` written to the device's own seed slot, in stream order: for the kernels called
    /// with a seed value (each such call uploads its 8 bytes).
    fn direct_seed(&self, seed: u64) -> Seed<'_> {
        self.write_words(&self.seeds, 0, &[seed as u32, (seed >> 32) as u32]);
        Seed { buf: &self.seeds, at: 0, site: None }
    }

    /// Distinct kernel argument lists launched so far: a training step that adds none after its
    /// first records the same launches every time.
    pub fn arg_lists(&self) -> usize {
        match &self.backend {
            Backend::Vk(v) => v.arg_lists(),
            #[cfg(feature = "cuda")]
            Backend::Cu(c) => c.arg_lists(),
        }
    }

    /// Sets every element to zero, on the device.
    pub fn clear(&self, b: &Buf) {
        match (&self.backend, &b.raw) {
            (Backend::Vk(v), Raw::Vk(r)) => v.clear(r),
            #[cfg(feature = "cuda")]
            (Backend::Cu(c), Raw::Cu(r)) => c.clear(r, b.dtype.words(b.len)),
            #[cfg(feature = "cuda")]
            _ => panic!("a buffer of another device"),
        }
    }

    /// Submits everything recorded and waits for it.
    pub fn sync(&self) {
        let submitted = match &self.backend {
            Backend::Vk(v) => v.sync(),
            #[cfg(feature = "cuda")]
            Backend::Cu(c) => {
                c.sync();
                true
            }
        };
        if submitted {
            self.submissions.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Host↔device bytes so far.
    pub fn traffic(&self) -> Traffic {
        Traffic { to_device: self.to_device.load(Ordering::Relaxed), to_host: self.to_host.load(Ordering::Relaxed) }
    }

    /// Bytes of every buffer allocated so far (freed ones included).
    pub fn allocated_bytes(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }

    /// (dispatches recorded, command buffers submitted) so far.
    pub fn counts(&self) -> (u64, u64) {
        (self.dispatches.load(Ordering::Relaxed), self.submissions.load(Ordering::Relaxed))
    }

    /// Records kernel `k` over `groups` workgroups with its arguments and buffers in the order
    /// of `k.bindings` (`None` binds a placeholder the kernel does not read).
    fn launch(&self, k: &shader::Kernel, groups: [u32; 3], args: &[u32], bufs: &[Option<&Buf>]) {
        assert_eq!(bufs.len(), k.bindings.len(), "kernel {} binds {} buffers", k.name, k.bindings.len());
        assert!(args.len() <= shader::MAX_ARGS, "a kernel takes at most {} arguments", shader::MAX_ARGS);
        if groups.contains(&0) {
            return;
        }
        let bufs: Vec<&Buf> = bufs.iter().map(|b| b.unwrap_or(&self.dummy)).collect();
        for (b, name) in bufs.iter().zip(k.bindings) {
            assert!(!k.writes.contains(name) || b.dtype == DType::F32 || b.dtype == DType::U32, "kernel {} writes {name} in fp32 or u32 only", k.name);
        }
        let new = match &self.backend {
            Backend::Vk(v) => {
                let raws: Vec<(&wgpu::Buffer, DType)> = bufs.iter().map(|b| match &b.raw {
                    Raw::Vk(r) => (r, b.dtype),
                    #[cfg(feature = "cuda")]
                    Raw::Cu(_) => panic!("a buffer of another device"),
                }).collect();
                v.launch(k, groups, args, &raws)
            }
            #[cfg(feature = "cuda")]
            Backend::Cu(c) => {
                let raws: Vec<(&cuda::Mem, DType)> = bufs.iter().map(|b| match &b.raw {
                    Raw::Cu(r) => (r, b.dtype),
                    Raw::Vk(_) => panic!("a buffer of another device"),
                }).collect();
                c.launch(k, groups, args, &raws)
            }
        };
        if new {
            self.to_device.fetch_add((shader::MAX_ARGS * 4) as u64, Ordering::Relaxed);
        }
        self.dispatches.fetch_add(1, Ordering::Relaxed);
    }

    /// Workgroups covering `n` items at `per` items each, spread over x and y (x ≤ 65535); a
    /// kernel recovers its item index with [`shader`]'s `flat_id`.
    fn grid(n: usize, per: usize) -> [u32; 3] {
        let g = kernels::u(n.div_ceil(per));
        if g <= 65535 {
            [g, 1, 1]
        } else {
            [65535, g.div_ceil(65535), 1]
        }
    }
}

/// `data` rounded to `fmt` and packed two to a word, element `2j` in the low half.
fn pack(data: &[f32], fmt: Format) -> Vec<u32> {
    let h = |x: f32| to_bits16(round(x, fmt), fmt) as u32;
    data.chunks(2).map(|p| h(p[0]) | p.get(1).map_or(0, |&x| h(x) << 16)).collect()
}

/// The inverse of [`pack`]: `len` values.
fn unpack(words: &[u32], len: usize, fmt: Format) -> Vec<f32> {
    (0..len).map(|i| from_bits16((words[i / 2] >> (16 * (i % 2))) as u16, fmt)).collect()
}

pub(crate) fn bytes(x: &[u32]) -> &[u8] {
    // SAFETY: u32 has no padding and u8 has alignment 1; the slice covers the same memory.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
}
