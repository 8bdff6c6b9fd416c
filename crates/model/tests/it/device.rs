//! `DeviceGpt` against `Gpt`: the same forward losses and backward gradients on the first
//! Vulkan adapter (lavapipe in CI), with dropout on, for GPT-2 (biases, tied and untied heads)
//! and LLaMA (GQA, RoPE, SwiGLU, a sliding window), at shapes that are multiples of no tile.
use model::config::Arch;
use model::device::DeviceGpt;
use model::gpt::IGNORE_INDEX;
use model::{Gpt, GptConfig, Pass};
use std::sync::Arc;
use tensor::Rng;

fn gpu() -> Arc<device::Gpu> {
    Arc::new(device::Gpu::open(0).unwrap_or_else(|e| panic!("the device tests need a Vulkan adapter: {e}")))
}

/// max |a − b| over max |b|.
fn rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn check(cfg: GptConfig, name: &str) {
    check_in(cfg, name, false, (model::Recompute::None, 1));
}

/// Each row of `b × t` tokens as packed documents of lengths 5, 7, 4, … (positions restarting).
fn documents(b: usize, t: usize) -> (Vec<u32>, Vec<u32>) {
    let (mut start, mut pos) = (Vec::new(), Vec::new());
    for _ in 0..b {
        let (mut s, mut len) = (0, 5);
        for i in 0..t {
            if i - s == len {
                (s, len) = (i, 4 + (len + 3) % 5);
            }
            start.push(s as u32);
            pos.push((i - s) as u32);
        }
    }
    (start, pos)
}

/// `recompute`: the policy and `recompute_every`.
fn check_in(cfg: GptConfig, name: &str, packed: bool, recompute: (model::Recompute, usize)) {
    let g = gpu();
    let (b, t, vocab) = (3, cfg.block_size - 1, cfg.vocab_size);
    let mut cpu = Gpt::new(cfg, vocab - 1, 5);
    (cpu.recompute, cpu.recompute_every) = recompute;
    let mut dev = DeviceGpt::new(g.clone(), &cpu).unwrap();
    let mut rng = Rng::new(9);
    let tokens: Vec<u32> = (0..b * t).map(|_| rng.below(vocab as u64 - 1) as u32).collect();
    let mut targets: Vec<i32> = (0..b * t).map(|_| rng.below(vocab as u64 - 1) as i32).collect();
    targets[4] = IGNORE_INDEX;
    let (start, pos) = documents(b, t);
    let docs = packed.then_some(model::Docs { start: &start, pos: &pos });
    // Two passes accumulate into the gradients, with different masks.
    cpu.zero_grad();
    dev.zero_grad();
    let mut lists = None;
    for seed in [11, 12] {
        let pass = Pass::Train { dropout_seed: seed, loss_scale: 0.5 };
        match docs {
            Some(d) => cpu.forward_docs(&tokens, &targets, d, b, t, pass),
            None => cpu.forward(&tokens, &targets, b, t, pass),
        };
        cpu.backward();
        let count = dev.forward_docs(&tokens, &targets, docs, b, t, pass);
        dev.backward();
        assert_eq!(count, b * t - 1);
        let e = rel(&dev.losses(), cpu.losses());
        assert!(e < 1e-5, "{name}: losses differ by {e:e}");
        // A pass with another seed records the same launches: no new argument lists.
        let now = g.arg_lists();
        assert!(lists.is_none_or(|n| n == now), "{name}: the second pass added {} kernel argument lists", now - lists.unwrap());
        lists = Some(now);
    }
    let e = rel(&g.download(&dev.grads), &cpu.grads);
    assert!(e < 1e-5, "{name}: gradients differ by {e:e}");
    for (d, c) in dev.moe_stats().iter().zip(cpu.moe_stats()) {
        assert_eq!(d.counts, c.counts, "{name}: expert loads");
        assert!((d.aux_loss - c.aux_loss).abs() <= 1e-5 * c.aux_loss && (d.z_loss - c.z_loss).abs() <= 1e-5 * c.z_loss, "{name}: {d:?} against {c:?}");
        assert_eq!(d.dropped_fraction, c.dropped_fraction, "{name}: dropped");
        assert!(!name.contains("capacity") || c.dropped_fraction > 0.0, "{name}: the case drops nothing");
    }
    assert_eq!(dev.moe_stats().len(), cpu.moe_stats().len());
    // Evaluation: no dropout, no gradients.
    cpu.forward(&tokens, &targets, b, t, Pass::Eval);
    dev.forward(&tokens, &targets, b, t, Pass::Eval);
    let e = rel(&dev.losses(), cpu.losses());
    assert!(e < 1e-5, "{name}: eval losses differ by {e:e}");
}

