//! Autoregressive sampling with a KV cache. One token at a time through the same kernels as
//! training (with `B·T = 1`), attending over cached keys and values. When the context fills
//! `block_size`, the cache is rebuilt from the most recent half-context (as nanoGPT crops).

use crate::gpt::{Gpt, Ops};
use tensor::llama::{qk_rmsnorm_forward, rope_forward, GqaDims};
use tensor::*;

/// Sampling settings, as transformers' `generate` applies them: the repetition penalty (CTRL's:
/// a seen token's logit divided by it when positive, multiplied when negative; 1 is off), then
/// `temperature` (0 is greedy), `top_k` (0: the full vocabulary), `top_p` (nucleus: the
/// smallest set of most likely tokens whose probability reaches it; 1 is off). Generation stops
/// after any of `stop_ids` (the model's EOS tokens).
#[derive(Clone, Debug)]
pub struct Sampler {
    pub temperature: f32,
    pub top_k: usize,
    pub seed: u64,
    pub top_p: f32,
    pub repetition_penalty: f32,
    pub stop_ids: Vec<u32>,
}

impl Sampler {
    /// Temperature and top-k sampling from `seed`, nothing else (no stop token).
    pub fn new(temperature: f32, top_k: usize, seed: u64) -> Sampler {
        Sampler { temperature, top_k, seed, top_p: 1.0, repetition_penalty: 1.0, stop_ids: Vec::new() }
    }
}

/// Keys and values for every layer: `[L, block_size, NKV·HS]` each. Under multi-head latent
/// attention (DeepSeek's MLA) the compressed form instead: per layer and position the normed
/// key/value latent and the rotated shared key, `[L, block_size, KVR + R]` in `k` (`v` empty),
/// expanded to every head's keys and values as each step attends.
pub struct KvCache {
    k: Vec<f32>,
    v: Vec<f32>,
    pub len: usize,
}

impl KvCache {
    /// The bytes the cache holds (both tensors, all layers and positions).
    pub fn bytes(&self) -> usize {
        4 * (self.k.len() + self.v.len())
    }
}

struct Scratch {
    x: Vec<f32>, ln: Vec<f32>, qkv: Vec<f32>, atty: Vec<f32>, proj: Vec<f32>, res: Vec<f32>,
    fch: Vec<f32>, fch_gelu: Vec<f32>, logits: Vec<f32>, mean: Vec<f32>, rstd: Vec<f32>,
    /// Qwen3's per-head norms: their inputs and `rstd` (unused after the step).
    qk_pre: Vec<f32>, qk_rstd: Vec<f32>,
    moe: Option<tensor::moe::MoeCache>,
}

impl Gpt {
    pub fn new_cache(&self) -> KvCache {
        let cfg = &self.cfg;
        if cfg.is_mla() {
            let n = cfg.n_layer * cfg.block_size * (cfg.kv_lora_rank + cfg.rotary_dim);
            return KvCache { k: vec![0.0; n], v: Vec::new(), len: 0 };
        }
        let n = cfg.n_layer * cfg.block_size * cfg.n_kv_head * cfg.head_size();
        KvCache { k: vec![0.0; n], v: vec![0.0; n], len: 0 }
    }

    /// Feeds one token at position `cache.len`, appends its keys/values, and returns the
    /// logits `[Vp]` for the next token. Each call is a pass of `cache.len + 1` positions, as a
    /// generated token is in transformers: a prompt fed through it token by token gets
    /// LongRoPE's short tables where one prefill pass ([`Gpt::generate`]) would get the long.
    pub fn decode_step(&self, cache: &mut KvCache, token: u32) -> Vec<f32> {
        let mut s = self.scratch_1();
        let pass = cache.len + 1;
        self.decode_into(cache, token, pass, &mut s);
        s.logits
    }

    fn scratch_1(&self) -> Scratch {
        self.scratch_n(1)
    }

