//! GRPO's parts outside the step: the prompts, the rollouts (each step's prompts, `G` sampled
//! completions each through the KV-cached sampler, their rewards and group-relative
//! advantages), the rows the step trains on, and the held-out reward.
//!
//! Everything a step draws is a function of the seed and the step: prompt `k` of the step is
//! prompt `order[(step / μ · P + k) mod n]` of a seeded order per epoch, and completion `g`
//! samples from seed `(seed, step / μ, k, g)`. A batch of completions serves `μ` optimiser
//! steps (`grpo.iterations`); its sampling-time log-probabilities are measured before the first.

use super::data::TrainData;
use crate::config::RunConfig;
use crate::error::{user, KilnError, Result};
use crate::reward::{Rewards, Scored};
use crate::step::RowBuf;
use data::{Doc, DocFormat, DocOpts, Tokenizer};
use model::gpt::IGNORE_INDEX;
use model::{Gpt, Pass};
use serde_json::Value;
use std::path::PathBuf;
use tensor::rng::mix64;

/// One prompt: its tokens, its row (the rewards read its fields) and its reference answer.
#[derive(Clone, Debug)]
pub struct Task {
    pub ids: Vec<u32>,
    pub prompt: String,
    pub answer: String,
}

/// The run's prompts: the training ones and the held-out ones (the last `data.val_fraction`).
#[derive(Clone, Debug, Default)]
pub struct Prompts {
    pub train: Vec<Task>,
    pub val: Vec<Task>,
}

/// Reads the prompt rows of `paths` and tokenizes their prompts with `tokenizer` (given, or made
/// from `spec` over the prompts and answers: a `char` vocabulary).
pub fn load_prompts(cfg: &RunConfig, tokenizer: Option<Tokenizer>) -> Result<(Prompts, Tokenizer, Vec<PathBuf>)> {
    let paths: Vec<PathBuf> = cfg.data.paths.iter().map(PathBuf::from).collect();
    if paths.is_empty() {
        return user("train.objective = \"grpo\" needs --data: jsonl or parquet rows of prompts with their answers");
    }
    let opts = DocOpts { text_field: "prompt".into(), format: DocFormat::Prompt };
    let field = &cfg.grpo.answer_field;
    let mut rows: Vec<(Value, String)> = Vec::new();
    for p in &paths {
        let read = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut line = 0;
        data::read_docs(p, &opts, &read, &mut |docs| {
            for d in docs {
                line += 1;
                let Doc::Prompt(row) = d else { unreachable!("prompt rows") };
                let answer = match row.get(field) {
                    Some(Value::String(s)) => s.clone(),
                    Some(v @ Value::Number(_)) => v.to_string(),
                    Some(v) => return Err(data::DataError::at(p, format!("row {line}: field `{field}` is {v}, not a string or a number"))),
                    None => return Err(data::DataError::at(p, format!("row {line}: no field `{field}` (grpo.answer_field): the rewards compare completions with it"))),
                };
                rows.push((row, answer));
            }
            Ok(())
        })?;
    }
    if rows.len() < 2 {
        return user(format!("{}: {} prompt rows; GRPO needs some to train on and some held out", cfg.data.paths.join(", "), rows.len()));
    }
    let tok = match tokenizer {
        Some(t) => t,
        None => {
            let corpus: String = rows.iter().map(|(r, a)| format!("{}{a}\n", Doc::Prompt(r.clone()).text())).collect::<String>() + &cfg.grpo.stop.concat();
            Tokenizer::from_spec(&cfg.data.tokenizer, Some(&corpus))?
        }
    };
    let mut tasks = Vec::with_capacity(rows.len());
    for (i, (row, answer)) in rows.into_iter().enumerate() {
        let ids = tok.encode_prompt(&row["prompt"]).map_err(|e| KilnError::User(format!("prompt row {}: {e}", i + 1)))?;
        if ids.len() >= cfg.model.block_size {
            return user(format!("prompt row {}: {} tokens leave no room to complete within model.block_size = {}", i + 1, ids.len(), cfg.model.block_size));
        }
        tasks.push(Task { ids, prompt: Doc::Prompt(row).text(), answer });
    }
    let held = ((tasks.len() as f64 * cfg.data.val_fraction).ceil() as usize).clamp(1, tasks.len() - 1);
    let val = tasks.split_off(tasks.len() - held);
    Ok((Prompts { train: tasks, val }, tok, paths))
}