#[test]
fn device_gpt2_matches_the_cpu_model() {
    check(GptConfig::gpt2((2, 3, 24), 19, 37, true, 0.1, true), "gpt2 tied, biases");
    check(GptConfig::gpt2((2, 2, 16), 14, 29, false, 0.2, false), "gpt2 untied, no biases");
}

#[test]
fn device_llama_matches_the_cpu_model() {
    let llama = GptConfig { arch: Arch::Llama, n_head: 4, n_kv_head: 2, ffn_hidden: 20, tied_embeddings: false, bias: false, ..GptConfig::gpt2((2, 4, 32), 19, 37, false, 0.1, false) };
    check(llama.clone(), "llama gqa");
    check(GptConfig { sliding_window: 5, ..llama }, "llama sliding window");
}

/// The plan a device run is checked against before it allocates is what the model allocates.
#[test]
fn the_device_plan_is_what_the_model_allocates() {
    let g = gpu();
    let cfg = GptConfig { arch: Arch::Llama, n_head: 4, n_kv_head: 2, ffn_hidden: 20, tied_embeddings: false, bias: false, ..GptConfig::gpt2((2, 4, 32), 19, 37, false, 0.1, false) };
    let cpu = Gpt::new(cfg.clone(), 36, 5);
    let before = g.allocated_bytes();
    let mut dev = DeviceGpt::new(g.clone(), &cpu).unwrap();
    let (b, t) = (3, 18);
    dev.forward(&vec![1; b * t], &vec![2; b * t], b, t, Pass::Eval);
    let used = g.allocated_bytes() - before;
    let plan = model::device::plan(&g, &cfg, model::device::Weights::Full { params: cpu.params.len() }, (b, t), 0, (model::Precision::Fp32, model::Recompute::None, 1));
    // The plan leaves out only the rotary tables.
    let small = 2 * 4 * (cfg.block_size * cfg.head_size() / 2) as u64;
    assert!(plan.total_bytes <= used && used <= plan.total_bytes + small, "plan {plan:?} against {used} bytes allocated");
    // Full recomputation keeps one block's activations: the plan says so, and so does the
    // allocation.
    let mut full = Gpt::new(cfg.clone(), 36, 5);
    full.recompute = model::Recompute::Full;
    let before = g.allocated_bytes();
    let mut dev = DeviceGpt::new(g.clone(), &full).unwrap();
    dev.forward(&vec![1; b * t], &vec![2; b * t], b, t, Pass::Eval);
    let used_full = g.allocated_bytes() - before;
    let plan_full = model::device::plan(&g, &cfg, model::device::Weights::Full { params: full.params.len() }, (b, t), 0, (model::Precision::Fp32, model::Recompute::Full, 1));
    assert!(plan_full.total_bytes < plan.total_bytes && plan_full.total_bytes <= used_full && used_full <= plan_full.total_bytes + small, "full recomputation: plan {plan_full:?} against {used_full} bytes");
    // Selective recomputation shares one attention core; every other block re-run keeps the
    // others' sets: each between full recomputation and none, and allocated as planned.
    for (policy, every) in [(model::Recompute::Selective, 1), (model::Recompute::Full, 2)] {
        let mut m = Gpt::new(cfg.clone(), 36, 5);
        (m.recompute, m.recompute_every) = (policy, every);
        let before = g.allocated_bytes();
        let mut dev = DeviceGpt::new(g.clone(), &m).unwrap();
        dev.forward(&vec![1; b * t], &vec![2; b * t], b, t, Pass::Eval);
        let used = g.allocated_bytes() - before;
        let p = model::device::plan(&g, &cfg, model::device::Weights::Full { params: m.params.len() }, (b, t), 0, (model::Precision::Fp32, policy, every));
        // (Two blocks, every other re-run: one shared set and one own, as many as none keeps.)
        let fewer = if policy == model::Recompute::Selective { p.total_bytes < plan.total_bytes } else { p.total_bytes == plan.total_bytes };
        assert!(plan_full.total_bytes < p.total_bytes && fewer, "{policy:?} every {every}: {p:?}");
        assert!(p.total_bytes <= used && used <= p.total_bytes + small, "{policy:?} every {every}: plan {p:?} against {used} bytes");
    }
    // LoRA: the frozen base and the adapters' state; QLoRA: the base's codes, its fp32
    // tensors, and the dequantization scratch (within the words its codes are padded to).
    for quant in [model::BaseQuant::None, model::BaseQuant::Nf4] {
        let mut lo = Gpt::new(cfg.clone(), 36, 5);
        let targets: Vec<String> = ["q", "v", "down"].map(String::from).to_vec();
        lo.lora = Some(model::lora::Lora::new(&cfg, 2, 4.0, &targets, 1).unwrap());
        if quant != model::BaseQuant::None {
            let params = lo.params.clone();
            let base = model::qbase::QuantBase::build(&lo.layout, &lo.views, &lo.units, quant, |p, dst| dst.copy_from_slice(&params[p.range()]));
            lo.set_quantized_base(std::sync::Arc::new(base));
        }
        let before = g.allocated_bytes();
        let mut dev = DeviceGpt::new(g.clone(), &lo).unwrap();
        dev.forward(&vec![1; b * t], &vec![2; b * t], b, t, Pass::Eval);
        let used = g.allocated_bytes() - before;
        let w = model::device::Weights::lora(&lo.layout, lo.lora.as_ref().unwrap(), model::Precision::Fp32, quant);
        let p = model::device::plan(&g, &cfg, w, (b, t), 0, (model::Precision::Fp32, model::Recompute::None, 1));
        assert!(p.trainable < p.params && p.total_bytes < plan.total_bytes, "{quant:?}: {p:?}");
        let slack = small + 8 + if quant == model::BaseQuant::None { 0 } else { p.total_bytes / 50 };
        assert!(p.total_bytes.abs_diff(used) <= slack, "{quant:?}: plan {p:?} against {used} bytes allocated");
    }
    // A tensor-parallel part with sequence parallelism: its residual stream holds half of
    // each sequence's positions; planned as allocated, and smaller than without the split.
    let heads = Some(model::config::Part { first: 0, total: 8 });
    let vocab = Some(model::config::Part { first: 0, total: 38 });
    let mut sizes = Vec::new();
    for seq in [None, Some(model::config::SeqSlice { index: 0, count: 2 })] {
        let place = model::Placement { heads, vocab, seq, ..Default::default() };
        let part = GptConfig { vocab_size: 19, place, ..cfg.clone() };
        let m = Gpt::new(part.clone(), 36, 5);
        let before = g.allocated_bytes();
        let mut dev = DeviceGpt::new(g.clone(), &m).unwrap();
        dev.swap_tensor_hooks(&mut Some(Box::new(Mirror)));
        dev.forward(&vec![1; b * t], &vec![2; b * t], b, t, Pass::Eval);
        let used = g.allocated_bytes() - before;
        let p = model::device::plan(&g, &part, model::device::Weights::Full { params: m.params.len() }, (b, t), 0, (model::Precision::Fp32, model::Recompute::None, 1));
        assert!(p.total_bytes <= used && used <= p.total_bytes + small, "{seq:?}: plan {p:?} against {used} bytes allocated");
        sizes.push(p.total_bytes);
    }
    assert!(sizes[1] < sizes[0], "sequence parallelism plans fewer bytes: {sizes:?}");
    // An expert-parallel part (two of four experts): the rows its experts may receive from
    // both parts, planned as allocated.
    let moe = GptConfig { n_expert: 4, top_k: 2, ..cfg.clone() };
    let part = GptConfig { place: model::Placement { experts: Some(0..2), ..Default::default() }, ..moe.clone() };
    let m = Gpt::new(part.clone(), 36, 5);
    let before = g.allocated_bytes();
    let mut dev = DeviceGpt::new(g.clone(), &m).unwrap();
    dev.swap_expert_hooks(&mut Some(Box::new(Twin)));
    dev.forward(&vec![1; b * t], &vec![2; b * t], b, t, Pass::Eval);
    let used = g.allocated_bytes() - before;
    let p = model::device::plan(&g, &part, model::device::Weights::Full { params: m.params.len() }, (b, t), 0, (model::Precision::Fp32, model::Recompute::None, 1));
    assert!(p.total_bytes <= used && used <= p.total_bytes + small, "expert parallel: plan {p:?} against {used} bytes allocated");
    // A context-parallel part (two zig-zag chunks of each sequence): its rows, and the ring's
    // block of keys and values with their gradients' accumulator, planned as allocated.
    let context = Some(model::config::ContextSlice { index: 1, count: 2, zigzag: true });
    let part = GptConfig { place: model::Placement { context, ..Default::default() }, ..cfg.clone() };
    let m = Gpt::new(part.clone(), 36, 5);
    let before = g.allocated_bytes();
    let mut dev = DeviceGpt::new(g.clone(), &m).unwrap();
    dev.swap_context_hooks(&mut Some(Box::new(Echo(Vec::new()))));
    let tw = 28;
    dev.forward(&vec![1; b * tw], &vec![2; b * tw], b, tw, Pass::Eval);
    let used = g.allocated_bytes() - before;
    let p = model::device::plan(&g, &part, model::device::Weights::Full { params: m.params.len() }, (b, tw / 2), 0, (model::Precision::Fp32, model::Recompute::None, 1));
    assert!(p.total_bytes <= used && used <= p.total_bytes + small, "context parallel: plan {p:?} against {used} bytes allocated");
}

