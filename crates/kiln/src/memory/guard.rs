//! Refusing before allocating: every command that builds a model first compares what
//! it will hold with the memory this process may use — `memory.limit` when set, else the
//! machine's available memory or the cgroup's remaining allowance, whichever is smaller — and
//! exits 2 with both figures. Sizes are multiplied in u128 here, from the config alone
//! (`GptConfig::param_count`), so an absurd config is refused before a layout, a buffer or a
//! plan is built from it.

use crate::error::{user, Result};
use crate::memory::fmt_bytes;
use model::GptConfig;
use std::path::Path;
use std::cell::Cell;

/// The memory a command may use, and where that figure comes from.
#[derive(Clone, Debug)]
pub struct Budget {
    pub bytes: u64,
    pub source: String,
    /// `memory.limit` (per rank, as the plan counts) rather than the machine's figure (per process).
    pub explicit: bool,
}

thread_local! {
    /// A cap on every budget computed on this thread ([`cap`]; 0 = none).
    static CAP: Cell<u64> = const { Cell::new(0) };
}

/// Caps every later budget computed on this thread at `bytes` (the fuzz targets run under
/// 256 MiB).
pub fn cap(bytes: u64) {
    CAP.set(bytes);
}

impl Budget {
    /// `memory.limit` if nonzero, else what the machine has available now; at most [`cap`]'s.
    pub fn of(limit: u64) -> Budget {
        let mut b = if limit > 0 {
            Budget { bytes: limit, source: "memory.limit".into(), explicit: true }
        } else {
            let (bytes, source) = available();
            Budget { bytes, source, explicit: false }
        };
        let cap = CAP.get();
        if cap > 0 && cap < b.bytes {
            b.bytes = cap;
            b.source = "the cap set by guard::cap".into();
        }
        b
    }

    /// Refuses `what` when it needs more than this budget. `cause` names the keys (and their
    /// values) that make it so big.
    pub fn check(&self, what: &str, need: u128, cause: &str) -> Result<()> {
        if need <= self.bytes as u128 {
            return Ok(());
        }
        let hint = if self.explicit { "raise memory.limit (--memory-limit)" } else { "set memory.limit (--memory-limit) to plan for a larger machine" };
        user(format!("{what} needs {} ({cause}), more than the {} available ({}): refused before allocating; {hint}", fmt_big(need), fmt_bytes(self.bytes), self.source))
    }
}

/// Bytes too large for u64 still print (as EiB).
pub fn fmt_big(b: u128) -> String {
    const EIB: f64 = (1u64 << 60) as f64;
    if b > (1u128 << 60) { format!("{:.2} EiB", b as f64 / EIB) } else if b > (1u128 << 40) { format!("{:.2} TiB", b as f64 / (1u64 << 40) as f64) } else { fmt_bytes(b as u64) }
}

/// The memory this process can still get: the smaller of `MemAvailable` and, inside a cgroup
/// with a limit (v2 `memory.max`, v1 `memory.limit_in_bytes`), the limit minus the usage — for
/// the innermost limited group and each one above it.
pub fn available() -> (u64, String) {
    let mut best = (u64::MAX, "no limit known".to_string());
    if let Some(kb) = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| meminfo_available_kb(&s)) {
        best = (kb.saturating_mul(1024), "MemAvailable in /proc/meminfo".into());
    }
    for (limit, usage, file) in cgroup_limits() {
        let free = limit.saturating_sub(usage);
        if free < best.0 {
            best = (free, format!("cgroup limit {} in {file} less {} in use", fmt_bytes(limit), fmt_bytes(usage)));
        }
    }
    best
}

/// `MemAvailable` of a `/proc/meminfo` text, in KiB.
pub fn meminfo_available_kb(text: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix("MemAvailable:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// (limit, usage, limit file) of each cgroup enclosing this process that sets a memory limit.
fn cgroup_limits() -> Vec<(u64, u64, String)> {
    let mut out = Vec::new();
    let Ok(text) = std::fs::read_to_string("/proc/self/cgroup") else { return out };
    let read = |p: &Path| std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse::<u64>().ok());
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        // v2 (the unified hierarchy, empty controller list) or v1's memory controller.
        let (root, limit_file, usage_file) = if controllers.is_empty() {
            ("/sys/fs/cgroup", "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")
        } else {
            continue;
        };
        let mut dir = Path::new(root).join(path.trim_start_matches('/'));
        loop {
            // "max" (v2) or a huge number (v1: no limit) parse as none / are never the minimum.
            if let (Some(limit), Some(usage)) = (read(&dir.join(limit_file)), read(&dir.join(usage_file))) {
                out.push((limit, usage, dir.join(limit_file).display().to_string()));
            }
            if dir == Path::new(root) || !dir.pop() {
                break;
            }
        }
    }
    out
}

/// The shape keys behind a model's size, as `model.*` keys with their values.
pub fn shape_keys(g: &GptConfig) -> String {
    let mut s = format!("{:.3e} parameters: model.n_layer = {}, model.n_embd = {}, model.ffn_hidden = {}, model.vocab_size = {}", g.param_count() as f64, g.n_layer, g.n_embd, g.ffn_hidden, g.vocab_size);
    if g.n_expert > 0 {
        s.push_str(&format!(", model.n_expert = {}", g.n_expert));
    }
    s
}

/// The shape keys of a Hugging Face `config.json` that are present, with their values.
pub fn hf_shape_keys(g: &GptConfig, v: &serde_json::Value, file: &Path) -> String {
    const KEYS: &[&str] = &["num_hidden_layers", "n_layer", "hidden_size", "n_embd", "intermediate_size", "n_inner", "vocab_size", "num_local_experts", "max_position_embeddings", "n_positions"];
    let keys: Vec<String> = KEYS.iter().filter_map(|k| v.get(*k).map(|x| format!("{k} = {x}"))).collect();
    format!("{:.3e} parameters: {}: {}", g.param_count() as f64, file.display(), keys.join(", "))
}

/// What loading a Hugging Face base holds at most: its `weights` with one tensor's `scratch`
/// (read and widened) beside them, then, unless LoRA freezes it, its gradient buffers too.
pub fn load_bytes(weights: u128, scratch: u128, frozen: bool) -> u128 {
    match frozen {
        true => weights + scratch,
        false => (weights + scratch).max(2 * weights),
    }
}

/// The fp32 weights of the whole model and its rotary tables (`block_size × head width`, cos
/// and sin: a model's whole context, allocated with it): what any command that loads or builds
/// it holds at least.
pub fn weight_bytes(g: &GptConfig) -> u128 {
    let hs = if g.head_dim > 0 { g.head_dim } else { g.n_embd / g.n_head.max(1) };
    let rope = if g.arch == model::config::Arch::Llama { g.block_size as u128 * hs as u128 * 4 } else { 0 };
    g.param_count() * 4 + rope
}

/// Bytes of one batch's residual stream through every layer (`rows × T × C × L` fp32): the
/// least a training step keeps for backward whatever it recomputes.
pub fn activation_floor(g: &GptConfig, rows: usize, t: usize) -> u128 {
    rows as u128 * t as u128 * g.n_embd as u128 * g.n_layer as u128 * 4
}
