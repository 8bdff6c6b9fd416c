//! `kiln bench --kernels [--device vulkan[:N]]`: every device kernel timed beside its CPU twin
//! at GPT-2-small widths over 256 tokens, its rate (GFLOP/s for products, GB/s for the
//! bandwidth-bound kernels) on both, and the two results compared (max |device − CPU| over max
//! |CPU|, against the conformance suite's contract). Both sides run each kernel the same number
//! of times, so the accumulating backwards compare too. On lavapipe, a software Vulkan driver,
//! the rates say nothing about GPUs: there the bench is a correctness run.

use crate::device::DeviceArg;
use crate::error::{user, Result};
use device::{DType, Gpu, RopePos};
use serde_json::{json, Value};
use std::time::Instant;
use tensor::attention::AttnDropout;
use tensor::classifier::HeadDims;
use tensor::llama::GqaDims;
use tensor::matmul::Arith;
use tensor::Rng;

/// Tokens, channels, heads, head size, vocabulary: `B = 2`, `T = 128`.
const B: usize = 2;
const T: usize = 128;
const BT: usize = B * T;
const C: usize = 768;
const NH: usize = 12;
const HS: usize = 64;
const V: usize = 4096;

/// One run of a kernel; with `true` it returns the output to compare.
type Run<'a> = Box<dyn FnMut(bool) -> Vec<f32> + 'a>;

/// One kernel: its work per run (FLOPs or bytes moved), the two sides, the contract's tolerance.
struct Case<'a> {
    kernel: &'static str,
    dtype: &'static str,
    gflops: bool,
    work: f64,
    tol: f64,
    cpu: Run<'a>,
    dev: Option<Run<'a>>,
}

fn randn(rng: &mut Rng, n: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0.0; n];
    rng.fill_normal(&mut v, std);
    v
}

/// The host inputs every case reads.
struct Inputs {
    x: Vec<f32>,
    w: Vec<f32>,
    /// A norm's weight and bias `[2C]`.
    ln: Vec<f32>,
    dout: Vec<f32>,
    tokens: Vec<u32>,
    wte: Vec<f32>,
    qkv: Vec<f32>,
    head_w: Vec<f32>,
    targets: Vec<i32>,
}

fn inputs() -> Inputs {
    let mut rng = Rng::new(1);
    Inputs {
        x: randn(&mut rng, BT * 4 * C, 1.0),
        w: randn(&mut rng, C * C, 0.05),
        ln: randn(&mut rng, 2 * C, 1.0),
        dout: randn(&mut rng, BT * 4 * C, 1.0),
        tokens: (0..BT).map(|_| rng.below(V as u64) as u32).collect(),
        wte: randn(&mut rng, (V + T) * C, 0.1),
        qkv: randn(&mut rng, BT * 3 * C, 1.0),
        head_w: randn(&mut rng, V * C, 0.05),
        targets: (0..BT).map(|_| rng.below(V as u64) as i32).collect(),
    }
}

/// `f`'s output when asked for, nothing otherwise.
fn out(get: bool, f: impl FnOnce() -> Vec<f32>) -> Vec<f32> {
    if get {
        f()
    } else {
        Vec::new()
    }
}