/// A context-parallel ring whose other part holds what this one holds: enough to run a part's
/// passes, and allocate its buffers, on one device.
struct Echo(Vec<f32>);

impl model::CpHooks for Echo {
    fn attention_forward(&mut self, _: &mut [f32], _: &mut [f32], _: &[f32], _: &tensor::llama::GqaDims, _: &[u32], _: tensor::attention::AttnDropout) {
        unreachable!("a device part runs the ring's blocks itself")
    }

    fn attention_backward(&mut self, _: &mut [f32], _: &[f32], _: (&[f32], &[f32], &[f32]), _: &tensor::llama::GqaDims, _: &[u32], _: tensor::attention::AttnDropout) {
        unreachable!("a device part runs the ring's blocks itself")
    }

    fn is_ring(&self) -> bool {
        true
    }

    fn sum_over_parts(&mut self, _: &mut [f64]) {
        unreachable!("a device part measures no sequence objective")
    }

    fn send_next(&mut self, x: &[f32], _: bool) {
        self.0 = x.to_vec();
    }

    fn recv_prev(&mut self, x: &mut [f32], _: bool) {
        x.copy_from_slice(&self.0);
    }

    fn heads_forward(&mut self, _: &mut [f32], _: &mut [f32], _: &[f32], _: &tensor::llama::GqaDims, _: &[u32], _: &mut dyn FnMut(model::HeadsForward)) {
        unreachable!("a ring")
    }

