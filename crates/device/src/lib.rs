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
mod head;
mod kernels;
mod moe;
mod ops;
mod quant;
mod shader;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tensor::precision::{from_bits16, round, to_bits16, Format};

pub use attention::MAX_HEAD_SIZE;
pub use head::slot;
pub use kernels::{Gemm, MatSpec, Ragged};
pub use moe::Routing;
pub use ops::RopePos;
pub use quant::QBuf;

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
    fn format(self) -> Option<Format> {
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

/// What the Vulkan loader reports about one adapter (`kiln doctor`).
#[derive(Debug, Clone)]
pub struct AdapterInfo {
    /// Its index in [`adapters`]' order: what `--device vulkan:N` names.
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
            "vulkan:{}  {} ({}), shader f16 {}, max buffer {:.2} GiB, max binding {:.2} GiB, driver {}",
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

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::VULKAN;
    wgpu::Instance::new(desc)
}

fn info(index: usize, a: &wgpu::Adapter) -> AdapterInfo {
    let i = a.get_info();
    let kind = match i.device_type {
        wgpu::DeviceType::DiscreteGpu => "discrete GPU",
        wgpu::DeviceType::IntegratedGpu => "integrated GPU",
        wgpu::DeviceType::VirtualGpu => "virtual GPU",
        wgpu::DeviceType::Cpu => "CPU",
        wgpu::DeviceType::Other => "other",
    };
    AdapterInfo {
        index,
        name: i.name,
        kind: kind.into(),
        driver: format!("{} {}", i.driver, i.driver_info).trim().to_string(),
        max_buffer: a.limits().max_buffer_size,
        max_binding: a.limits().max_storage_buffer_binding_size,
        shader_f16: a.features().contains(wgpu::Features::SHADER_F16),
    }
}

/// Every Vulkan adapter the loader finds, discrete GPUs first (the order `--device vulkan:N`
/// indexes). Empty when there is no loader or no driver.
pub fn adapters() -> Vec<AdapterInfo> {
    sorted_adapters().iter().enumerate().map(|(i, a)| info(i, a)).collect()
}

fn sorted_adapters() -> Vec<wgpu::Adapter> {
    let mut all = pollster::block_on(instance().enumerate_adapters(wgpu::Backends::VULKAN));
    let rank = |a: &wgpu::Adapter| match a.get_info().device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    };
    all.sort_by_key(rank);
    all
}

/// What to install when no adapter is found: the loader and a driver.
pub const INSTALL_HINT: &str = "install a Vulkan loader and driver (Debian/Ubuntu: `apt-get install libvulkan1 mesa-vulkan-drivers` for Mesa's drivers, lavapipe among them, which runs on the CPU; on NVIDIA or AMD the vendor's driver), or pass --device cpu";