    /// Scratch for `n` rows decoded together.
    fn scratch_n(&self, n: usize) -> Scratch {
        let c = self.cfg.n_embd;
        let f = self.cfg.dense_hidden();
        let heads = self.cfg.n_head + self.cfg.n_kv_head;
        Scratch {
            x: vec![0.0; n * c], ln: vec![0.0; n * c], qkv: vec![0.0; n * self.cfg.qkv_width()], atty: vec![0.0; n * self.cfg.attn_width()], proj: vec![0.0; n * c], res: vec![0.0; n * c],
            fch: vec![0.0; n * self.cfg.dense_fc_width()], fch_gelu: vec![0.0; n * f], logits: vec![0.0; n * self.cfg.vocab_size], mean: vec![0.0; n], rstd: vec![0.0; n],
            qk_pre: vec![0.0; n * heads * self.cfg.head_size()], qk_rstd: vec![0.0; n * heads],
            moe: self.cfg.is_moe().then(|| tensor::moe::MoeCache::new(self.cfg.moe_dims(n))),
        }
    }

    /// `pass`: the length of the pass this token belongs to, as transformers would run it (a
    /// prompt's tokens: the prompt's length; a generated token: its position + 1), which picks
    /// LongRoPE's tables.
    fn decode_into(&self, cache: &mut KvCache, token: u32, pass: usize, s: &mut Scratch) {
        self.decode_rows(std::slice::from_mut(cache), (&[0], &[token]), pass, s);
    }