    fn heads_backward(&mut self, _: &mut [f32], _: &[f32], _: (&[f32], &[f32], &[f32]), _: &tensor::llama::GqaDims, _: &[u32], _: &mut dyn FnMut(model::HeadsBackward)) {
        unreachable!("a ring")
    }
}

/// The first of two expert-parallel parts whose twin routes as it does (its rows' values
/// zero): enough to run a part's passes, and allocate its buffers, on one device.
struct Twin;

impl tensor::moe::MoeExchange for Twin {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        2
    }

    fn exchange_counts(&mut self, send: &[usize], recv: &mut [usize]) {
        let k = send.len() / 2;
        for r in 0..2 {
            recv[r * k..(r + 1) * k].copy_from_slice(&send[..k]);
        }
    }

    fn sum_routing(&mut self, _: &mut [f64]) {}

    fn exchange_rows(&mut self, _: &[f32], _: &[usize], recv: &mut [f32], _: &[usize], _: usize) {
        recv.fill(0.0);
    }
}

/// Tensor-parallel hooks of a group whose other part holds what this one holds: enough to run
/// a part's passes (and allocate its buffers) on one device.
struct Mirror;

impl model::TpHooks for Mirror {
    fn reduce_output(&mut self, _: &mut [f32], _: Option<&[f32]>) {}