/// A device side over buffers it owns: `f` records the kernel and returns the buffer to read.
fn on<'a, S: 'a, F>(g: &'a Gpu, state: S, mut f: F) -> Run<'a>
where
    F: for<'s> FnMut(&'s Gpu, &'s S) -> &'s device::Buf + 'a,
{
    Box::new(move |get| {
        let o = f(g, &state);
        g.sync();
        out(get, || g.download(o))
    })
}

/// A case; `tol` from the inputs' storage type (the conformance suite's contract).
fn case<'a>(kernel: &'static str, dtype: &'static str, gflops: bool, work: f64, cpu: Run<'a>, dev: Option<Run<'a>>) -> Case<'a> {
    Case { kernel, dtype, gflops, work, tol: if dtype == "bf16" { 1e-2 } else { 1e-5 }, cpu, dev }
}

fn products<'a>(x: &'a Inputs, g: Option<&'a Gpu>) -> Vec<Case<'a>> {
    let flops = 2.0 * (BT * C * C) as f64;
    let (inp, bias) = (&x.x[..BT * C], &x.ln[..C]);
    let mut cases = Vec::new();
    for (arith, dt, dtype) in [(Arith::F32, DType::F32, "f32"), (Arith::Bf16, DType::Bf16, "bf16")] {
        let mut o = vec![0.0; BT * C];
        let cpu: Run = Box::new(move |get| {
            tensor::matmul::matmul_forward_as(arith, &mut o, inp, &x.w, Some(bias), (BT, C, C));
            out(get, || o.clone())
        });
        let dev = g.map(|g| {
            let st = (g.upload_as(inp, dt), g.upload_as(&x.w, dt), g.upload(bias), g.zeros(BT * C));
            on(g, st, |g, (i, w, b, o)| {
                g.matmul_forward(o, i, w.at(0), Some(b.at(0)), (BT, C, C));
                o
            })
        });
        cases.push(case("matmul_forward", dtype, true, flops, cpu, dev));
    }
    let dout = &x.dout[..BT * C];
    let (mut di, mut dw, mut db) = (vec![0.0; BT * C], vec![0.0; C * C], vec![0.0; C]);
    let cpu: Run = Box::new(move |get| {
        tensor::matmul_backward((&mut di, &mut dw, Some(&mut db)), dout, inp, &x.w, BT, C, C);
        out(get, || di.clone())
    });
    let dev = g.map(|g| {
        let st = (g.upload(inp), g.upload(&x.w), g.upload(dout), g.zeros(BT * C), g.zeros(C * C), g.zeros(C));
        on(g, st, |g, (i, w, d, di, dw, db)| {
            g.matmul_backward((di, dw.at(0), Some(db.at(0))), d, i, w.at(0), (BT, C, C));
            di
        })
    });
    cases.push(case("matmul_backward", "f32", true, 2.0 * flops, cpu, dev));
    cases.extend(head(x, g));
    cases
}

/// The LM head with cross-entropy, forward and backward, over a 4096-token vocabulary.
fn head<'a>(x: &'a Inputs, g: Option<&'a Gpu>) -> Vec<Case<'a>> {
    let dims = HeadDims { c: C, v: V, vp: V, offset: 0, ignore_index: -100, arith: Arith::F32, softcap: 0.0 };
    let inp = &x.x[..BT * C];
    let dloss = 1.0 / BT as f32;
    let (mut losses, mut di, mut dw, mut scratch) = (vec![0.0; BT], vec![0.0; BT * C], vec![0.0; V * C], vec![0.0; BT * V]);
    let cpu: Run = Box::new(move |get| {
        tensor::classifier::lm_head_crossentropy(&mut losses, Some((&mut di, &mut dw, tensor::classifier::Dloss::All(dloss))), inp, &x.head_w, &x.targets, &mut scratch, &dims);
        out(get, || di.clone())
    });
    let dev = g.map(|g| {
        let tg: Vec<u32> = x.targets.iter().map(|&t| t as u32).collect();
        let st = (g.upload(inp), g.upload(&x.head_w), g.upload_u32(&tg), g.upload(&[dloss]), g.zeros(BT), g.zeros(BT * C), g.zeros(V * C), g.zeros(BT * V));
        on(g, st, move |g, (i, w, tg, s, l, di, dw, scratch)| {
            g.lm_head_crossentropy(l, Some((di, Some(dw.at(0)), (s, 0))), i, w.at(0), tg, scratch, &dims);
            di
        })
    });
    vec![case("lm_head_crossentropy", "f32", true, 6.0 * (BT * C * V) as f64, cpu, dev), vocab_parallel_head(x, g)]
}

/// The vocabulary-parallel head of the second of two parts (vocabulary rows `V/2 ..`), the
/// first part's `[lse | target logit]` per row standing in for the exchange.
fn vocab_parallel_head<'a>(x: &'a Inputs, g: Option<&'a Gpu>) -> Case<'a> {
    let h = V / 2;
    let dims = HeadDims { c: C, v: V - h, vp: V - h, offset: h, ignore_index: -100, arith: Arith::F32, softcap: 0.0 };
    let inp = &x.x[..BT * C];
    let dloss = 1.0 / BT as f32;
    // The first part's statistics, as its head hands them to the exchange.
    let mut first = Vec::new();
    let (mut losses, mut scratch) = (vec![0.0; BT], vec![0.0; BT * h]);
    let d0 = HeadDims { v: h, vp: h, offset: 0, ..dims };
    tensor::classifier::lm_head_crossentropy_vocab_parallel(&mut losses, None, inp, &x.head_w[..h * C], &x.targets, &mut scratch, &d0, &mut |m| {
        first = m.to_vec();
        [m, m].concat()
    });
    let exchange = move |mine: &[f32]| -> Vec<f32> { [&first[..], mine].concat() };
    let w = &x.head_w[h * C..];
    let (mut di, mut dw, mut scratch) = (vec![0.0; BT * C], vec![0.0; (V - h) * C], vec![0.0; BT * (V - h)]);
    let ex = exchange.clone();
    let cpu: Run = Box::new(move |get| {
        tensor::classifier::lm_head_crossentropy_vocab_parallel(&mut losses, Some((&mut di, &mut dw, tensor::classifier::Dloss::All(dloss))), inp, w, &x.targets, &mut scratch, &dims, &mut |m| ex(m));
        out(get, || di.clone())
    });
    let dev = g.map(|g| {
        let tg: Vec<u32> = x.targets.iter().map(|&t| t as u32).collect();
        let st = (g.upload(inp), g.upload(w), g.upload_u32(&tg), g.upload(&[dloss]), g.zeros(BT), g.zeros(BT * C), g.zeros((V - h) * C), (g.zeros(BT * (V - h)), g.zeros(2 * BT)));
        on(g, st, move |g, (i, w, tg, s, l, di, dw, (scratch, stats))| {
            g.lm_head_crossentropy_vocab_parallel(l, Some((di, Some(dw.at(0)), (s, 0))), i, w.at(0), tg, (scratch, stats), &dims, &mut |m| exchange(m));
            di
        })
    });
    case("lm_head_crossentropy_vocab_parallel", "f32", true, 6.0 * (BT * C * (V - h)) as f64, cpu, dev)
}

fn rows<'a>(x: &'a Inputs, g: Option<&'a Gpu>) -> Vec<Case<'a>> {
    let (inp, dout) = (&x.x[..BT * C], &x.dout[..BT * C]);
    let (w, b) = (&x.ln[..C], &x.ln[C..]);
    let bytes = (BT * C * 8) as f64;
    let mut cases = Vec::new();
    let (mut o, mut mean, mut rstd) = (vec![0.0; BT * C], vec![0.0; BT], vec![0.0; BT]);
    let cpu: Run = Box::new(move |get| {
        tensor::layernorm_forward(&mut o, &mut mean, &mut rstd, inp, w, Some(b), C);
        out(get, || o.clone())
    });
    let dev = g.map(|g| {
        let st = (g.upload(inp), g.upload(&x.ln), g.zeros(BT * C), g.zeros(BT), g.zeros(BT));
        on(g, st, |g, (i, p, o, m, r)| {
            g.layernorm_forward(o, (m, r), i, p.at(0), Some(p.at(C)), C);
            o
        })
    });
    cases.push(case("layernorm_forward", "f32", false, bytes, cpu, dev));
    let (mut mean, mut rstd, mut scratch) = (vec![0.0; BT], vec![0.0; BT], vec![0.0; BT * C]);
    tensor::layernorm_forward(&mut scratch, &mut mean, &mut rstd, inp, w, Some(b), C);
    let (mean2, rstd2) = (mean.clone(), rstd.clone());
    let (mut di, mut dp) = (vec![0.0; BT * C], vec![0.0; 2 * C]);
    let cpu: Run = Box::new(move |get| {
        let (dw, db) = dp.split_at_mut(C);
        tensor::layernorm_backward((&mut di, dw, Some(db)), dout, inp, w, (&mean, &rstd), C);
        out(get, || di.clone())
    });
    let dev = g.map(|g| {
        let st = (g.upload(inp), g.upload(&x.ln), g.upload(dout), g.upload(&mean2), g.upload(&rstd2), g.zeros(BT * C), g.zeros(2 * C));
        on(g, st, |g, (i, p, d, m, r, di, dp)| {
            g.layernorm_backward((di, dp.at(0), Some(dp.at(C))), d, i, p.at(0), (m, r), C);
            di
        })
    });
    cases.push(case("layernorm_backward", "f32", false, 1.5 * bytes, cpu, dev));
    let (mut o, mut rstd) = (vec![0.0; BT * C], vec![0.0; BT]);
    let cpu: Run = Box::new(move |get| {
        tensor::llama::rmsnorm_forward(&mut o, &mut rstd, inp, w, 1e-6, C);
        out(get, || o.clone())
    });
    let dev = g.map(|g| {
        let st = (g.upload(inp), g.upload(&x.ln), g.zeros(BT * C), g.zeros(BT));
        on(g, st, |g, (i, p, o, r)| {
            g.rmsnorm_forward(o, r, i, p.at(0), 1e-6, C);
            o
        })
    });
    cases.push(case("rmsnorm_forward", "f32", false, bytes, cpu, dev));
    cases.extend(embedding(x, g));
    cases
}

fn embedding<'a>(x: &'a Inputs, g: Option<&'a Gpu>) -> Vec<Case<'a>> {
    let (wte, wpe) = x.wte.split_at(V * C);
    let bytes = (BT * C * 12) as f64;
    let mut o = vec![0.0; BT * C];
    let cpu: Run = Box::new(move |get| {
        tensor::embedding_forward(&mut o, &x.tokens, wte, Some(wpe), T, C);
        out(get, || o.clone())
    });
    let dev = g.map(|g| {
        let st = (g.upload(&x.wte), g.upload_u32(&x.tokens), g.zeros(BT * C));
        on(g, st, |g, (p, tk, o)| {
            g.embedding_forward(o, tk, p.at(0), Some(p.at(V * C)), T, C);
            o
        })
    });
    let fwd = case("embedding_forward", "f32", false, bytes, cpu, dev);
    let dout = &x.dout[..BT * C];
    let mut dp = vec![0.0; (V + T) * C];
    let cpu: Run = Box::new(move |get| {
        let (dwte, dwpe) = dp.split_at_mut(V * C);
        tensor::embedding_backward(dwte, Some(dwpe), dout, &x.tokens, T, C);
        out(get, || dp.clone())
    });
    let dev = g.map(|g| {
        let st = (g.zeros((V + T) * C), g.upload_u32(&x.tokens), g.upload(dout));
        on(g, st, |g, (dp, tk, d)| {
            g.embedding_backward(dp.at(0), Some(dp.at(V * C)), d, tk, T, C);
            dp
        })
    });
    vec![fwd, case("embedding_backward", "f32", false, bytes, cpu, dev)]
}

fn elementwise<'a>(x: &'a Inputs, g: Option<&'a Gpu>) -> Vec<Case<'a>> {
    let n = BT * 4 * C;
    let (inp, dout) = (&x.x[..], &x.dout[..]);
    let mut cases = Vec::new();
    let mut o = vec![0.0; n];
    let cpu: Run = Box::new(move |get| {
        tensor::gelu_forward(&mut o, inp);
        out(get, || o.clone())
    });
    let dev = g.map(|g| on(g, (g.upload(inp), g.zeros(n)), |g, (i, o)| {
        g.gelu_forward(o, i);
        o
    }));
    cases.push(case("gelu_forward", "f32", false, (n * 8) as f64, cpu, dev));
    let mut di = vec![0.0; n];
    let cpu: Run = Box::new(move |get| {
        tensor::gelu_backward(&mut di, dout, inp);
        out(get, || di.clone())
    });
    let dev = g.map(|g| on(g, (g.upload(inp), g.upload(dout), g.zeros(n)), |g, (i, d, di)| {
        g.gelu_backward(di, d, i);
        di
    }));
    cases.push(case("gelu_backward", "f32", false, (n * 16) as f64, cpu, dev));
    let f = 2 * C;
    let mut o = vec![0.0; BT * f];
    let cpu: Run = Box::new(move |get| {
        tensor::llama::swiglu_forward(&mut o, inp, f);
        out(get, || o.clone())
    });
    let dev = g.map(|g| on(g, (g.upload(inp), g.zeros(BT * f)), move |g, (i, o)| {
        g.swiglu_forward(o, i, f);
        o
    }));
    cases.push(case("swiglu_forward", "f32", false, (BT * f * 12) as f64, cpu, dev));
    let mut o = vec![0.0; n];
    let cpu: Run = Box::new(move |get| {
        tensor::dropout_forward(&mut o, inp, 0.1, 7);
        out(get, || o.clone())
    });
    let dev = g.map(|g| on(g, (g.upload(inp), g.zeros(n)), |g, (i, o)| {
        g.dropout_forward(o, i, 0.1, 7);
        o
    }));
    cases.push(case("dropout_forward", "f32", false, (n * 8) as f64, cpu, dev));
    let mut h = vec![0u16; n];
    let mut rounded = vec![0.0; n];
    let cpu: Run = Box::new(move |get| {
        use tensor::precision::{from_bits16, pack16, round_into, Format};
        round_into(&mut rounded, inp, Format::Bf16);
        pack16(&mut h, &rounded, Format::Bf16);
        out(get, || h.iter().map(|&b| from_bits16(b, Format::Bf16)).collect())
    });
    let dev = g.map(|g| on(g, (g.upload(inp), g.zeros_of(n, DType::Bf16)), |g, (i, h)| {
        g.cast(h, i).expect("equal lengths");
        h
    }));
    cases.push(case("cast", "f32->bf16", false, (n * 6) as f64, cpu, dev));
    cases
}

fn attention<'a>(x: &'a Inputs, g: Option<&'a Gpu>) -> Vec<Case<'a>> {
    let d = GqaDims { b: B, t: T, nh: NH, nkv: NH, hs: HS, ..Default::default() };
    // Causal: half the T² scores, two products each way.
    let flops = 4.0 * (B * NH * T * T / 2 * HS) as f64;
    let mut cases = Vec::new();
    let (cos, sin) = tensor::llama::rope_table(10000.0, HS, T);
    let mut qkv = x.qkv.clone();
    let (c2, s2) = (cos.clone(), sin.clone());
    let cpu: Run = Box::new(move |get| {
        tensor::llama::rope_forward(&mut qkv, &c2, &s2, &d, 0);
        out(get, || qkv.clone())
    });
    let dev = g.map(|g| on(g, (g.upload(&x.qkv), g.upload(&cos), g.upload(&sin)), move |g, (q, c, s)| {
        g.rope(q, (c, s), &d, RopePos::Offset(0), false);
        q
    }));
    cases.push(case("rope_forward", "f32", false, (BT * 2 * C * 8) as f64, cpu, dev));
    let (mut o, mut lse) = (vec![0.0; BT * C], vec![0.0; B * NH * T]);
    let cpu: Run = Box::new(move |get| {
        tensor::flash::flash_gqa_forward(&mut o, &mut lse, &x.qkv, &d, AttnDropout::NONE);
        out(get, || o.clone())
    });
    let dev = g.map(|g| on(g, (g.upload(&x.qkv), g.zeros(BT * C), g.zeros(B * NH * T)), move |g, (q, o, l)| {
        g.flash_forward(o, l, q, &d, None, AttnDropout::NONE);
        o
    }));
    cases.push(case("flash_forward", "f32", true, flops, cpu, dev));
    let (mut o, mut lse) = (vec![0.0; BT * C], vec![0.0; B * NH * T]);
    tensor::flash::flash_gqa_forward(&mut o, &mut lse, &x.qkv, &d, AttnDropout::NONE);
    let dout = &x.dout[..BT * C];
    let (o2, l2) = (o.clone(), lse.clone());
    let mut dq = vec![0.0; BT * 3 * C];
    let cpu: Run = Box::new(move |get| {
        tensor::flash::flash_gqa_backward(&mut dq, dout, &x.qkv, &o, &lse, &d, AttnDropout::NONE);
        out(get, || dq.clone())
    });
    let dev = g.map(|g| {
        let st = (g.upload(&x.qkv), g.upload(&o2), g.upload(&l2), g.upload(dout), g.zeros(BT * 3 * C), g.zeros(B * NH * T));
        on(g, st, move |g, (q, o, l, dy, dq, s)| {
            g.flash_backward(dq, s, dy, (q, o, l), (&d, None), AttnDropout::NONE);
            dq
        })
    });
    cases.push(case("flash_backward", "f32", true, 2.5 * flops, cpu, dev));
    // One token's attention over a full KV cache of T positions (decoding).
    let kw = NH * HS;
    let (k, v) = (&x.qkv[..T * kw], &x.qkv[T * kw..2 * T * kw]);
    let q = &x.dout[..kw];
    let mut o = vec![0.0; kw];
    let cpu: Run = Box::new(move |get| {
        tensor::attention::attention_decode(&mut o, q, k, v, &d1(T));
        out(get, || o.clone())
    });
    let dev = g.map(|g| on(g, (g.upload(q), g.upload(k), g.upload(v), g.zeros(kw)), move |g, (q, k, v, o)| {
        g.attention_decode(o, q, (k, v), 0, &d1(T));
        o
    }));
    cases.push(case("attention_decode", "f32", true, 4.0 * (NH * T * HS) as f64, cpu, dev));
    cases
}

/// One sequence of `t` cached positions, for decoding.
fn d1(t: usize) -> GqaDims {
    GqaDims { b: 1, t, nh: NH, nkv: NH, hs: HS, ..Default::default() }
}

fn optimizer<'a>(x: &'a Inputs, g: Option<&'a Gpu>) -> Vec<Case<'a>> {
    let n = x.x.len();
    let h = tensor::AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, t: 3 };
    let (mut p, mut m, mut v) = (x.dout.clone(), vec![0.0; n], vec![0.0; n]);
    let cpu: Run = Box::new(move |get| {
        tensor::adamw_update(&mut p, &x.x, &mut m, &mut v, &h);
        out(get, || p.clone())
    });
    let dev = g.map(|g| {
        let s = g.upload(&[0.0; device::slot::OPTIM]);
        g.write_words(&s, device::slot::CLIP_SCALE, &[1.0f32.to_bits()]);
        g.set_adamw_scalars(&s, &h);
        let st = (g.upload(&x.dout), g.upload(&x.x), g.zeros(n), g.zeros(n), s);
        on(g, st, move |g, (p, gr, m, v, s)| {
            g.adamw_update((p, gr, m, v), 0, n, &h, true, s);
            p
        })
    });
    let adam = case("adamw_update", "f32", false, (n * 28) as f64, cpu, dev);
    let cpu: Run = Box::new(move |get| {
        let sumsq = tensor::sum_squares(&x.x);
        out(get, || vec![sumsq as f32])
    });
    let dev = g.map(|g| {
        let st = (g.upload(&x.x), g.zeros(device::slot::OPTIM), g.zeros(Gpu::parts_len()));
        on(g, st, move |g, (xs, s, parts)| {
            g.sum_squares((s, device::slot::SUMSQ), xs.at(0), n, parts, false);
            s
        })
    });
    // The device's answer sits in its slot: compare that element.
    let dev = dev.map(|mut f| -> Run {
        Box::new(move |get| {
            let all = f(get);
            out(get, || vec![all[device::slot::SUMSQ]])
        })
    });
    let sumsq = case("sum_squares", "f32", false, (n * 4) as f64, cpu, dev);
    vec![adam, lion(x, g), sumsq]
}