    /// Feeds `tokens[i]` to sequence `rows[i]` of `caches` (every one at the same position), the
    /// rows' products done together; leaves each row's next-token logits in `s.logits`
    /// (`[rows, Vp]`). `s` holds at least `rows.len()` rows.
    fn decode_rows(&self, caches: &mut [KvCache], (rows, tokens): (&[usize], &[u32]), pass: usize, s: &mut Scratch) {
        let cfg = &self.cfg;
        assert!(cfg.place.heads.is_none(), "decoding needs the whole model, not a tensor-parallel shard");
        let (c, nh, nkv, hs, bs, vp) = (cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_size(), cfg.block_size, cfg.vocab_size);
        let (qw, fw, f, kw) = (cfg.qkv_width(), cfg.dense_fc_width(), cfg.dense_hidden(), cfg.n_kv_head * cfg.head_size());
        let n = rows.len();
        let pos = caches[rows[0]].len;
        assert!(rows.iter().all(|&r| caches[r].len == pos), "rows decoded together share their position");
        assert!(pos < bs, "KV cache full");
        // Each row one new token (for RoPE); attention reads `t: pos + 1` cached positions.
        let one = GqaDims { b: 1, t: 1, nh, nkv, hs, window: self.cfg.sliding_window, sinks: self.cfg.attn_sinks, rotary: self.cfg.rotary_dim, scale: self.cfg.attn_scale(), softcap: self.cfg.attn_softcap, ..GqaDims::default() };
        let w = &self.params;
        let pv = &self.views;
        let rope = self.rope.as_ref().map(|r| r.for_pass(pass));
        let ops = Ops::decode(cfg, rope, self.rope.as_ref().and_then(crate::gpt::RopeTables::local));
        let opt = |r: &Option<std::ops::Range<usize>>| r.as_ref().map(|r| &w[r.clone()]);
        let (x, ln, qkv, atty, proj, res) = (&mut s.x[..n * c], &mut s.ln[..n * c], &mut s.qkv[..n * qw], &mut s.atty[..n * cfg.attn_width()], &mut s.proj[..n * c], &mut s.res[..n * c]);
        let (mean, rstd) = (&mut s.mean[..n], &mut s.rstd[..n]);
        for (i, &token) in tokens.iter().enumerate() {
            x[i * c..(i + 1) * c].copy_from_slice(&w[pv.wte.clone()][token as usize * c..(token as usize + 1) * c]);
            if let Some(wpe) = &pv.wpe {
                for (x, p) in x[i * c..(i + 1) * c].iter_mut().zip(&w[wpe.clone()][pos * c..(pos + 1) * c]) {
                    *x += p;
                }
            }
        }
        if let Some(sc) = cfg.embed_multiplier() {
            x.iter_mut().for_each(|v| *v *= sc);
        }
        for (l, bp) in pv.blocks.iter().enumerate() {
            let a_in = pre_norm(&ops, (ln, mean, rstd), x, (&bp.ln_1_w, &bp.ln_1_b), w);
            // Latent attention: the new rows' normed latents, for the compressed cache.
            let mut mla = bp.mla.as_ref().map(|_| crate::mla::MlaActs::new(Some(crate::mla::MlaDims::of(cfg, n))));
            match (&bp.mla, mla.as_mut()) {
                (Some(m), Some(acts)) => {
                    let mw = crate::mla::MlaWeights { unit: w, p: m, arith: Default::default() };
                    crate::mla::mla_forward(qkv, acts, a_in, &mw, &crate::mla::MlaDims::of(cfg, n));
                }
                _ => matmul_forward(qkv, a_in, &w[bp.c_attn_w.clone()], opt(&bp.c_attn_b), n, c, qw),
            }
            if let Some(r) = &bp.qk_norm_w {
                let (pre, groups) = (&mut s.qk_pre[..n * (nh + nkv) * hs], &mut s.qk_rstd[..n * cfg.qk_norm_groups()]);
                qk_rmsnorm_forward(qkv, pre, groups, &ops.norm_weight(&w[r.clone()]), cfg.norm_eps, (nh, nkv, hs));
            }
            if rope.is_some() && cfg.rope_at(l) {
                let (cos, sin) = ops.rope_of(l);
                rope_forward(qkv, cos, sin, &GqaDims { b: n, ..one }, pos);
            }
            let dims = GqaDims { t: pos + 1, window: cfg.window_of(l), ..one };
            match (&bp.mla, &mla) {
                (Some(m), Some(acts)) => self.attend_latent(l, (caches, rows), (qkv, atty), (&w[m.kv_b.clone()], acts.kvn()), &dims),
                _ => {
                    let base = l * bs * kw;
                    let qc = nh * hs;
                    for (i, &r) in rows.iter().enumerate() {
                        let (q, cache) = (&qkv[i * qw..(i + 1) * qw], &mut caches[r]);
                        cache.k[base + pos * kw..base + (pos + 1) * kw].copy_from_slice(&q[qc..qc + kw]);
                        cache.v[base + pos * kw..base + (pos + 1) * kw].copy_from_slice(&q[qc + kw..]);
                        let (kc, vc) = (&cache.k[base..base + (pos + 1) * kw], &cache.v[base..base + (pos + 1) * kw]);
                        attention_decode(&mut atty[i * qc..(i + 1) * qc], &q[..qc], kc, vc, &dims);
                    }
                }
            }
            if bp.mla.is_some() {
                // The heads' values, narrower than q·k's (DeepSeek's latent attention).
                let mut o_in = vec![0.0; n * cfg.o_width()];
                crate::mla::compact_heads(&mut o_in, atty, &crate::mla::MlaDims::of(cfg, n));
                matmul_forward(proj, &o_in, &w[bp.attn_proj_w.clone()], opt(&bp.attn_proj_b), n, cfg.o_width(), c);
            } else {
                matmul_forward(proj, atty, &w[bp.attn_proj_w.clone()], opt(&bp.attn_proj_b), n, cfg.attn_width(), c);
            }
            residual_forward(res, x, post_norm(&ops, (ln, mean, rstd), proj, &bp.post_1_w, w));
            let m_in = pre_norm(&ops, (ln, mean, rstd), res, (&bp.ln_2_w, &bp.ln_2_b), w);
            if let (Some(mp), Some(cache)) = (&bp.moe, s.moe.as_mut()) {
                let dims = cfg.moe_dims(n);
                let inp = tensor::moe::MoeInputs { x: m_in, router_w: &w[mp.router.clone()], experts_w: &w[mp.experts.clone()], shared_w: &w[mp.shared.clone()], router_bias: &w[mp.router_bias.clone()] };
                tensor::moe::moe_forward(proj, cache, inp, &dims, tensor::moe::MoeLossWeights::default(), None);
            } else {
                let (fch, fch_gelu) = (&mut s.fch[..n * fw], &mut s.fch_gelu[..n * f]);
                matmul_forward(fch, m_in, &w[bp.c_fc_w.clone()], opt(&bp.c_fc_b), n, c, fw);
                ops.act_forward(fch_gelu, fch);
                matmul_forward(proj, fch_gelu, &w[bp.mlp_proj_w.clone()], opt(&bp.mlp_proj_b), n, f, c);
            }
            residual_forward(x, res, post_norm(&ops, (ln, mean, rstd), proj, &bp.post_2_w, w));
        }
        ops.norm_forward(ln, mean, rstd, x, &w[pv.ln_f_w.clone()], opt(&pv.ln_f_b));
        matmul_forward(&mut s.logits[..n * vp], ln, &w[pv.lm_head.clone()], None, n, c, vp);
        tensor::classifier::softcap_logits(&mut s.logits[..n * vp], cfg.final_softcap);
        for &r in rows {
            caches[r].len += 1;
        }
    }