    fn reduce_input_grad(&mut self, _: &mut [f32]) {}

    fn gather_seq(&mut self, local: &[f32], full: &mut [f32], _: usize, _: usize) {
        for (i, x) in full.iter_mut().enumerate() {
            *x = local[i % local.len()];
        }
    }

    fn scatter_seq(&mut self, full: &mut [f32], local: &mut [f32], _: Option<&[f32]>, _: usize, _: usize) {
        local.copy_from_slice(&full[..local.len()]);
    }

    fn all_gather(&mut self, x: &[f32]) -> Vec<f32> {
        [x, x].concat()
    }
}

/// Rows of packed documents: attention within each, positions restarting (RoPE, GPT-2's
/// position table and its gradient).
#[test]
fn device_packed_documents_match_the_cpu_model() {
    check_in(GptConfig::gpt2((2, 3, 24), 19, 37, true, 0.1, true), "gpt2 documents", true, (model::Recompute::None, 1));
    let llama = GptConfig { arch: Arch::Llama, n_head: 4, n_kv_head: 2, ffn_hidden: 20, tied_embeddings: false, bias: false, ..GptConfig::gpt2((2, 4, 32), 19, 37, false, 0.1, false) };
    check_in(llama.clone(), "llama documents", true, (model::Recompute::None, 1));
    // Full recomputation: one set of block activations, each block re-run in backward.
    check_in(llama.clone(), "llama documents, full recomputation", true, (model::Recompute::Full, 1));
    check_in(GptConfig::gpt2((3, 3, 24), 19, 37, true, 0.1, true), "gpt2 full recomputation", false, (model::Recompute::Full, 1));
    // Every other block re-run (the others keep theirs); selective: the attention core re-run.
    check_in(GptConfig::gpt2((3, 3, 24), 19, 37, true, 0.1, true), "gpt2 full recomputation of every other block", false, (model::Recompute::Full, 2));
    check_in(llama, "llama documents, selective recomputation", true, (model::Recompute::Selective, 1));
}

#[test]
fn device_moe_matches_the_cpu_model() {
    let llama = GptConfig { arch: Arch::Llama, n_head: 4, n_kv_head: 2, ffn_hidden: 20, tied_embeddings: false, bias: false, ..GptConfig::gpt2((2, 4, 32), 19, 37, false, 0.1, false) };
    let moe = GptConfig { n_expert: 5, top_k: 2, moe_aux_weight: 0.01, moe_z_weight: 0.001, ..llama };
    // Dropless, then with a capacity that drops assignments and a shared expert.
    check(moe.clone(), "moe dropless");
    check(GptConfig { capacity_factor: 1.0, n_shared_expert: 1, ..moe.clone() }, "moe capacity 1.0, one shared expert");
    // Recomputed: each layer's routing statistics stay its own.
    check_in(GptConfig { capacity_factor: 1.0, ..moe.clone() }, "moe capacity 1.0, full recomputation", false, (model::Recompute::Full, 1));
    check_in(moe.clone(), "moe selective recomputation", false, (model::Recompute::Selective, 1));
    // A data-parallel part: its rows start at sequence 3 of the global batch (dropout masks).
    check(GptConfig { place: model::Placement { batch_offset: 3, ..Default::default() }, ..moe }, "moe, a data-parallel part");
}