/// Lion's update (`tensor::optim::lion_update`): reads p, g, m and writes p, m.
fn lion<'a>(x: &'a Inputs, g: Option<&'a Gpu>) -> Case<'a> {
    let n = x.x.len();
    let h = tensor::optim::Lion { lr: 1e-3, beta1: 0.9, beta2: 0.99, weight_decay: 0.1 };
    let (mut p, mut m) = (x.dout.clone(), vec![0.0; n]);
    let cpu: Run = Box::new(move |get| {
        tensor::optim::lion_update(&mut p, &x.x, &mut m, &h);
        out(get, || p.clone())
    });
    let dev = g.map(|g| {
        let s = g.upload(&[0.0; device::slot::OPTIM]);
        g.write_words(&s, device::slot::CLIP_SCALE, &[1.0f32.to_bits()]);
        g.set_lion_scalars(&s, &h);
        let st = (g.upload(&x.dout), g.upload(&x.x), g.zeros(n), s);
        on(g, st, move |g, (p, gr, m, s)| {
            let at = device::Offsets { params: 0, grads: 0, moments: 0 };
            g.lion_update_at((p, gr, m), at, n, &h, true, s);
            p
        })
    });
    case("lion_update", "f32", false, (n * 20) as f64, cpu, dev)
}

/// A mixture-of-experts layer's routing: top-2 of 8 experts with capacity (1.25 × the even
/// share, so some assignments drop), and the combine of the experts' rows back into tokens.
fn experts<'a>(x: &'a Inputs, g: Option<&'a Gpu>) -> Vec<Case<'a>> {
    use tensor::moe::{moe_assign, moe_combine, moe_route, MoeRoute};
    let (n, e, k) = (BT, 8, 2);
    let capacity = (1.25 * (n * k) as f64 / e as f64) as usize;
    let logits = &x.x[..n * e];
    // The CPU's routing, for the combine's inputs.
    let (mut probs, mut lse, mut idx, mut gates) = (vec![0.0; n * e], vec![0.0; n], vec![0u32; n * k], vec![0.0; n * k]);
    moe_route(MoeRoute { probs: &mut probs, lse: &mut lse, idx: &mut idx, gates: &mut gates }, logits, e, true);
    let (mut slot, mut row_token, mut offsets, mut counts) = (vec![0u32; n * k], vec![0u32; n * k], vec![0usize; e + 1], vec![0usize; e]);
    let rows = moe_assign(&mut slot, &mut row_token, &mut offsets, &mut counts, &idx, k, capacity);
    let route_cpu: Run = Box::new(move |get| {
        let (mut p, mut l, mut i, mut gt) = (vec![0.0; n * e], vec![0.0; n], vec![0u32; n * k], vec![0.0; n * k]);
        moe_route(MoeRoute { probs: &mut p, lse: &mut l, idx: &mut i, gates: &mut gt }, logits, e, true);
        let (mut s, mut rt, mut o, mut c) = (vec![0u32; n * k], vec![0u32; n * k], vec![0usize; e + 1], vec![0usize; e]);
        moe_assign(&mut s, &mut rt, &mut o, &mut c, &i, k, capacity);
        out(get, || gt)
    });
    let route_dev = g.map(|g| {
        let st = (g.routing(n, e, k), g.upload(logits));
        on(g, st, move |g, (r, l)| {
            g.moe_route(r, l, true, capacity);
            &r.gates
        })
    });
    let eo = &x.dout[..rows * C];
    let mut y = vec![0.0; n * C];
    let combine_cpu: Run = Box::new(move |get| {
        moe_combine(&mut y, eo, &gates, &slot, false, C, k);
        out(get, || y.clone())
    });
    let combine_dev = g.map(|g| {
        let r = g.routing(n, e, k);
        g.moe_route(&r, &g.upload(logits), true, capacity);
        let mut padded = eo.to_vec();
        padded.resize(n * k * C, 0.0);
        let st = (r, g.upload(&padded), g.zeros(n * C));
        on(g, st, |g, (r, eo, y)| {
            g.moe_combine(y, eo, r, C, false);
            y
        })
    });
    vec![
        case("moe_route (top-2 of 8, capacity)", "f32", false, (n * e * 4 + n * k * 12) as f64, route_cpu, route_dev),
        case("moe_combine", "f32", false, ((rows + n) * C * 4) as f64, combine_cpu, combine_dev),
    ]
}