    /// Latent attention's step at layer `l` over the compressed cache: each row's normed latent
    /// (`kvn`, `[rows, KVR]`) and rotated shared key (its k's first head, after RoPE) appended at
    /// position `dims.t − 1`, then every cached position's keys and values up-projected by
    /// `kv_b_proj` (`kv_b`) and attended to, into the row's `atty`.
    fn attend_latent(&self, l: usize, (caches, rows): (&mut [KvCache], &[usize]), (qkv, atty): (&[f32], &mut [f32]), (kv_b, kvn): (&[f32], &[f32]), dims: &GqaDims) {
        let cfg = &self.cfg;
        let (kvr, rot, t) = (cfg.kv_lora_rank, cfg.rotary_dim, dims.t);
        let (lw, qw, qc) = (kvr + rot, cfg.qkv_width(), cfg.attn_width());
        let base = l * cfg.block_size * lw;
        for (i, &r) in rows.iter().enumerate() {
            let (q, cache) = (&qkv[i * qw..(i + 1) * qw], &mut caches[r]);
            let at = base + (t - 1) * lw;
            cache.k[at..at + kvr].copy_from_slice(&kvn[i * kvr..(i + 1) * kvr]);
            cache.k[at + kvr..at + lw].copy_from_slice(&q[qc..qc + rot]);
            let (kc, vc) = crate::mla::expand_cache(&cache.k[base..base + t * lw], kv_b, &crate::mla::MlaDims::of(cfg, t));
            attention_decode(&mut atty[i * qc..(i + 1) * qc], &q[..qc], &kc, &vc, dims);
        }
    }

    /// Completions of one prompt by samplers `samplers` (one each), decoded together
    /// ([`Gpt::generate_groups`] of one group).
    pub fn generate_group(&self, prompt: &[u32], max_new: usize, samplers: &[Sampler], stop: &mut dyn FnMut(usize, &[u32]) -> bool) -> Vec<Vec<u32>> {
        self.generate_groups(&[prompt], max_new, samplers, stop)
    }

    /// Completions of prompts of one length, `samplers.len() / prompts.len()` of each (row `i`
    /// continues prompt `i / G`), decoded together: each prompt fed once, its keys and values
    /// copied to its completions, then each step's tokens of the completions still running fed
    /// as rows of one batch. Each stops after `max_new` tokens, a stop id, or once `stop(i, its
    /// tokens)` says so. The prompts and completions fit the model's positions (no cache crop).
    /// Returns each completion's new tokens.
    pub fn generate_groups(&self, prompts: &[&[u32]], max_new: usize, samplers: &[Sampler], stop: &mut dyn FnMut(usize, &[u32]) -> bool) -> Vec<Vec<u32>> {
        let (n, vp, real) = (samplers.len(), self.cfg.vocab_size, self.real_vocab);
        let len = prompts[0].len();
        assert!(n.is_multiple_of(prompts.len()) && prompts.iter().all(|p| p.len() == len), "whole groups of prompts of one length");
        assert!(len > 0 && len + max_new <= self.cfg.block_size, "the prompts and completions fit the model's positions");
        let g = n / prompts.len();
        let mut s = self.scratch_1();
        let mut caches = Vec::with_capacity(n);
        let mut logits_of = Vec::with_capacity(n);
        for prompt in prompts {
            let mut first = self.new_cache();
            for &token in *prompt {
                self.decode_into(&mut first, token, len, &mut s);
            }
            for _ in 0..g {
                caches.push(KvCache { k: first.k.clone(), v: first.v.clone(), len: first.len });
                logits_of.push(s.logits[..vp].to_vec());
            }
        }
        let mut rngs: Vec<Rng> = samplers.iter().map(|x| Rng::new(x.seed)).collect();
        let mut seen: Vec<Vec<u32>> = (0..n).map(|i| prompts[i / g].to_vec()).collect();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut active: Vec<usize> = (0..n).collect();
        let mut s = self.scratch_n(n);
        while !active.is_empty() {
            let mut fed = Vec::with_capacity(active.len());
            for &i in &active {
                let logits = &mut logits_of[i][..real];
                if samplers[i].repetition_penalty != 1.0 {
                    penalize(logits, &mut seen[i], samplers[i].repetition_penalty);
                }
                let next = sample(logits, &samplers[i], &mut rngs[i]);
                out[i].push(next);
                seen[i].push(next);
                let done = out[i].len() == max_new || samplers[i].stop_ids.contains(&next) || stop(i, &out[i]);
                if !done {
                    fed.push((i, next));
                }
            }
            active = fed.iter().map(|&(i, _)| i).collect();
            if active.is_empty() {
                break;
            }
            let tokens: Vec<u32> = fed.iter().map(|&(_, t)| t).collect();
            let pass = caches[active[0]].len + 1;
            self.decode_rows(&mut caches, (&active, &tokens), pass, &mut s);
            for (k, &i) in active.iter().enumerate() {
                logits_of[i].copy_from_slice(&s.logits[k * vp..(k + 1) * vp]);
            }
        }
        out
    }