/// A batch of completions and what the step reads of them.
#[derive(Clone, Debug, Default)]
pub struct Rollout {
    /// The step that sampled it (the first of its `μ`).
    pub step: u64,
    /// Per completion: its prompt's tokens then its own, and the prompt's length; its advantage.
    pub rows: Vec<(Vec<u32>, usize)>,
    pub advantages: Vec<f64>,
    /// Each position's log-probability when sampled (`[rows, T]`; empty with `μ` = 1), and
    /// under the reference model (empty without a KL term).
    pub old_logps: Vec<f32>,
    pub ref_logps: Vec<f32>,
    /// The figures of the batch: mean reward, the mean standard deviation within groups, each
    /// reward's mean, completion lengths (mean, max), sampling tokens/s.
    pub figures: serde_json::Map<String, Value>,
}

/// The sampler of completion `g` of prompt `k` of the batch of `step`.
fn sampler(cfg: &RunConfig, tok: &Tokenizer, (step, k, g): (u64, usize, usize)) -> model::Sampler {
    let seed = mix64(cfg.train.seed ^ mix64(step.wrapping_mul(0x9E37_79B9) ^ ((k as u64) << 20) ^ g as u64 ^ 0x6a09_e667));
    let c = &cfg.grpo;
    model::Sampler { top_p: c.top_p as f32, stop_ids: tok.eos_id().into_iter().collect(), ..model::Sampler::new(c.temperature as f32, c.top_k, seed) }
}

/// The prompts of the batch of `step`: `count` of the training prompts in a seeded order per
/// epoch (each epoch's order shuffled once).
fn batch_prompts(cfg: &RunConfig, n: usize, step: u64, count: usize) -> Vec<usize> {
    let first = step * count as u64;
    let mut order: (u64, Vec<usize>) = (u64::MAX, Vec::new());
    (0..count as u64)
        .map(|k| {
            let at = first + k;
            let (epoch, i) = (at / n as u64, (at % n as u64) as usize);
            if order.0 != epoch {
                let mut o: Vec<usize> = (0..n).collect();
                let mut r = tensor::Rng::new(mix64(cfg.train.seed ^ mix64(epoch ^ 0x9f4a_7c15)));
                for j in (1..n).rev() {
                    o.swap(j, r.below(j as u64 + 1) as usize);
                }
                order = (epoch, o);
            }
            order.1[i]
        })
        .collect()
}

/// A data-parallel rank's share of a step's completions: rank `rank` of `ranks` holds `rows` of
/// each micro-batch (whole groups), so group `k` (rows `k·G ..`) is the rank's whose rows those
/// are; `gather` all-gathers a figure vector over the ranks (rank order).
pub struct Share<'g> {
    pub rank: usize,
    pub ranks: usize,
    pub rows: usize,
    pub gather: Gather<'g>,
}

/// An all-gather of figures over the data-parallel ranks.
pub type Gather<'g> = &'g mut dyn FnMut(&[f64]) -> Vec<f64>;