/// Number formats: fp32 rounded to bf16 (mixed precision's working weights), and QLoRA's NF4
/// base dequantized (double-quantized block maxima).
fn formats<'a>(x: &'a Inputs, g: Option<&'a Gpu>) -> Vec<Case<'a>> {
    let n = x.x.len();
    let mut o = vec![0.0; n];
    let cpu: Run = Box::new(move |get| {
        o.copy_from_slice(&x.x);
        tensor::precision::round_slice(&mut o, tensor::precision::Format::Bf16);
        out(get, || o.clone())
    });
    let dev = g.map(|g| {
        let st = (g.upload(&x.x), g.zeros_of(n, DType::Bf16));
        on(g, st, |g, (src, dst)| {
            g.cast(dst, src).expect("one length");
            dst
        })
    });
    // Rounding is exact: the contract is fp32's.
    let cast = case("cast", "f32", false, (n * 6) as f64, cpu, dev);
    let q = tensor::quant::Nf4::quantize(&x.w, true);
    let m = x.w.len();
    let qc = q.clone();
    let cpu: Run = Box::new(move |get| {
        let d = qc.dequantize();
        out(get, || d)
    });
    let dev = g.map(|g| {
        let st = (g.upload_quantized(tensor::quant::QPart::Nf4(&q)).expect("a small tensor"), g.zeros(m));
        on(g, st, |g, (qb, o)| {
            g.dequantize(o.at(0), qb);
            o
        })
    });
    vec![cast, case("dequantize (nf4)", "f32", false, (m * 4 + m / 2) as f64, cpu, dev)]
}