#[test]
fn unsupported_models_are_refused_by_name() {
    let g = gpu();
    let qwen3 = GptConfig { arch: Arch::Llama, qk_norm: true, n_head: 2, n_kv_head: 2, ffn_hidden: 12, ..GptConfig::gpt2((1, 2, 8), 6, 12, false, 0.0, false) };
    let e = DeviceGpt::new(g.clone(), &Gpt::new(qwen3.clone(), 12, 0)).err().expect("a q/k-norm model on the device");
    assert!(e.contains("q/k norms"), "{e}");
    let post = GptConfig { qk_norm: false, block_norms: model::config::BlockNorms::Post, ..qwen3 };
    let e = DeviceGpt::new(g.clone(), &Gpt::new(post.clone(), 12, 0)).err().expect("norms after the branches on the device");
    assert!(e.contains("model.block_norms"), "{e}");
    let pre = GptConfig { block_norms: model::config::BlockNorms::Pre, ..post };
    let e = DeviceGpt::new(g.clone(), &Gpt::new(GptConfig { gate_act: model::config::GateAct::GeluTanh, ..pre.clone() }, 12, 0)).err().expect("GeGLU on the device");
    assert!(e.contains("model.gate_act"), "{e}");
    let e = DeviceGpt::new(g.clone(), &Gpt::new(GptConfig { query_pre_attn_scalar: 3, ..pre.clone() }, 12, 0)).err().expect("an attention scale on the device");
    assert!(e.contains("model.query_pre_attn_scalar"), "{e}");
    let e = DeviceGpt::new(g.clone(), &Gpt::new(GptConfig { final_softcap: 3.0, ..pre.clone() }, 12, 0)).err().expect("soft-capping on the device");
    assert!(e.contains("model.final_softcap"), "{e}");
    let mla = GptConfig { head_dim: 6, rotary_dim: 2, v_head_dim: 4, kv_lora_rank: 3, ..pre.clone() };
    let e = DeviceGpt::new(g.clone(), &Gpt::new(mla, 12, 0)).err().expect("latent attention on the device");
    assert!(e.contains("model.kv_lora_rank"), "{e}");
    let sigmoid = GptConfig { n_expert: 4, top_k: 2, moe_router: model::config::MoeRouter::Sigmoid, moe_aux_weight: 0.0, moe_z_weight: 0.0, ..pre.clone() };
    let e = DeviceGpt::new(g.clone(), &Gpt::new(sigmoid, 12, 0)).err().expect("the sigmoid router on the device");
    assert!(e.contains("model.moe_router"), "{e}");
    let mixed = GptConfig { n_expert: 4, top_k: 2, moe_first_layer: 1, dense_ffn_hidden: 8, ..pre };
    let e = DeviceGpt::new(g, &Gpt::new(mixed, 12, 0)).err().expect("dense layers before routed ones on the device");
    assert!(e.contains("model.moe_first_layer"), "{e}");
}

/// Greedy generation with the KV cache on the device gives the CPU's tokens, through a cache
/// rebuild (more tokens than the context), for GPT-2, LLaMA with a sliding window, and MoE.
#[test]
fn device_generation_gives_the_cpu_tokens() {
    let g = gpu();
    let llama = GptConfig { arch: Arch::Llama, n_head: 4, n_kv_head: 2, ffn_hidden: 20, tied_embeddings: false, bias: false, ..GptConfig::gpt2((2, 4, 32), 13, 37, false, 0.0, false) };
    for (name, cfg) in [
        ("gpt2", GptConfig::gpt2((2, 3, 24), 13, 37, true, 0.0, true)),
        ("llama window", GptConfig { sliding_window: 5, ..llama.clone() }),
        ("moe", GptConfig { n_expert: 4, top_k: 2, n_shared_expert: 1, ..llama }),
    ] {
        let cpu = Gpt::new(cfg, 36, 3);
        let mut dev = DeviceGpt::new(g.clone(), &cpu).unwrap();
        let greedy = model::Sampler::new(0.0, 0, 1);
        let prompt = [3, 1, 4, 1, 5];
        let (want, got) = (cpu.generate(&prompt, 20, &greedy), dev.generate(&prompt, 20, &greedy));
        assert_eq!(got, want, "{name}: device tokens against the CPU's");
        // And the logits of one step.
        let (mut cc, mut dc) = (cpu.new_cache(), dev.new_cache());
        let (a, b) = (cpu.decode_step(&mut cc, 7), dev.decode_step(&mut dc, 7));
        let e = rel(&b, &a);
        assert!(e < 1e-5, "{name}: decode logits differ by {e:e}");
    }
}

/// A one-rank group: its gathers and reductions are the identity, kept until they are taken.
#[derive(Default)]
struct Alone {
    gathers: Vec<(usize, Vec<f32>)>,
    sums: Vec<(usize, Vec<f32>)>,
}