/// A device buffer of `len` elements of `dtype`.
pub struct Buf {
    raw: wgpu::Buffer,
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

/// An open device: adapter, queue, compiled kernels, and the command stream being recorded.
pub struct Gpu {
    pub info: AdapterInfo,
    device: wgpu::Device,
    queue: wgpu::Queue,
    pipelines: Mutex<HashMap<String, (wgpu::ComputePipeline, wgpu::BindGroupLayout)>>,
    /// Shape arguments, one small uniform buffer per distinct argument list: uploaded once.
    args: Mutex<HashMap<Vec<u32>, Arc<wgpu::Buffer>>>,
    encoder: Mutex<Option<wgpu::CommandEncoder>>,
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
    /// Opens adapter `index` of [`adapters`]' order.
    pub fn open(index: usize) -> Result<Gpu, DeviceError> {
        let all = sorted_adapters();
        let Some(adapter) = all.get(index) else {
            let found: Vec<AdapterInfo> = all.iter().enumerate().map(|(i, a)| info(i, a)).collect();
            return Err(missing(index, &found));
        };
        let info = info(index, adapter);
        let limits = adapter.limits();
        let desc = wgpu::DeviceDescriptor {
            label: Some("kiln"),
            required_features: wgpu::Features::empty(),
            required_limits: wgpu::Limits {
                max_buffer_size: limits.max_buffer_size,
                max_storage_buffer_binding_size: limits.max_storage_buffer_binding_size,
                max_storage_buffers_per_shader_stage: limits.max_storage_buffers_per_shader_stage.min(12),
                max_compute_workgroup_storage_size: limits.max_compute_workgroup_storage_size,
                ..wgpu::Limits::default()
            },
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&desc))
            .map_err(|e| DeviceError(format!("Vulkan adapter vulkan:{index} ({}) refused to open: {e}", info.name)))?;
        let dummy = Buf { raw: storage(&device, 4), len: 1, dtype: DType::F32 };
        let seeds = Buf { raw: storage(&device, 8), len: 2, dtype: DType::U32 };
        Ok(Gpu {
            info,
            device,
            queue,
            pipelines: Mutex::default(),
            args: Mutex::default(),
            encoder: Mutex::new(None),
            dispatches: AtomicU64::new(0),
            submissions: AtomicU64::new(0),
            to_device: AtomicU64::new(0),
            to_host: AtomicU64::new(0),
            allocated: AtomicU64::new(0),
            dummy,
            seeds,
        })
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
        self.allocated.fetch_add(bytes, Ordering::Relaxed);
        Ok(Buf { raw: storage(&self.device, bytes), len, dtype })
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
        // Staged and copied in the command stream, so the write stays in order with the kernels
        // recorded around it and the batch stays one submission.
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: (data.len() * 4) as u64,
            usage: wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: true,
        });
        staging.slice(..).get_mapped_range_mut().expect("staging buffer map failed").copy_from_slice(bytes(data));
        staging.unmap();
        self.with_encoder(|e| e.copy_buffer_to_buffer(&staging, 0, &dst.raw, (at * 4) as u64, (data.len() * 4) as u64));
        self.to_device.fetch_add(data.len() as u64 * 4, Ordering::Relaxed);
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
        let size = (len * 4) as u64;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.with_encoder(|e| e.copy_buffer_to_buffer(&src.raw, (start * 4) as u64, &staging, 0, size));
        self.flush();
        let slice = staging.slice(..);
        slice.map_async(wgpu::MapMode::Read, |r| r.expect("device buffer map failed"));
        self.device.poll(wgpu::PollType::wait_indefinitely()).expect("device lost");
        let out: Vec<u32> = {
            let view = slice.get_mapped_range().expect("device buffer map failed");
            view.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        };
        staging.unmap();
        self.to_host.fetch_add(size, Ordering::Relaxed);
        out
    }

    /// `dst` words `dst_at..dst_at + len` = `src` words `src_at..`, on the device, in order with
    /// the kernels around it.
    pub fn copy_words(&self, dst: &Buf, dst_at: usize, src: &Buf, src_at: usize, len: usize) {
        assert!(dst_at + len <= dst.dtype.words(dst.len) && src_at + len <= src.dtype.words(src.len), "copy past a buffer");
        if len > 0 {
            self.with_encoder(|e| e.copy_buffer_to_buffer(&src.raw, (src_at * 4) as u64, &dst.raw, (dst_at * 4) as u64, (len * 4) as u64));
        }
    }

    /// `seed` written to the device's own seed slot, in stream order: for the kernels called
    /// with a seed value (each such call uploads its 8 bytes).
    fn direct_seed(&self, seed: u64) -> Seed<'_> {
        self.write_words(&self.seeds, 0, &[seed as u32, (seed >> 32) as u32]);
        Seed { buf: &self.seeds, at: 0, site: None }
    }

    /// Distinct kernel argument lists uploaded so far (each one a small uniform buffer): a
    /// training step that adds none after its first records the same launches every time.
    pub fn arg_lists(&self) -> usize {
        self.args.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Sets every element to zero, on the device.
    pub fn clear(&self, b: &Buf) {
        self.with_encoder(|e| e.clear_buffer(&b.raw, 0, None));
    }

    /// Submits everything recorded and waits for it.
    pub fn sync(&self) {
        self.flush();
        self.device.poll(wgpu::PollType::wait_indefinitely()).expect("device lost");
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

    fn flush(&self) {
        if let Some(e) = self.encoder.lock().unwrap_or_else(|e| e.into_inner()).take() {
            self.queue.submit(Some(e.finish()));
            self.submissions.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn with_encoder<R>(&self, f: impl FnOnce(&mut wgpu::CommandEncoder) -> R) -> R {
        let mut g = self.encoder.lock().unwrap_or_else(|e| e.into_inner());
        let e = g.get_or_insert_with(|| self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }));
        f(e)
    }

    /// The uniform argument buffer for `args` (uploaded the first time this list is seen).
    fn args(&self, args: &[u32]) -> Arc<wgpu::Buffer> {
        assert!(args.len() <= shader::MAX_ARGS, "a kernel takes at most {} arguments", shader::MAX_ARGS);
        let mut cache = self.args.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = cache.get(args) {
            return b.clone();
        }
        let b = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: (shader::MAX_ARGS * 4) as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut padded = args.to_vec();
        padded.resize(shader::MAX_ARGS, 0);
        // A new buffer that nothing recorded reads: written ahead of the stream, no flush.
        self.queue.write_buffer(&b, 0, bytes(&padded));
        self.to_device.fetch_add((shader::MAX_ARGS * 4) as u64, Ordering::Relaxed);
        let b = Arc::new(b);
        cache.insert(args.to_vec(), b.clone());
        b
    }

    /// Records kernel `k` over `groups` workgroups with its arguments and buffers in the order
    /// of `k.bindings` (`None` binds a placeholder the kernel does not read).
    fn launch(&self, k: &shader::Kernel, groups: [u32; 3], args: &[u32], bufs: &[Option<&Buf>]) {
        assert_eq!(bufs.len(), k.bindings.len(), "kernel {} binds {} buffers", k.name, k.bindings.len());
        if groups.contains(&0) {
            return;
        }
        let bufs: Vec<&Buf> = bufs.iter().map(|b| b.unwrap_or(&self.dummy)).collect();
        let dtypes: Vec<DType> = bufs.iter().map(|b| b.dtype).collect();
        for (b, name) in bufs.iter().zip(k.bindings) {
            assert!(!k.writes.contains(name) || b.dtype == DType::F32 || b.dtype == DType::U32, "kernel {} writes {name} in fp32 or u32 only", k.name);
        }
        let (pipeline, layout) = self.pipeline(k, &dtypes);
        let argbuf = self.args(args);
        let mut entries = vec![wgpu::BindGroupEntry { binding: 0, resource: argbuf.as_entire_binding() }];
        for (i, b) in bufs.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry { binding: i as u32 + 1, resource: b.raw.as_entire_binding() });
        }
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout: &layout, entries: &entries });
        self.with_encoder(|e| {
            let mut pass = e.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(k.name), timestamp_writes: None });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        });
        self.dispatches.fetch_add(1, Ordering::Relaxed);
    }

    /// Kernel `k` compiled for its buffers' types (once per combination).
    fn pipeline(&self, k: &shader::Kernel, dtypes: &[DType]) -> (wgpu::ComputePipeline, wgpu::BindGroupLayout) {
        let key = format!("{}:{dtypes:?}", k.name);
        let mut cache = self.pipelines.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = cache.get(&key) {
            return p.clone();
        }
        let src = shader::source(k, dtypes);
        let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor { label: Some(k.name), source: wgpu::ShaderSource::Wgsl(src.into()) });
        let buffer = |binding: u32, ty: wgpu::BufferBindingType| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer { ty, has_dynamic_offset: false, min_binding_size: None },
            count: None,
        };
        let mut entries = vec![buffer(0, wgpu::BufferBindingType::Uniform)];
        entries.extend((0..dtypes.len()).map(|i| buffer(i as u32 + 1, wgpu::BufferBindingType::Storage { read_only: false })));
        let layout = self.device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(k.name), entries: &entries });
        let pl = self.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor { label: Some(k.name), bind_group_layouts: &[Some(&layout)], immediate_size: 0 });
        let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(k.name),
            layout: Some(&pl),
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        cache.insert(key, (pipeline.clone(), layout.clone()));
        (pipeline, layout)
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

fn storage(device: &wgpu::Device, bytes: u64) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: bytes.next_multiple_of(4),
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
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

fn bytes(x: &[u32]) -> &[u8] {
    // SAFETY: u32 has no padding and u8 has alignment 1; the slice covers the same memory.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), std::mem::size_of_val(x)) }
}