/// max |got − want| over max |want|.
fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs())) as f64;
    got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs() as f64)) / scale.max(f64::MIN_POSITIVE)
}

/// Seconds per run, after one untimed run, and the output of one more.
fn measure(run: &mut Run, reps: usize) -> (f64, Vec<f32>) {
    run(false);
    let t = Instant::now();
    for _ in 0..reps {
        run(false);
    }
    let s = t.elapsed().as_secs_f64() / reps as f64;
    (s, run(true))
}

/// `kiln doctor --check-kernels`: every kernel of the bench run once on `d` against its CPU
/// twin, one line each (`ok`, the kernel, its type, the error against the contract); a kernel
/// past the contract is an error (exit 2).
pub fn check(d: DeviceArg) -> Result<()> {
    if d == DeviceArg::Cpu {
        return user("kiln doctor --check-kernels checks a device's kernels against the CPU's: pass --device vulkan[:N] or cuda[:N]");
    }
    let v = run(d, 1)?;
    let rows = v["kernels"].as_array().map_or(&[][..], |r| &r[..]);
    println!("{}", v["adapter"].as_str().unwrap_or(""));
    for r in rows {
        println!("ok  {:<28} {:<5} max error {:.2e} (contract {:.0e})", r["kernel"].as_str().unwrap_or(""), r["dtype"].as_str().unwrap_or(""), r["max_err_over_max_ref"].as_f64().unwrap_or(f64::NAN), r["tol"].as_f64().unwrap_or(f64::NAN));
    }
    println!("{} kernels on {d} agree with their CPU twins", rows.len());
    Ok(())
}

