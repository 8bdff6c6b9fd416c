//! The Vulkan backend: wgpu's device and queue, each kernel's WGSL compiled into a pipeline per
//! combination of buffer types, uniform argument blocks cached per distinct list, and one
//! command encoder that records kernels, writes and copies until a download or a sync submits it.

use crate::shader::{self, Kernel};
use crate::{bytes, AdapterInfo, DType, DeviceError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub(crate) struct Vk {
    device: wgpu::Device,
    queue: wgpu::Queue,
    pipelines: Mutex<HashMap<String, (wgpu::ComputePipeline, wgpu::BindGroupLayout)>>,
    /// Shape arguments, one small uniform buffer per distinct argument list: uploaded once.
    args: Mutex<HashMap<Vec<u32>, Arc<wgpu::Buffer>>>,
    encoder: Mutex<Option<wgpu::CommandEncoder>>,
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
        backend: "vulkan",
        index,
        name: i.name,
        kind: kind.into(),
        driver: format!("{} {}", i.driver, i.driver_info).trim().to_string(),
        max_buffer: a.limits().max_buffer_size,
        max_binding: a.limits().max_storage_buffer_binding_size,
        shader_f16: a.features().contains(wgpu::Features::SHADER_F16),
    }
}

/// Every Vulkan adapter, discrete GPUs first.
pub(crate) fn sorted_adapters() -> Vec<(AdapterInfo, wgpu::Adapter)> {
    let mut all = pollster::block_on(instance().enumerate_adapters(wgpu::Backends::VULKAN));
    let rank = |a: &wgpu::Adapter| match a.get_info().device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    };
    all.sort_by_key(rank);
    all.into_iter().enumerate().map(|(i, a)| (info(i, &a), a)).collect()
}

impl Vk {
    pub fn open(index: usize, info: &AdapterInfo, adapter: &wgpu::Adapter) -> Result<Vk, DeviceError> {
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
        Ok(Vk { device, queue, pipelines: Mutex::default(), args: Mutex::default(), encoder: Mutex::new(None) })
    }

    pub fn storage(&self, bytes: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: bytes.next_multiple_of(4),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// Staged and copied in the command stream, so the write stays in order with the kernels
    /// recorded around it and the batch stays one submission.
    pub fn write_words(&self, dst: &wgpu::Buffer, at: usize, data: &[u32]) {
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: (data.len() * 4) as u64,
            usage: wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: true,
        });
        staging.slice(..).get_mapped_range_mut().expect("staging buffer map failed").copy_from_slice(bytes(data));
        staging.unmap();
        self.with_encoder(|e| e.copy_buffer_to_buffer(&staging, 0, dst, (at * 4) as u64, (data.len() * 4) as u64));
    }

    /// Words `start..start + len` of `src`, after everything recorded (`true` in the second
    /// place when that submitted a batch).
    pub fn download_words(&self, src: &wgpu::Buffer, start: usize, len: usize) -> (Vec<u32>, bool) {
        let size = (len * 4) as u64;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        self.with_encoder(|e| e.copy_buffer_to_buffer(src, (start * 4) as u64, &staging, 0, size));
        let submitted = self.flush();
        let slice = staging.slice(..);
        slice.map_async(wgpu::MapMode::Read, |r| r.expect("device buffer map failed"));
        self.device.poll(wgpu::PollType::wait_indefinitely()).expect("device lost");
        let out: Vec<u32> = {
            let view = slice.get_mapped_range().expect("device buffer map failed");
            view.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        };
        staging.unmap();
        (out, submitted)
    }

    pub fn copy_words(&self, dst: &wgpu::Buffer, dst_at: usize, src: &wgpu::Buffer, src_at: usize, len: usize) {
        self.with_encoder(|e| e.copy_buffer_to_buffer(src, (src_at * 4) as u64, dst, (dst_at * 4) as u64, (len * 4) as u64));
    }

    pub fn clear(&self, b: &wgpu::Buffer) {
        self.with_encoder(|e| e.clear_buffer(b, 0, None));
    }

    /// Submits everything recorded and waits for it (`true` when there was a batch).
    pub fn sync(&self) -> bool {
        let submitted = self.flush();
        self.device.poll(wgpu::PollType::wait_indefinitely()).expect("device lost");
        submitted
    }

    pub fn arg_lists(&self) -> usize {
        self.args.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn flush(&self) -> bool {
        match self.encoder.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(e) => {
                self.queue.submit(Some(e.finish()));
                true
            }
            None => false,
        }
    }

    fn with_encoder<R>(&self, f: impl FnOnce(&mut wgpu::CommandEncoder) -> R) -> R {
        let mut g = self.encoder.lock().unwrap_or_else(|e| e.into_inner());
        let e = g.get_or_insert_with(|| self.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }));
        f(e)
    }

    /// The uniform argument buffer for `args` (uploaded the first time this list is seen), and
    /// whether it was new (its bytes count as traffic).
    fn args(&self, args: &[u32]) -> (Arc<wgpu::Buffer>, bool) {
        let mut cache = self.args.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = cache.get(args) {
            return (b.clone(), false);
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
        let b = Arc::new(b);
        cache.insert(args.to_vec(), b.clone());
        (b, true)
    }

    /// Records kernel `k` over `groups` workgroups with `args` and `bufs` (binding order, each
    /// with its type). Returns whether a new argument list was uploaded.
    pub fn launch(&self, k: &Kernel, groups: [u32; 3], args: &[u32], bufs: &[(&wgpu::Buffer, DType)]) -> bool {
        let dtypes: Vec<DType> = bufs.iter().map(|b| b.1).collect();
        let (pipeline, layout) = self.pipeline(k, &dtypes);
        let (argbuf, new) = self.args(args);
        let mut entries = vec![wgpu::BindGroupEntry { binding: 0, resource: argbuf.as_entire_binding() }];
        for (i, b) in bufs.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry { binding: i as u32 + 1, resource: b.0.as_entire_binding() });
        }
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor { label: None, layout: &layout, entries: &entries });
        self.with_encoder(|e| {
            let mut pass = e.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some(k.name), timestamp_writes: None });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
        });
        new
    }

    /// Kernel `k` compiled for its buffers' types (once per combination).
    fn pipeline(&self, k: &Kernel, dtypes: &[DType]) -> (wgpu::ComputePipeline, wgpu::BindGroupLayout) {
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
}