impl model::device::ZeroGroup for Alone {
    fn members(&self) -> usize {
        1
    }

    fn start_all_gather(&mut self, tag: usize, mine: Vec<f32>) {
        assert!(self.gathers.iter().all(|g| g.0 != tag), "unit {tag} gathered twice at once");
        self.gathers.push((tag, mine));
    }

    fn gathered(&mut self, tag: usize) -> Vec<f32> {
        let i = self.gathers.iter().position(|g| g.0 == tag).unwrap_or_else(|| panic!("unit {tag} taken before its gather started"));
        self.gathers.remove(i).1
    }

    fn start_reduce_scatter(&mut self, tag: usize, full: Vec<f32>) {
        self.sums.push((tag, full));
    }

    fn reduced(&mut self) -> Vec<(usize, Vec<f32>)> {
        std::mem::take(&mut self.sums)
    }
}

/// ZeRO-2 and 3 on the device: with each unit's gradients in a buffer of its own, reduced into
/// the shard as backward leaves it, and (stage 3) each unit gathered for its passes and freed
/// after, two accumulating training passes and an evaluation give the whole model's losses and
/// gradients — tied and untied heads, MoE, full recomputation (a one-rank group, whose shard is
/// the layout; two ranks on two devices are `kiln`'s `data_parallel_on_devices_…`).
#[test]
fn zero_sharded_device_models_match_the_whole_model() {
    let g = gpu();
    let llama = GptConfig { arch: Arch::Llama, n_head: 4, n_kv_head: 2, ffn_hidden: 20, tied_embeddings: false, bias: false, ..GptConfig::gpt2((3, 4, 32), 19, 37, false, 0.1, false) };
    let moe = GptConfig { n_expert: 5, top_k: 2, moe_aux_weight: 0.01, moe_z_weight: 0.001, ..llama.clone() };
    let cases = [("gpt2 tied", GptConfig::gpt2((3, 3, 24), 19, 37, true, 0.1, true), model::Recompute::None), ("llama untied", llama, model::Recompute::None), ("moe, full recomputation", moe, model::Recompute::Full)];
    for (name, cfg, recompute) in cases {
        let (b, t, vocab) = (3, cfg.block_size - 1, cfg.vocab_size);
        let mut cpu = Gpt::new(cfg, vocab - 1, 5);
        cpu.recompute = recompute;
        let mut rng = Rng::new(9);
        let tokens: Vec<u32> = (0..b * t).map(|_| rng.below(vocab as u64 - 1) as u32).collect();
        let targets: Vec<i32> = (0..b * t).map(|_| rng.below(vocab as u64 - 1) as i32).collect();
        let mut whole = DeviceGpt::new(g.clone(), &cpu).unwrap();
        let passes = |dev: &mut DeviceGpt| {
            dev.zero_grad();
            let mut losses = Vec::new();
            for seed in [11, 12] {
                dev.forward(&tokens, &targets, b, t, Pass::Train { dropout_seed: seed, loss_scale: 0.5 });
                dev.backward();
                losses.extend(dev.losses());
            }
            dev.forward(&tokens, &targets, b, t, Pass::Eval);
            losses.extend(dev.losses());
            (losses, g.download(dev.trainable().1))
        };
        let (want, want_grads) = passes(&mut whole);
        for stage in [2, 3] {
            let units = cpu.units.clone();
            let layout = model::device::ShardLayout { rank: 0, chunk: units.iter().map(|u| u.len()).collect(), offset: units.iter().map(|u| u.start).collect(), len: cpu.params.len(), units };
            let mut dev = DeviceGpt::with_zero(g.clone(), &cpu, stage, layout, Box::new(Alone::default())).unwrap();
            let (losses, grads) = passes(&mut dev);
            assert!(rel(&losses, &want) < 1e-6, "{name} ZeRO-{stage}: losses differ by {:e}", rel(&losses, &want));
            assert!(rel(&grads, &want_grads) < 1e-6, "{name} ZeRO-{stage}: gradients differ by {:e}", rel(&grads, &want_grads));
            assert!(dev.zero().unwrap().stage == stage && g.download(dev.trainable().0).len() == cpu.params.len());
        }
    }
}