    /// Continues `prompt` by `max_new` tokens. Returns only the new tokens. Deterministic in
    /// `sampler.seed`.
    pub fn generate(&self, prompt: &[u32], max_new: usize, sampler: &Sampler) -> Vec<u32> {
        self.generate_until(prompt, max_new, sampler, &mut |_| false)
    }

    /// [`Gpt::generate`], stopping early once `stop(new tokens so far)` says so (a stop string).
    pub fn generate_until(&self, prompt: &[u32], max_new: usize, sampler: &Sampler, stop: &mut dyn FnMut(&[u32]) -> bool) -> Vec<u32> {
        let mut cache = self.new_cache();
        let mut s = self.scratch_1();
        let (bs, real_vocab) = (self.cfg.block_size, self.real_vocab);
        sampling_loop(prompt, max_new, (sampler, stop), (bs, real_vocab), |feed| {
            match feed {
                Feed::Reset => cache.len = 0,
                Feed::Token { token, pass } => {
                    let pass = pass.unwrap_or(cache.len + 1);
                    self.decode_into(&mut cache, token, pass, &mut s);
                }
                Feed::Logits => return s.logits.clone(),
            }
            Vec::new()
        })
    }
}

/// A reply's early end: called with the new tokens so far (a stop string's check).
pub type StopFn<'a> = &'a mut dyn FnMut(&[u32]) -> bool;

/// What [`sampling_loop`] asks of a decoder.
pub enum Feed {
    /// Empty the KV cache.
    Reset,
    /// Feed one token; `pass` is the length of the pass it belongs to (`None`: a generated
    /// token's, its position + 1).
    Token { token: u32, pass: Option<usize> },
    /// The logits of the last token fed.
    Logits,
}

/// The sampling loop every decoder shares (the CPU model's and the device's): the prompt (its
/// last `block_size` tokens) fed whole, then each sampled token; when the cache fills
/// `block_size`, it is rebuilt from the last half-context (as nanoGPT crops). Stops after a
/// stop id or once `stop` says so. Returns the new tokens.
pub fn sampling_loop(prompt: &[u32], max_new: usize, (sampler, stop): (&Sampler, StopFn), (bs, real_vocab): (usize, usize), mut decoder: impl FnMut(Feed) -> Vec<f32>) -> Vec<u32> {
    let mut rng = Rng::new(sampler.seed);
    let mut ctx: Vec<u32> = if prompt.is_empty() { vec![0] } else { prompt.to_vec() };
    if ctx.len() > bs {
        ctx.drain(..ctx.len() - bs);
    }
    let (mut len, n) = (0, ctx.len());
    for &token in &ctx {
        decoder(Feed::Token { token, pass: Some(n) });
        len += 1;
    }
    let mut out = Vec::with_capacity(max_new);
    let mut seen: Vec<u32> = prompt.to_vec();
    for i in 0..max_new {
        let mut logits = decoder(Feed::Logits);
        let logits = &mut logits[..real_vocab];
        if sampler.repetition_penalty != 1.0 {
            penalize(logits, &mut seen, sampler.repetition_penalty);
        }
        let next = sample(logits, sampler, &mut rng);
        out.push(next);
        ctx.push(next);
        seen.push(next);
        if i + 1 == max_new || sampler.stop_ids.contains(&next) || stop(&out) {
            break;
        }
        if len == bs {
            // Rebuild the cache from the last half-context.
            let keep = bs / 2;
            let start = ctx.len() - keep;
            decoder(Feed::Reset);
            len = 0;
            for &token in ctx.iter().take(ctx.len() - 1).skip(start) {
                decoder(Feed::Token { token, pass: Some(keep - 1) });
                len += 1;
            }
        }
        decoder(Feed::Token { token: next, pass: None });
        len += 1;
    }
    out
}