/// Samples this rank's share of the batch of completions the steps from `step` train on (the
/// groups of prompts of one length decoded together), and scores them.
pub fn rollout(model: &Gpt, cfg: &RunConfig, ds: &TrainData, rewards: &Rewards, (step, share): (u64, Share)) -> Result<Rollout> {
    let prompts = ds.prompts.as_ref().expect("a GRPO run's prompts");
    let (g, p) = (cfg.grpo.group, cfg.train.batch_size / cfg.grpo.group);
    let block = step / cfg.grpo.iterations as u64;
    let mb = share.rows * share.ranks;
    // This rank's groups: the prompts' indices in the step, and which prompt each is.
    let mine: Vec<(usize, usize)> = batch_prompts(cfg, prompts.train.len(), block, p).into_iter().enumerate().filter(|(k, _)| (k * g % mb) / share.rows == share.rank).collect();
    let t0 = std::time::Instant::now();
    let mut rows = Vec::with_capacity(mine.len() * g);
    let mut texts = Vec::with_capacity(mine.len() * g);
    let ids: Vec<&[u32]> = mine.iter().map(|&(_, i)| &prompts.train[i].ids[..]).collect();
    let samplers: Vec<model::Sampler> = mine.iter().flat_map(|&(k, _)| (0..g).map(move |j| (k, j))).map(|(k, j)| sampler(cfg, &ds.tokenizer, (block, k, j))).collect();
    let outs: Vec<Vec<Vec<u32>>> = decode_together(model, cfg, &ds.tokenizer, &ids, &samplers).chunks(g).map(|c| c.to_vec()).collect();
    for (&(_, i), group) in mine.iter().zip(outs) {
        let task = &prompts.train[i];
        for out in group {
            texts.push(ds.tokenizer.decode(&out));
            rows.push(([&task.ids[..], &out[..]].concat(), task.ids.len()));
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let items: Vec<Scored> = texts.iter().enumerate().map(|(n, c)| {
        let task = &prompts.train[mine[n / g].1];
        Scored { prompt: &task.prompt, completion: c, answer: &task.answer }
    }).collect();
    let each = rewards.each(&items)?;
    let total = rewards.total(&each);
    let advantages = tensor::grpo::group_advantages(&total, g, cfg.grpo.loss.scales_rewards());
    let figures = figures(rewards, (&total, &each), &rows, g, (secs, share.gather));
    Ok(Rollout { step: block * cfg.grpo.iterations as u64, rows, advantages, old_logps: Vec::new(), ref_logps: Vec::new(), figures })
}

/// The batch's figures over every rank's completions: the mean reward, the mean standard
/// deviation within groups, each reward's mean, completion lengths (mean, max) and the sampling
/// speed (tokens over the slowest rank's seconds).
fn figures(rewards: &Rewards, (total, each): (&[f64], &[Vec<f64>]), rows: &[(Vec<u32>, usize)], g: usize, (secs, gather): (f64, Gather)) -> serde_json::Map<String, Value> {
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let std_sum: f64 = total.chunks(g).map(|c| {
        let m = mean(c);
        (c.iter().map(|r| (r - m).powi(2)).sum::<f64>() / (c.len() - 1).max(1) as f64).sqrt()
    }).sum();
    let lens: Vec<f64> = rows.iter().map(|(r, n)| (r.len() - n) as f64).collect();
    // Per rank: completions, groups, reward sum, std sum, length sum, length max, seconds, then
    // each reward's sum.
    let mut mine = vec![total.len() as f64, (total.len() / g) as f64, total.iter().sum(), std_sum, lens.iter().sum(), lens.iter().copied().fold(0.0, f64::max), secs];
    mine.extend(each.iter().map(|e| e.iter().sum::<f64>()));
    let all = gather(&mine);
    let w = mine.len();
    let sum = |i: usize| all.chunks(w).map(|r| r[i]).sum::<f64>();
    let max = |i: usize| all.chunks(w).map(|r| r[i]).fold(0.0, f64::max);
    let (n, groups) = (sum(0).max(1.0), sum(1).max(1.0));
    let mut f = serde_json::Map::new();
    f.insert("reward".into(), (sum(2) / n).into());
    f.insert("reward_std".into(), (sum(3) / groups).into());
    for (k, (name, _, _)) in rewards.list.iter().enumerate() {
        f.insert(format!("reward_{}", name.split(':').next().unwrap_or(name)), (sum(7 + k) / n).into());
    }
    f.insert("completion_length".into(), (sum(4) / n).into());
    f.insert("completion_length_max".into(), max(5).into());
    f.insert("rollout_tokens_per_sec".into(), (sum(4) / max(6).max(1e-9)).into());
    f
}

/// Completions of `prompts` by `samplers` (`samplers.len() / prompts.len()` a prompt, row `i`
/// of prompt `i / G`), the prompts of one length decoded together (`Gpt::generate_groups`), at
/// most `grpo.max_new_tokens` tokens each and what the positions leave, stopping at the EOS or a
/// stop string. Prompt-major, as the samplers.
fn decode_together(model: &Gpt, cfg: &RunConfig, tok: &Tokenizer, prompts: &[&[u32]], samplers: &[model::Sampler]) -> Vec<Vec<u32>> {
    let g = samplers.len() / prompts.len().max(1);
    let stops = &cfg.grpo.stop;
    let mut outs: Vec<Vec<u32>> = vec![Vec::new(); samplers.len()];
    let mut lengths: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
    lengths.sort_unstable();
    lengths.dedup();
    for len in lengths {
        let bucket: Vec<usize> = (0..prompts.len()).filter(|&b| prompts[b].len() == len).collect();
        let ids: Vec<&[u32]> = bucket.iter().map(|&b| prompts[b]).collect();
        let rows: Vec<model::Sampler> = bucket.iter().flat_map(|&b| samplers[b * g..(b + 1) * g].iter().cloned()).collect();
        let room = cfg.seq_len().saturating_sub(len).min(cfg.grpo.max_new_tokens);
        let done = model.generate_groups(&ids, room, &rows, &mut |_, out| !stops.is_empty() && stops.iter().any(|s| tok.decode(out).contains(s.as_str())));
        for (b, chunk) in bucket.iter().zip(done.chunks(g)) {
            outs[b * g..(b + 1) * g].clone_from_slice(chunk);
        }
    }
    outs
}

/// Writes completions `rows` of `r` into `buf` (rows of `t`): inputs, targets on the completion
/// only, and their advantages and sampling-time log-probabilities.
pub fn fill(r: &Rollout, rows: std::ops::Range<usize>, t: usize, buf: &mut RowBuf) {
    buf.advantages = r.advantages[rows.clone()].to_vec();
    if !r.old_logps.is_empty() {
        buf.old_logps = r.old_logps[rows.start * t..rows.end * t].to_vec();
    }
    if !r.ref_logps.is_empty() {
        buf.ref_logps = r.ref_logps[rows.start * t..rows.end * t].to_vec();
    }
    for (i, k) in rows.enumerate() {
        let (seq, plen) = &r.rows[k];
        let (x, y) = (&mut buf.x[i * t..(i + 1) * t], &mut buf.y[i * t..(i + 1) * t]);
        x.fill(0);
        y.fill(IGNORE_INDEX);
        let n = seq.len().min(t);
        x[..n].copy_from_slice(&seq[..n]);
        for j in 0..n.saturating_sub(1) {
            if j + 1 >= *plen {
                y[j] = seq[j + 1] as i32;
            }
        }
    }
}

/// Every position's log-probability under `model` (eval mode) for the rows of `r`, `batch` rows
/// at a time: `[rows, T]`, 0 where no target counts.
pub fn logps(model: &mut Gpt, r: &Rollout, t: usize, batch: usize) -> Vec<f32> {
    let n = r.rows.len();
    let mut out = vec![0.0; n * t];
    for first in (0..n).step_by(batch) {
        let rows = first..(first + batch).min(n);
        let mut b = RowBuf::new(batch, t, false);
        fill(&Rollout { old_logps: Vec::new(), ref_logps: Vec::new(), ..r.clone() }, rows.clone(), t, &mut b);
        model.forward(&b.x, &b.y, batch, t, Pass::Eval);
        for (i, &l) in model.losses()[..rows.len() * t].iter().enumerate() {
            out[first * t + i] = -l;
        }
    }
    out
}

/// The held-out reward: each of (up to `grpo.eval_prompts`) held-out prompts completed greedily
/// and scored; returns the mean reward and the fraction of completions the `exact`-style
/// rewards (the first reward) count right.
pub fn held_out_reward(model: &Gpt, cfg: &RunConfig, ds: &TrainData, rewards: &Rewards) -> Result<(f64, f64)> {
    let prompts = ds.prompts.as_ref().expect("a GRPO run's prompts");
    let n = if cfg.grpo.eval_prompts == 0 { prompts.val.len() } else { cfg.grpo.eval_prompts.min(prompts.val.len()) };
    let greedy = model::Sampler { stop_ids: ds.tokenizer.eos_id().into_iter().collect(), ..model::Sampler::new(0.0, 0, cfg.train.seed) };
    // As many prompts at once as a step's rollout on a rank decodes (what the memory plan counts).
    let at_once = (cfg.train.batch_size / cfg.parallel.dp.max(1)).max(1);
    let mut texts = Vec::with_capacity(n);
    for part in prompts.val[..n].chunks(at_once) {
        let ids: Vec<&[u32]> = part.iter().map(|t| &t.ids[..]).collect();
        let samplers = vec![greedy.clone(); part.len()];
        texts.extend(decode_together(model, cfg, &ds.tokenizer, &ids, &samplers).iter().map(|out| ds.tokenizer.decode(out)));
    }
    let items: Vec<Scored> = texts.iter().zip(&prompts.val[..n]).map(|(c, task)| Scored { prompt: &task.prompt, completion: c, answer: &task.answer }).collect();
    let each = rewards.each(&items)?;
    let total = rewards.total(&each);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    Ok((mean(&total), mean(&each[0])))
}

/// The model a run started from, whole, as its first step saw it (rounded to the storage
/// precision): GRPO's reference when a resumed run needs it again.
pub fn initial_model(cfg: &RunConfig, ds: &TrainData, real_vocab: usize) -> Result<Gpt> {
    let mut m = if cfg.model.init_from.is_empty() {
        Gpt::new(cfg.gpt_config(ds.tokenizer.vocab_size()), real_vocab, cfg.train.seed)
    } else {
        let mut m = crate::run::load_base(std::path::Path::new(&cfg.model.init_from))?;
        m.real_vocab = real_vocab;
        m
    };
    if let Some(fmt) = model::gpt::storage(cfg.train.precision) {
        tensor::precision::round_slice(&mut m.params, fmt);
    }
    m.cfg.dropout = 0.0;
    Ok(m)
}