/// The bench's JSON: one object per kernel.
pub fn run(d: DeviceArg, reps: usize) -> Result<Value> {
    let gpu = crate::device::open(d)?;
    let g = gpu.as_ref();
    let x = inputs();
    let mut cases = products(&x, g);
    cases.extend(rows(&x, g));
    cases.extend(elementwise(&x, g));
    cases.extend(attention(&x, g));
    cases.extend(optimizer(&x, g));
    cases.extend(formats(&x, g));
    cases.extend(experts(&x, g));
    let mut rows = Vec::new();
    for mut k in cases {
        let (cpu_s, want) = measure(&mut k.cpu, reps);
        let (unit, scale) = if k.gflops { ("GFLOP/s", 1e9) } else { ("GB/s", 1e9) };
        let mut v = json!({"kernel": k.kernel, "dtype": k.dtype, "unit": unit, "cpu_ms": cpu_s * 1e3, "cpu_rate": k.work / cpu_s / scale});
        if let Some(dev) = k.dev.as_mut() {
            let (s, got) = measure(dev, reps);
            let err = rel_err(&got, &want);
            v["device_ms"] = json!(s * 1e3);
            v["device_rate"] = json!(k.work / s / scale);
            v["device_over_cpu"] = json!(cpu_s / s);
            v["max_err_over_max_ref"] = json!(err);
            v["tol"] = json!(k.tol);
            if err > k.tol {
                return user(format!("kernel {} ({}) on {d}: device and CPU differ by {err:e} (max abs error over max abs reference), over the {:e} contract", k.kernel, k.dtype, k.tol));
            }
        }
        rows.push(v);
    }
    Ok(json!({
        "device": d.to_string(),
        "adapter": g.map(|g| g.info.describe()),
        "shape": {"b": B, "t": T, "c": C, "heads": NH, "head_size": HS, "vocab": V},
        "reps": reps,
        "threads": rayon::current_num_threads(),
        "kernels": rows,
    }))
}