/// The repetition penalty on every token in `seen` (each once; `seen` is sorted and deduplicated
/// here): transformers' `RepetitionPenaltyLogitsProcessor`.
fn penalize(logits: &mut [f32], seen: &mut Vec<u32>, penalty: f32) {
    seen.sort_unstable();
    seen.dedup();
    for &t in seen.iter() {
        if let Some(x) = logits.get_mut(t as usize) {
            *x = if *x > 0.0 { *x / penalty } else { *x * penalty };
        }
    }
}

/// Draws a token id from `logits` (temperature, then top-k, then top-p, then softmax).
pub fn sample(logits: &[f32], sampler: &Sampler, rng: &mut Rng) -> u32 {
    if sampler.temperature <= 0.0 {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        return best as u32;
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    if sampler.top_k > 0 && sampler.top_k < logits.len() {
        // Stable order: by logit descending, then by id.
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        idx.truncate(sampler.top_k);
    }
    let max = idx.iter().map(|&i| logits[i]).fold(f32::NEG_INFINITY, f32::max);
    let mut weights: Vec<f64> = idx.iter().map(|&i| (((logits[i] - max) / sampler.temperature) as f64).exp()).collect();
    if sampler.top_p < 1.0 {
        // Nucleus: the most likely tokens (ties by id) until their mass reaches top_p.
        let mut order: Vec<usize> = (0..idx.len()).collect();
        order.sort_by(|&a, &b| weights[b].total_cmp(&weights[a]).then(idx[a].cmp(&idx[b])));
        let total: f64 = weights.iter().sum();
        let (mut mass, mut keep) = (0.0, Vec::new());
        for k in order {
            keep.push(k);
            mass += weights[k] / total;
            if mass >= sampler.top_p as f64 {
                break;
            }
        }
        keep.sort_unstable();
        idx = keep.iter().map(|&k| idx[k]).collect();
        weights = keep.iter().map(|&k| weights[k]).collect();
    }
    let total: f64 = weights.iter().sum();
    let mut r = rng.uniform() * total;
    for (k, &wt) in weights.iter().enumerate() {
        r -= wt;
        if r <= 0.0 {
            return idx[k] as u32;
        }
    }
    *idx.last().unwrap() as u32
}

/// A decoding step's norm before a branch: `x` normed into `ln` (statistics beside it), or `x`
/// itself when the block has none there (an empty weight range).
fn pre_norm<'x>(ops: &Ops, (ln, mean, rstd): (&'x mut [f32], &mut [f32], &mut [f32]), x: &'x [f32], (wr, br): (&std::ops::Range<usize>, &Option<std::ops::Range<usize>>), w: &[f32]) -> &'x [f32] {
    if wr.is_empty() {
        return x;
    }
    ops.norm_forward(ln, mean, rstd, x, &w[wr.clone()], br.as_ref().map(|r| &w[r.clone()]));
    ln
}

/// A decoding step's norm after a branch: its output `y` normed into `ln`, or `y` itself
/// without one.
fn post_norm<'x>(ops: &Ops, (ln, mean, rstd): (&'x mut [f32], &mut [f32], &mut [f32]), y: &'x [f32], wr: &Option<std::ops::Range<usize>>, w: &[f32]) -> &'x [f32] {
    let Some(wr) = wr else { return y };
    ops.norm_forward(ln, mean, rstd, y, &w[wr.clone()], None);
    ln
}
