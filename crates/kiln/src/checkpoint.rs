//! Checkpoints: `checkpoints/step-NNNNNNNN/` holding
//! - `model.safetensors`: parameters by their HF names, whole whatever layout trained them
//!   (with several ranks, `model-RRRRR-of-NNNNN.safetensors` instead: rank r's slice
//!   `[r·len/n, (r+1)·len/n)` of every tensor, flattened — see [`save_part`]),
//! - `optimizer.safetensors`: AdamW moments as `exp_avg.NAME` / `exp_avg_sq.NAME` (or parts),
//! - `state.json`: step, RNG and data-cursor state, elapsed time, the resolved config,
//! - `tokenizer.json`,
//! - `manifest.json`: size and CRC-32 of every other file, and a CRC-32 of itself.
//!
//! Writing goes to a hidden temporary directory; every file and the directory are fsynced,
//! then the directory is renamed into place and the parent fsynced. A crash mid-write leaves
//! only a `.tmp-*` directory, which is never mistaken for a checkpoint. Loading verifies every
//! checksum; a checkpoint that fails is reported and skipped, never deleted or overwritten.

use crate::error::{io_err, user, KilnError, Result};
use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Trainer state beyond the tensors: everything needed for a bit-exact resume.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TrainState {
    /// Optimizer steps completed.
    pub step: u64,
    /// The batch sampler's RNG (the data cursor).
    pub sampler_rng: [u64; 4],
    pub tokens_seen: u64,
    pub elapsed_s: f64,
    /// The resolved config the run was made with (TOML).
    pub config: String,
    /// fp16's dynamic loss scale.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<crate::step::LossScaler>,
    /// fp8's amax histories (one per block matmul tensor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_amax: Option<Vec<Vec<f32>>>,
    /// The data loader's cursors (packed documents: where each source's stream stands).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loader: Option<LoaderState>,
}

/// Where a source's document stream stands: epoch, the next document of the epoch's order,
/// and how far into it (a document longer than a row is taken a row at a time).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    pub epoch: u64,
    pub next: u64,
    pub offset: u64,
}

/// The loader's state beyond the sampler's RNG (checkpointed): one cursor per source.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    pub cursors: Vec<Cursor>,
}

#[derive(Serialize, Deserialize)]
struct FileSum {
    bytes: u64,
    crc32: u32,
}

#[derive(Serialize, Deserialize)]
struct Manifest {
    /// 1: one `model.safetensors` and `optimizer.safetensors`; 2: sharded, `shards` parts
    /// `model-RRRRR-of-NNNNN.safetensors` / `optimizer-…`, part r holding elements
    /// `[r·len/n, (r+1)·len/n)` of every tensor (flattened), the tensors' whole shapes in
    /// `shapes`.
    format: u32,
    #[serde(default, skip_serializing_if = "is_zero")]
    shards: usize,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    shapes: BTreeMap<String, Vec<usize>>,
    files: BTreeMap<String, FileSum>,
    /// CRC-32 of this manifest serialized with `self_crc32 = 0`.
    self_crc32: u32,
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

/// Part `r` of `n` of a tensor of `len` elements.
pub fn part_range(len: usize, r: usize, n: usize) -> std::ops::Range<usize> {
    r * len / n..(r + 1) * len / n
}

fn part_name(kind: &str, r: usize, n: usize) -> String {
    format!("{kind}-{r:05}-of-{n:05}.safetensors")
}

pub struct Tensors<'a> {
    /// (name, shape, data) in layout order.
    pub items: Vec<(String, Vec<usize>, &'a [f32])>,
}

fn f32_bytes(x: &[f32]) -> &[u8] {
    // Safety: f32 has no padding or invalid bit patterns; the machine is little endian as
    // safetensors requires (checked at compile time below).
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}
#[cfg(not(target_endian = "little"))]
compile_error!("kiln's checkpoint format assumes a little-endian machine");

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = fs::File::create(path).map_err(|e| io_err(path, e))?;
    f.write_all(bytes).map_err(|e| io_err(path, e))?;
    f.sync_all().map_err(|e| io_err(path, e))?;
    Ok(())
}

fn sync_dir(path: &Path) -> Result<()> {
    fs::File::open(path).and_then(|f| f.sync_all()).map_err(|e| io_err(path, e))
}


/// Writes `t` as a safetensors file (tensors in the given order, f32), streaming, and syncs
/// it; returns its size and CRC-32. Written with direct I/O where the filesystem takes it
/// ([`DirectWriter`]), else through the page cache.
fn write_tensors(path: &Path, t: &Tensors) -> Result<(u64, u32)> {
    #[cfg(target_os = "linux")]
    match DirectWriter::create(path) {
        Ok(mut w) => match encode_tensors(&mut w, t).and_then(|r| w.finish().map(|()| r)) {
            Ok(r) => return Ok(r),
            // EINVAL: this file system refuses some direct write after all; start over below.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(io_err(path, e)),
        },
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        Err(e) => return Err(io_err(path, e)),
    }
    let f = fs::File::create(path).map_err(|e| io_err(path, e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 22, f);
    let r = encode_tensors(&mut w, t).map_err(|e| io_err(path, e))?;
    let f = w.into_inner().map_err(|e| io_err(path, e.into_error()))?;
    f.sync_all().map_err(|e| io_err(path, e))?;
    Ok(r)
}

/// A file written with `O_DIRECT` through a page-aligned staging buffer: the data goes from
/// that buffer to the device, bypassing the page cache. Buffered, a 1.5 GB checkpoint costs
/// this machine ~3.8 s of kernel CPU (copying into the cache, then writeback and reclaim by
/// kernel threads at normal priority, which take the cores from training); direct, ~0.1 s,
/// and what is left (filling the staging buffer) runs on the writer's idle-priority thread.
#[cfg(target_os = "linux")]
struct DirectWriter {
    f: fs::File,
    buf: *mut u8,
    fill: usize,
    /// File offset of `buf[0]`.
    off: u64,
}

#[cfg(target_os = "linux")]
impl DirectWriter {
    /// Staging size and alignment (of memory, file offsets and lengths: the file system block).
    const CAP: usize = 1 << 22;
    const ALIGN: usize = 4096;

    fn layout() -> std::alloc::Layout {
        std::alloc::Layout::from_size_align(Self::CAP, Self::ALIGN).unwrap()
    }

    fn create(path: &Path) -> std::io::Result<DirectWriter> {
        use std::os::unix::fs::OpenOptionsExt;
        let f = fs::OpenOptions::new().write(true).create(true).truncate(true).custom_flags(libc::O_DIRECT).open(path)?;
        // SAFETY: a non-zero size; freed in Drop with the same layout.
        let buf = unsafe { std::alloc::alloc(Self::layout()) };
        if buf.is_null() {
            std::alloc::handle_alloc_error(Self::layout());
        }
        Ok(DirectWriter { f, buf, fill: 0, off: 0 })
    }

    /// Writes the first `len` staged bytes (a multiple of ALIGN) at the current offset.
    fn put(&mut self, len: usize) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        // SAFETY: `buf` holds CAP initialised-or-written bytes; len <= CAP.
        let b = unsafe { std::slice::from_raw_parts(self.buf, len) };
        self.f.write_all_at(b, self.off)?;
        self.off += len as u64;
        Ok(())
    }

    /// Writes what is staged (the last block zero-padded), cuts the file to its length, syncs.
    fn finish(&mut self) -> std::io::Result<()> {
        let len = self.off + self.fill as u64;
        if self.fill > 0 {
            let padded = self.fill.div_ceil(Self::ALIGN) * Self::ALIGN;
            // SAFETY: padded <= CAP.
            unsafe { std::ptr::write_bytes(self.buf.add(self.fill), 0, padded - self.fill) };
            self.put(padded)?;
            self.fill = 0;
        }
        self.f.set_len(len)?;
        self.f.sync_all()
    }
}

#[cfg(target_os = "linux")]
impl Write for DirectWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let n = data.len().min(Self::CAP - self.fill);
        // SAFETY: fill + n <= CAP; `data` cannot overlap our private buffer.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.buf.add(self.fill), n) };
        self.fill += n;
        if self.fill == Self::CAP {
            self.put(Self::CAP)?;
            self.fill = 0;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(target_os = "linux")]
impl Drop for DirectWriter {
    fn drop(&mut self) {
        // SAFETY: allocated in `create` with this layout.
        unsafe { std::alloc::dealloc(self.buf, Self::layout()) };
    }
}

/// The safetensors encoding of `t` into `w`; returns (bytes, CRC-32).
fn encode_tensors(w: &mut impl Write, t: &Tensors) -> std::io::Result<(u64, u32)> {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (name, shape, data) in &t.items {
        let n = data.len() * 4;
        header.insert(name.clone(), serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}));
        off += n;
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).expect("header serializes");
    // The data section starts 8-byte aligned, as safetensors writes it.
    while !(8 + h.len()).is_multiple_of(8) {
        h.push(b' ');
    }
    let mut crc = crc32fast::Hasher::new();
    let mut put = |b: &[u8]| -> std::io::Result<()> {
        crc.update(b);
        w.write_all(b)
    };
    put(&(h.len() as u64).to_le_bytes())?;
    put(&h)?;
    for (_, _, data) in &t.items {
        for chunk in data.chunks(1 << 20) {
            put(f32_bytes(chunk))?;
        }
    }
    Ok(((8 + h.len() + off) as u64, crc.finalize()))
}

/// Name of the checkpoint directory for `step` under `dir`, avoiding any existing entry (a
/// corrupt checkpoint of the same step is kept as it is: the new one gets a suffix).
fn fresh_name(dir: &Path, step: u64) -> PathBuf {
    let base = format!("step-{step:08}");
    let mut p = dir.join(&base);
    let mut k = 1;
    while p.exists() {
        p = dir.join(format!("{base}.{k}"));
        k += 1;
    }
    p
}

/// Debug (`faults.kill_in_write_step`): the step whose checkpoint write kills this process
/// with SIGKILL halfway (its tensor files written, no manifest yet), once per run: the marker
/// file is created first.
pub static KILL_IN_WRITE: std::sync::Mutex<Option<(u64, PathBuf)>> = std::sync::Mutex::new(None);

fn crash_point(step: u64) {
    let armed = KILL_IN_WRITE.lock().unwrap().clone();
    if let Some((s, marker)) = armed.filter(|(s, _)| *s == step) {
        if crate::util::fire_once(&marker) {
            eprintln!("faults.kill_in_write_step = {s}: killing this process in the middle of the checkpoint write");
            #[cfg(unix)]
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
            std::process::abort();
        }
    }
}

/// Writes a checkpoint atomically; returns its directory.
pub fn save(ckpt_dir: &Path, state: &TrainState, model: &Tensors, optim: &Tensors, tokenizer_json: &str) -> Result<PathBuf> {
    fs::create_dir_all(ckpt_dir).map_err(|e| io_err(ckpt_dir, e))?;
    let tmp = ckpt_dir.join(format!(".tmp-step-{:08}-{}", state.step, std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
    }
    fs::create_dir(&tmp).map_err(|e| io_err(&tmp, e))?;
    let mut manifest = Manifest { format: 1, shards: 0, shapes: BTreeMap::new(), files: BTreeMap::new(), self_crc32: 0 };
    // Tensors stream straight from the caller's buffers to disk (no serialised copy in memory).
    for (name, t) in [("model.safetensors", model), ("optimizer.safetensors", optim)] {
        let (bytes, crc32) = write_tensors(&tmp.join(name), t)?;
        manifest.files.insert(name.to_string(), FileSum { bytes, crc32 });
    }
    crash_point(state.step);
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("state.json", serde_json::to_vec_pretty(state).expect("state serializes")),
        (data::Tokenizer::file_name_of_json(tokenizer_json), tokenizer_json.as_bytes().to_vec()),
    ];
    for (name, bytes) in &files {
        write_synced(&tmp.join(name), bytes)?;
        manifest.files.insert(name.to_string(), FileSum { bytes: bytes.len() as u64, crc32: crc32fast::hash(bytes) });
    }
    manifest.self_crc32 = crc32fast::hash(&serde_json::to_vec(&manifest).unwrap());
    write_synced(&tmp.join("manifest.json"), &serde_json::to_vec_pretty(&manifest).unwrap())?;
    sync_dir(&tmp)?;
    let dst = fresh_name(ckpt_dir, state.step);
    fs::rename(&tmp, &dst).map_err(|e| io_err(&dst, e))?;
    sync_dir(ckpt_dir)?;
    // Written from memory with these checksums and synced: known valid.
    if let Some(t) = manifest_mtime(&dst) {
        VERIFIED.lock().unwrap().push((dst.clone(), t));
    }
    Ok(dst)
}

/// Where rank `rank` of `world` writes its part of a sharded checkpoint: `tmp`, a directory
/// rank 0 prepared ([`prepare_sharded`]) before any rank writes.
#[derive(Clone, Debug)]
pub struct Part {
    pub rank: usize,
    pub world: usize,
    pub tmp: PathBuf,
    /// Every tensor's whole shape (rank 0 records them in the manifest).
    pub shapes: BTreeMap<String, Vec<usize>>,
}

/// The shared temporary directory of a sharded checkpoint of `step`, emptied (a crashed
/// attempt at the same step may have left parts). Rank 0 calls it, then every rank writes.
pub fn prepare_sharded(ckpt_dir: &Path, step: u64) -> Result<PathBuf> {
    let tmp = ckpt_dir.join(format!(".tmp-step-{step:08}-sharded"));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
    }
    fs::create_dir_all(&tmp).map_err(|e| io_err(&tmp, e))?;
    Ok(tmp)
}

/// Writes this rank's part (`model` and `optim` hold its slices of every tensor, in
/// [`part_range`] order) and a `part-RRRRR.json` with their checksums, last. Rank 0 then
/// waits for every rank's part file, writes the state, tokenizer and the manifest, and renames
/// the directory into place; it returns the checkpoint directory.
pub fn save_part(ckpt_dir: &Path, part: &Part, state: &TrainState, model: &Tensors, optim: &Tensors, tokenizer_json: &str) -> Result<Option<PathBuf>> {
    let (r, n, tmp) = (part.rank, part.world, &part.tmp);
    let mut files = BTreeMap::new();
    for (kind, t) in [("model", model), ("optimizer", optim)] {
        let name = part_name(kind, r, n);
        let (bytes, crc32) = write_tensors(&tmp.join(&name), t)?;
        files.insert(name, FileSum { bytes, crc32 });
    }
    crash_point(state.step);
    let pj = tmp.join(format!("part-{r:05}.json"));
    write_synced(&pj.with_extension("tmp"), &serde_json::to_vec(&files).unwrap())?;
    fs::rename(pj.with_extension("tmp"), &pj).map_err(|e| io_err(&pj, e))?;
    if r != 0 {
        return Ok(None);
    }
    let mut manifest = Manifest { format: 2, shards: n, shapes: part.shapes.clone(), files: BTreeMap::new(), self_crc32: 0 };
    let t0 = std::time::Instant::now();
    for k in 0..n {
        let pk = tmp.join(format!("part-{k:05}.json"));
        loop {
            if let Ok(b) = fs::read(&pk) {
                let f: BTreeMap<String, FileSum> = serde_json::from_slice(&b).map_err(|e| KilnError::Internal(format!("{}: {e}", pk.display())))?;
                manifest.files.extend(f);
                break;
            }
            if t0.elapsed() > std::time::Duration::from_secs(600) {
                return Err(KilnError::Internal(format!("{}: rank {k}'s part of the checkpoint did not arrive within 600 s", tmp.display())));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    for (name, bytes) in [("state.json", serde_json::to_vec_pretty(state).expect("state serializes")), (data::Tokenizer::file_name_of_json(tokenizer_json), tokenizer_json.as_bytes().to_vec())] {
        write_synced(&tmp.join(name), &bytes)?;
        manifest.files.insert(name.to_string(), FileSum { bytes: bytes.len() as u64, crc32: crc32fast::hash(&bytes) });
    }
    manifest.self_crc32 = crc32fast::hash(&serde_json::to_vec(&manifest).unwrap());
    write_synced(&tmp.join("manifest.json"), &serde_json::to_vec_pretty(&manifest).unwrap())?;
    sync_dir(tmp)?;
    let dst = fresh_name(ckpt_dir, state.step);
    fs::rename(tmp, &dst).map_err(|e| io_err(&dst, e))?;
    sync_dir(ckpt_dir)?;
    if let Some(t) = manifest_mtime(&dst) {
        VERIFIED.lock().unwrap().push((dst.clone(), t));
    }
    Ok(Some(dst))
}

/// The whole tensors of a sharded checkpoint's `kind` parts, as one safetensors buffer.
fn assemble(dir: &Path, kind: &str, m: &Manifest, contents: &BTreeMap<String, Vec<u8>>) -> Result<Vec<u8>> {
    let bad = |what: String| KilnError::User(format!("{}: {what}", dir.display()));
    let parts: Vec<safetensors::SafeTensors> = (0..m.shards)
        .map(|r| safetensors::SafeTensors::deserialize(&contents[&part_name(kind, r, m.shards)]).map_err(|e| bad(format!("{}: {e}", part_name(kind, r, m.shards)))))
        .collect::<Result<_>>()?;
    let mut whole: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for name in parts[0].names() {
        let shape = m.shapes.get(name).ok_or_else(|| bad(format!("manifest.json has no shape for `{name}`")))?.clone();
        // The shape is the manifest's claim: checked against the parts' bytes before allocating.
        let len = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| bad(format!("manifest.json: the shape {shape:?} of `{name}` overflows")))?;
        let held: usize = parts.iter().map(|p| p.tensor(name).map_or(0, |t| t.data().len())).sum();
        if len.checked_mul(4) != Some(held) {
            return Err(bad(format!("manifest.json: `{name}` has shape {shape:?}, but its parts hold {held} bytes")));
        }
        let mut data = Vec::with_capacity(len);
        for (r, p) in parts.iter().enumerate() {
            let t = p.tensor(name).map_err(|_| bad(format!("{} lacks `{name}`", part_name(kind, r, m.shards))))?;
            if t.data().len() != part_range(len, r, m.shards).len() * 4 {
                return Err(bad(format!("{}: `{name}` holds the wrong slice", part_name(kind, r, m.shards))));
            }
            data.extend(t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        }
        whole.push((name.to_string(), shape, data));
    }
    Ok(encode_owned(&whole))
}

/// The safetensors bytes of owned `(name, shape, data)` tensors.
fn encode_owned(items: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
    let t = Tensors { items: items.iter().map(|(n, s, d)| (n.clone(), s.clone(), &d[..])).collect() };
    let mut out = Vec::new();
    encode_tensors(&mut out, &t).expect("writing to memory");
    out
}

/// A manifest as JSON, serialised with its self-checksum set (the fuzz target's fix-up, so
/// inputs reach what the checksums guard); a value that is no manifest is serialised as is.
pub fn seal_manifest(v: serde_json::Value) -> Vec<u8> {
    match serde_json::from_value::<Manifest>(v.clone()) {
        Ok(mut m) => {
            m.self_crc32 = 0;
            m.self_crc32 = crc32fast::hash(&serde_json::to_vec(&m).unwrap());
            serde_json::to_vec(&m).unwrap()
        }
        Err(_) => serde_json::to_vec(&v).unwrap(),
    }
}

/// A verified checkpoint, loaded into memory.
pub struct Loaded {
    pub dir: PathBuf,
    pub state: TrainState,
    pub model: Vec<u8>,
    pub optim: Vec<u8>,
    pub tokenizer_json: String,
}

/// Reads and verifies one checkpoint directory.
pub fn verify_and_load(dir: &Path) -> Result<Loaded> {
    let bad = |what: String| KilnError::User(format!("{}: {what}", dir.display()));
    let mpath = dir.join("manifest.json");
    let mbytes = fs::read(&mpath).map_err(|e| bad(format!("cannot read manifest.json: {e}")))?;
    let mut manifest: Manifest = serde_json::from_slice(&mbytes).map_err(|e| bad(format!("manifest.json is corrupt: {e}")))?;
    let claimed = manifest.self_crc32;
    manifest.self_crc32 = 0;
    if crc32fast::hash(&serde_json::to_vec(&manifest).unwrap()) != claimed {
        return Err(bad("manifest.json fails its checksum".into()));
    }
    // A manifest that passes its checksum may still be hostile (found by fuzzing): a format
    // kiln does not write, or a part count its file list cannot hold.
    match manifest.format {
        1 => {}
        2 if manifest.shards >= 1 && manifest.shards.saturating_mul(2) <= manifest.files.len() => {}
        2 => return Err(bad(format!("manifest.json: format 2 with {} parts but {} files listed", manifest.shards, manifest.files.len()))),
        f => return Err(bad(format!("manifest.json: format {f} is not supported (1 or 2)"))),
    }
    // The tokenizer under its format's name (checkpoints before kiln-tokenizer.json: tokenizer.json).
    let tok_name = [data::KILN_TOKENIZER_FILE, data::HF_TOKENIZER_FILE].into_iter().find(|n| manifest.files.contains_key(*n)).unwrap_or(data::HF_TOKENIZER_FILE);
    let mut names: Vec<String> = ["state.json", tok_name].iter().map(|s| s.to_string()).collect();
    if manifest.format == 2 {
        for r in 0..manifest.shards {
            names.push(part_name("model", r, manifest.shards));
            names.push(part_name("optimizer", r, manifest.shards));
        }
    } else {
        names.extend(["model.safetensors".to_string(), "optimizer.safetensors".to_string()]);
    }
    let mut contents: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for name in &names {
        let name = name.as_str();
        let sum = manifest.files.get(name).ok_or_else(|| bad(format!("manifest.json does not list {name}")))?;
        let bytes = fs::read(dir.join(name)).map_err(|e| bad(format!("cannot read {name}: {e}")))?;
        if bytes.len() as u64 != sum.bytes {
            return Err(bad(format!("{name} is truncated or extended: {} bytes, expected {}", bytes.len(), sum.bytes)));
        }
        if crc32fast::hash(&bytes) != sum.crc32 {
            return Err(bad(format!("{name} fails its checksum (corrupted)")));
        }
        contents.insert(name.to_string(), bytes);
    }
    let state: TrainState = serde_json::from_slice(&contents["state.json"]).map_err(|e| bad(format!("state.json: {e}")))?;
    let (model, optim) = if manifest.format == 2 {
        (assemble(dir, "model", &manifest, &contents)?, assemble(dir, "optimizer", &manifest, &contents)?)
    } else {
        (contents.remove("model.safetensors").unwrap(), contents.remove("optimizer.safetensors").unwrap())
    };
    Ok(Loaded {
        dir: dir.to_path_buf(),
        state,
        model,
        optim,
        tokenizer_json: String::from_utf8_lossy(&contents[tok_name]).into_owned(),
    })
}

/// Checkpoint directories under `ckpt_dir`, newest (highest step, then latest suffix) first.
pub fn list(ckpt_dir: &Path) -> Vec<(u64, PathBuf)> {
    let mut out = Vec::new();
    if let Ok(rd) = fs::read_dir(ckpt_dir) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix("step-") else { continue };
            let (num, suffix) = rest.split_once('.').map_or((rest, 0), |(n, s)| (n, s.parse().unwrap_or(0)));
            if let Ok(step) = num.parse::<u64>() {
                out.push((step, suffix, e.path()));
            }
        }
    }
    out.sort_by_key(|x| std::cmp::Reverse((x.0, x.1)));
    out.into_iter().map(|(s, _, p)| (s, p)).collect()
}

/// The newest checkpoint that verifies. Failing ones are reported on stderr and left alone;
/// with none valid, the error names every checkpoint tried and why it failed.
pub fn latest_valid(ckpt_dir: &Path) -> Result<Loaded> {
    let all = list(ckpt_dir);
    if all.is_empty() {
        return user(format!("{}: no checkpoint to resume from", ckpt_dir.display()));
    }
    let mut failures = Vec::new();
    for (_, dir) in &all {
        match verify_and_load(dir) {
            Ok(l) => {
                for f in &failures {
                    eprintln!("warning: skipped invalid checkpoint: {f}");
                }
                return Ok(l);
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    user(format!("no valid checkpoint in {}: {}", ckpt_dir.display(), failures.join("; ")))
}

/// Checkpoints this process has verified (or written), by directory, with the manifest's
/// modification time then: pruning does not read them again while they are unchanged.
static VERIFIED: std::sync::Mutex<Vec<(PathBuf, std::time::SystemTime)>> = std::sync::Mutex::new(Vec::new());

fn manifest_mtime(dir: &Path) -> Option<std::time::SystemTime> {
    fs::metadata(dir.join("manifest.json")).and_then(|m| m.modified()).ok()
}

fn known_valid(dir: &Path) -> bool {
    let Some(t) = manifest_mtime(dir) else { return false };
    if VERIFIED.lock().unwrap().iter().any(|(d, m)| d == dir && *m == t) {
        return true;
    }
    let ok = verify_and_load(dir).is_ok();
    if ok {
        VERIFIED.lock().unwrap().push((dir.to_path_buf(), t));
    }
    ok
}

/// Removes what writers that died left behind: `.tmp-*` directories, never checkpoints (a
/// checkpoint becomes visible only when renamed into place). Called when a run starts, before
/// anything of its own is written; returns what was removed.
pub fn remove_partial(ckpt_dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = fs::read_dir(ckpt_dir) {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with(".tmp-") && fs::remove_dir_all(e.path()).is_ok() {
                out.push(e.path());
            }
        }
    }
    out
}

/// Removes the oldest *valid* checkpoints beyond the newest `keep`, except those of steps
/// that are multiples of `keep_every` (0: none kept that way). Invalid ones are never touched.
/// (Each checkpoint is fully verified once per process; see [`VERIFIED`].)
pub fn prune(ckpt_dir: &Path, keep: usize, keep_every: u64) {
    let mut valid = 0;
    for (step, dir) in list(ckpt_dir) {
        if known_valid(&dir) {
            valid += 1;
            if valid > keep && !(keep_every > 0 && step % keep_every == 0) {
                let _ = fs::remove_dir_all(&dir);
            }
        }
    }
}

/// `buf`'s views under the layout's names, with `prefix`.
pub fn named<'a>(layout: &model::ParamLayout, prefix: &str, buf: &'a [f32]) -> Vec<(String, Vec<usize>, &'a [f32])> {
    layout.params.iter().map(|p| (format!("{prefix}{}", p.name), p.shape.clone(), &buf[p.range()])).collect()
}

/// Everything a checkpoint holds, copied out of the training state (so training can go on).
pub struct Snapshot {
    /// Sharded: this rank's part (`layout`, `params`, `m`, `v` then hold its slices).
    pub part: Option<Part>,
    pub state: TrainState,
    pub layout: model::ParamLayout,
    pub params: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// Communication compression: this rank's state (empty without it): row `rank` of the
    /// optimizer tensor [`COMPRESSION_STATE`], `[world, len]`.
    pub compression: Vec<f32>,
    pub tokenizer_json: String,
}

/// The optimizer tensor holding every rank's communication-compression state (1-bit Adam's
/// error feedback; PowerSGD's error and `Q`), one row each.
pub const COMPRESSION_STATE: &str = "compression_state";

/// One of the buffers a snapshot copies: gathered for it (owned), or the live training buffer
/// itself, which the training loop leaves untouched until the snapshot's [`Gate`] opens.
pub enum Source {
    Owned(Vec<f32>),
    Live { ptr: *const f32, len: usize },
    /// Live bf16-split master weights (`tensor::precision::split_bf16`): the working weights
    /// and the low halves, joined into fp32 as they are copied.
    LiveSplit { work: *const f32, low: *const u16, len: usize },
    /// A live compact moment (`optim.state`: the first, or with `second` the second),
    /// converted to fp32 as it is copied.
    LiveLean(crate::step::lean::LeanView),
    /// A state the optimizer does not keep (Lion's second moment): zeros, so every checkpoint
    /// holds the same tensors.
    Zeros,
}

// SAFETY: a `Live` source is only read, on the writer thread, while the gate is held; the
// training loop waits at the gate before it writes the buffer again.
unsafe impl Send for Source {}

impl Source {
    /// The live buffer `x`: the caller must not write or free it before the gate of the job it
    /// goes into opens.
    pub fn live(x: &[f32]) -> Source {
        Source::Live { ptr: x.as_ptr(), len: x.len() }
    }

    /// Live split master weights: `work` and `low` as for [`Source::live`].
    pub fn live_split(work: &[f32], low: &[u16]) -> Source {
        assert_eq!(work.len(), low.len());
        Source::LiveSplit { work: work.as_ptr(), low: low.as_ptr(), len: work.len() }
    }

    /// Appends elements `r` (as fp32) to `out`.
    fn extend(&self, out: &mut Vec<f32>, r: std::ops::Range<usize>) {
        match self {
            Source::Owned(v) => out.extend_from_slice(&v[r]),
            // SAFETY: see `Source::live`.
            Source::Live { ptr, len } => out.extend_from_slice(&unsafe { std::slice::from_raw_parts(*ptr, *len) }[r]),
            Source::LiveSplit { work, low, len } => {
                // SAFETY: see `Source::live`.
                let (w, l) = unsafe { (std::slice::from_raw_parts(*work, *len), std::slice::from_raw_parts(*low, *len)) };
                // On the writer thread alone, as a copy would be (not on the training pool).
                let at = out.len();
                out.resize(at + r.len(), 0.0);
                tensor::precision::join_bf16_chunk(&mut out[at..], &w[r.clone()], &l[r]);
            }
            // SAFETY: see `Source::live`.
            Source::LiveLean(view) => unsafe { view.extend_f32(out, r) },
            Source::Zeros => out.resize(out.len() + r.len(), 0.0),
        }
    }
}

/// What to snapshot: the whole-model `layout` over parameter, first- and second-moment
/// `sources`, of which a sharded checkpoint's rank keeps its `part`.
pub struct Job {
    pub part: Option<Part>,
    pub state: TrainState,
    pub layout: model::ParamLayout,
    pub sources: [Source; 3],
    /// Communication compression: this rank's state.
    pub compression: Option<Vec<f32>>,
    pub tokenizer_json: String,
    /// Written to disk; else an in-memory snapshot only (kept by the [`ReplicaStore`]).
    pub to_disk: bool,
}

/// Held while a snapshot is being copied out of live training buffers (CheckFreq's pipelined
/// snapshot: the copy overlaps the next step's forward and backward); the next update waits
/// here ([`Gate::wait`]) until the copy is done.
#[derive(Clone, Default)]
pub struct Gate(std::sync::Arc<(std::sync::Mutex<(bool, f64)>, std::sync::Condvar)>);

impl Gate {
    fn hold(&self) {
        self.0 .0.lock().unwrap().0 = true;
    }

    fn release(&self) {
        self.0 .0.lock().unwrap().0 = false;
        self.0 .1.notify_all();
    }

    /// Blocks while a snapshot is still reading the live buffers.
    pub fn wait(&self) {
        let (lock, cv) = &*self.0;
        let mut g = lock.lock().unwrap();
        if !g.0 {
            return;
        }
        let t0 = std::time::Instant::now();
        while g.0 {
            g = cv.wait(g).unwrap();
        }
        g.1 += t0.elapsed().as_secs_f64();
    }

    /// Seconds the training loop has waited at the gate since the last call.
    pub fn take_waited(&self) -> f64 {
        std::mem::take(&mut self.0 .0.lock().unwrap().1)
    }
}

/// Copies a job's tensors (all of each, or this rank's part) into `spare`'s buffers (no fresh
/// allocation after the first snapshot).
fn copy_job(job: Job, spare: Option<Snapshot>) -> Snapshot {
    let (mut sp, mut sm, mut sv) = spare.map_or((Vec::new(), Vec::new(), Vec::new()), |s| (s.params, s.m, s.v));
    for b in [&mut sp, &mut sm, &mut sv] {
        b.clear();
    }
    let [fp, fm, fv] = &job.sources;
    let mut part_layout = model::ParamLayout::default();
    for p in &job.layout.params {
        let r = match &job.part {
            Some(pt) => part_range(p.len(), pt.rank, pt.world),
            None => 0..p.len(),
        };
        let shape = if job.part.is_some() { vec![r.len()] } else { p.shape.clone() };
        part_layout.push_named(p.name.clone(), shape, model::Init::Zeros, false);
        let (a, b) = (p.offset + r.start, p.offset + r.end);
        fp.extend(&mut sp, a..b);
        fm.extend(&mut sm, a..b);
        fv.extend(&mut sv, a..b);
    }
    Snapshot { part: job.part, state: job.state, layout: part_layout, params: sp, m: sm, v: sv, compression: job.compression.unwrap_or_default(), tokenizer_json: job.tokenizer_json }
}

/// A finished save.
pub struct Saved {
    pub dir: PathBuf,
    pub step: u64,
    /// Serialising, checksumming, writing and syncing (and pruning).
    pub write_s: f64,
}

fn write_snapshot(ckpt_dir: &Path, snap: &Snapshot, keep: usize, keep_every: u64) -> Result<Saved> {
    let t0 = std::time::Instant::now();
    let mt = Tensors { items: named(&snap.layout, "", &snap.params) };
    let mut ot = named(&snap.layout, "exp_avg.", &snap.m);
    ot.extend(named(&snap.layout, "exp_avg_sq.", &snap.v));
    if !snap.compression.is_empty() {
        ot.push((COMPRESSION_STATE.to_string(), vec![snap.compression.len()], &snap.compression[..]));
    }
    let dir = match &snap.part {
        None => save(ckpt_dir, &snap.state, &mt, &Tensors { items: ot }, &snap.tokenizer_json)?,
        Some(p) => match save_part(ckpt_dir, p, &snap.state, &mt, &Tensors { items: ot }, &snap.tokenizer_json)? {
            Some(d) => d,
            // Another rank's part: rank 0 finishes and prunes.
            None => return Ok(Saved { dir: p.tmp.clone(), step: snap.state.step, write_s: t0.elapsed().as_secs_f64() }),
        },
    };
    prune(ckpt_dir, keep, keep_every);
    Ok(Saved { dir, step: snap.state.step, write_s: t0.elapsed().as_secs_f64() })
}

/// In-memory checkpoints (Gemini, Wang et al. SOSP 2023): every rank's latest snapshot stays
/// in its own memory and a copy goes to its peer's (rank `r`'s to rank `r + 1 mod n`), so
/// when a rank fails, the survivors restore from their own memory and the failed rank's part
/// comes from its peer's, without reading disk. A host is one rank's memory; a failed rank
/// loses its host ([`ReplicaStore::lose`]): its own snapshot and the copy it kept for the
/// rank before it. With in-process ranks the hosts are regions of this process (what a
/// failed rank thread loses is simulated; a crash of the process loses them all, and the
/// restart reads disk).
pub struct ReplicaStore {
    hosts: Vec<std::sync::Mutex<Host>>,
}

#[derive(Default)]
struct Host {
    /// This rank's latest snapshot (also what its writer reads while writing it to disk).
    own: Option<std::sync::Arc<Snapshot>>,
    /// A copy of the previous rank's latest snapshot.
    guest: Option<Snapshot>,
}

/// A snapshot's bytes of tensor data.
fn snapshot_bytes(s: &Snapshot) -> usize {
    4 * (s.params.len() + s.m.len() + s.v.len() + s.compression.len())
}

impl ReplicaStore {
    pub fn new(world: usize) -> std::sync::Arc<ReplicaStore> {
        std::sync::Arc::new(ReplicaStore { hosts: (0..world).map(|_| Default::default()).collect() })
    }

    fn peer(&self, rank: usize) -> usize {
        (rank + 1) % self.hosts.len()
    }

    /// Makes `snap` rank `rank`'s latest in-memory snapshot: copied into its peer's memory
    /// (into the buffers of the copy it replaces), then kept as its own. Returns the snapshot
    /// it replaces (for its buffers to be reused).
    fn publish(&self, rank: usize, snap: std::sync::Arc<Snapshot>) -> Option<std::sync::Arc<Snapshot>> {
        let peer = self.peer(rank);
        if peer != rank {
            let old = self.hosts[peer].lock().unwrap().guest.take();
            let (mut p, mut m, mut v) = old.map_or((Vec::new(), Vec::new(), Vec::new()), |g| (g.params, g.m, g.v));
            for (dst, src) in [(&mut p, &snap.params), (&mut m, &snap.m), (&mut v, &snap.v)] {
                dst.clear();
                dst.extend_from_slice(src);
            }
            let copy = Snapshot { part: snap.part.clone(), state: snap.state.clone(), layout: snap.layout.clone(), params: p, m, v, compression: snap.compression.clone(), tokenizer_json: snap.tokenizer_json.clone() };
            self.hosts[peer].lock().unwrap().guest = Some(copy);
        }
        self.hosts[rank].lock().unwrap().own.replace(snap)
    }

    /// Rank `rank` has failed: everything in its memory is gone.
    pub fn lose(&self, rank: usize) {
        *self.hosts[rank].lock().unwrap() = Host::default();
    }

    /// Bytes held in rank `rank`'s memory (its own snapshot and its peer's copy).
    pub fn held_bytes(&self, rank: usize) -> usize {
        let h = self.hosts[rank].lock().unwrap();
        h.own.as_deref().map_or(0, snapshot_bytes) + h.guest.as_ref().map_or(0, snapshot_bytes)
    }

    /// The whole checkpoint of the newest step whose every part is still in memory: each
    /// rank's own snapshot, or for a failed rank the copy in its peer's memory. Why not, when
    /// no step has all its parts.
    pub fn restore(&self) -> std::result::Result<Loaded, String> {
        let n = self.hosts.len();
        let hosts: Vec<_> = self.hosts.iter().map(|h| h.lock().unwrap()).collect();
        // Part k of a sharded snapshot is rank k's; an unsharded one (LoRA adapters) is rank 0's alone.
        let parts = hosts.iter().filter_map(|h| h.own.as_deref().or(h.guest.as_ref())).map(|s| s.part.as_ref().map_or(1, |p| p.world)).next();
        let Some(parts) = parts else { return Err("no rank holds an in-memory snapshot".into()) };
        let candidates = |k: usize| -> Vec<&Snapshot> {
            let guest = hosts[(k + 1) % n].guest.as_ref().filter(|g| g.part.as_ref().map_or(0, |p| p.rank) == k);
            hosts[k].own.as_deref().into_iter().chain(guest).collect()
        };
        let mut steps: Option<std::collections::BTreeSet<u64>> = None;
        for k in 0..parts {
            let have: std::collections::BTreeSet<u64> = candidates(k).iter().map(|s| s.state.step).collect();
            if have.is_empty() {
                return Err(format!("rank {k}'s snapshot is in neither its memory nor its peer's (rank {})", (k + 1) % n));
            }
            steps = Some(match steps {
                None => have,
                Some(s) => s.intersection(&have).copied().collect(),
            });
        }
        let Some(&step) = steps.unwrap_or_default().iter().next_back() else {
            return Err("the ranks' in-memory snapshots are of different steps (a failure during a snapshot)".into());
        };
        let chosen: Vec<&Snapshot> = (0..parts).map(|k| *candidates(k).iter().find(|s| s.state.step == step).unwrap()).collect();
        let first = chosen[0];
        // The whole tensors, from every part's slice of each, in part order.
        let whole = |prefix: &str, pick: &dyn Fn(&Snapshot) -> &[f32]| -> Vec<(String, Vec<usize>, Vec<f32>)> {
            first
                .layout
                .params
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let name = format!("{prefix}{}", p.name);
                    let shape = first.part.as_ref().map_or_else(|| p.shape.clone(), |pt| pt.shapes[&name].clone());
                    let data = chosen.iter().flat_map(|s| pick(s)[s.layout.params[i].range()].iter().copied()).collect();
                    (name, shape, data)
                })
                .collect()
        };
        let model = encode_owned(&whole("", &|s| &s.params));
        let mut ot = whole("exp_avg.", &|s| &s.m);
        ot.extend(whole("exp_avg_sq.", &|s| &s.v));
        if let (false, Some(pt)) = (first.compression.is_empty(), &first.part) {
            ot.push((COMPRESSION_STATE.to_string(), pt.shapes[COMPRESSION_STATE].clone(), chosen.iter().flat_map(|s| s.compression.iter().copied()).collect()));
        }
        Ok(Loaded { dir: PathBuf::from(format!("<in-memory snapshot of step {step}>")), state: first.state.clone(), model, optim: encode_owned(&ot), tokenizer_json: first.tokenizer_json.clone() })
    }
}

/// What a save gives back: the write's result (the checkpoint, when it went to disk) and the
/// snapshot it replaced in memory, to reuse as the next copy's buffers.
type SaveOutcome = (Result<Option<Saved>>, Option<Snapshot>);

/// Writes snapshots on a background thread, at most one in flight: a new one waits for the
/// previous to finish (a write is never abandoned or interleaved with another). Synchronous
/// when `background` is false.
pub struct Writer {
    ckpt_dir: PathBuf,
    keep: usize,
    keep_every: u64,
    background: bool,
    /// In-memory checkpoints: the store and this rank.
    replicas: Option<(std::sync::Arc<ReplicaStore>, usize)>,
    inflight: Option<std::thread::JoinHandle<SaveOutcome>>,
    /// The job in flight writes to disk (else it is an in-memory snapshot only).
    inflight_to_disk: bool,
    /// A finished write whose result has not been reported yet.
    finished: Option<Result<Saved>>,
    /// The last written snapshot's buffers, for the next snapshot to copy into (no fresh
    /// allocation, so no page faults, in the training loop).
    spare: Option<Snapshot>,
    gate: Gate,
}

impl Writer {
    pub fn new(ckpt_dir: PathBuf, keep: usize, keep_every: u64, background: bool) -> Writer {
        Writer { ckpt_dir, keep, keep_every, background, replicas: None, inflight: None, inflight_to_disk: false, finished: None, spare: None, gate: Gate::default() }
    }

    /// Also keeps every snapshot in memory, this rank's in `store` ([`ReplicaStore`]).
    pub fn with_replicas(mut self, store: std::sync::Arc<ReplicaStore>, rank: usize) -> Writer {
        self.replicas = Some((store, rank));
        self
    }

    fn reap(&mut self) -> Result<()> {
        if let Some(h) = self.inflight.take() {
            let (r, snap) = h.join().map_err(|_| KilnError::Internal("the checkpoint writer panicked".into()))?;
            // A memory-only snapshot has nothing to report; an earlier write's report stays.
            if let Some(r) = r.transpose() {
                self.finished = Some(r);
            }
            self.spare = snap;
        }
        Ok(())
    }

    /// A checkpoint is still being written to disk (an in-memory snapshot in flight is brief:
    /// the next submit just waits for it).
    pub fn writing_to_disk(&self) -> bool {
        self.inflight_to_disk && self.inflight.as_ref().is_some_and(|h| !h.is_finished())
    }

    /// The gate the training loop waits at before it updates buffers a snapshot may still be
    /// copying.
    pub fn gate(&self) -> Gate {
        self.gate.clone()
    }

    /// Starts saving `job` (waiting for the previous save first, whose result is returned).
    /// In the background the copy out of the job's sources happens on the writer thread (the
    /// gate is held until it is done), then the write, at the lowest priority; otherwise both
    /// happen now.
    pub fn submit(&mut self, job: Job) -> Result<Option<Saved>> {
        let prev = self.finish()?;
        let spare = self.spare.take();
        let (dir, keep, every, replicas) = (self.ckpt_dir.clone(), self.keep, self.keep_every, self.replicas.clone());
        // Copied, kept in memory (the buffers of the one it replaces come back as the next
        // spare), and written.
        let save = move |snap: Snapshot, to_disk: bool| -> (Result<Option<Saved>>, Option<Snapshot>) {
            let snap = std::sync::Arc::new(snap);
            let old = replicas.map(|(store, rank)| store.publish(rank, snap.clone()));
            let r = if to_disk { write_snapshot(&dir, &snap, keep, every).map(Some) } else { Ok(None) };
            // Kept in memory, the snapshot stays there and the one it replaced comes back.
            let spare = match old {
                Some(old) => old.and_then(|o| std::sync::Arc::try_unwrap(o).ok()),
                None => std::sync::Arc::try_unwrap(snap).ok(),
            };
            (r, spare)
        };
        let to_disk = job.to_disk;
        if !self.background {
            let (r, spare) = save(copy_job(job, spare), to_disk);
            self.spare = spare;
            return r.map(|s| s.or(prev));
        }
        let gate = self.gate.clone();
        gate.hold();
        let h = std::thread::Builder::new()
            .name("checkpoint".into())
            .spawn(move || {
                let snap = copy_job(job, spare);
                gate.release();
                lower_priority();
                save(snap, to_disk)
            })
            .map_err(|e| KilnError::Internal(format!("cannot start the checkpoint writer: {e}")))?;
        (self.inflight, self.inflight_to_disk) = (Some(h), to_disk);
        Ok(prev)
    }

    /// Waits for the save in flight, if any, and reports the last unreported one.
    pub fn finish(&mut self) -> Result<Option<Saved>> {
        self.reap()?;
        self.finished.take().transpose()
    }

}

impl Drop for Writer {
    /// A run that stops early (an error, a rollback) still lets the write in flight finish.
    fn drop(&mut self) {
        if let Some(h) = self.inflight.take() {
            let _ = h.join();
        }
    }
}

/// Copies tensors stored under `prefix + name` in safetensors `bytes` into the views of
/// `layout` over `dst`. Every layout entry must be present with its exact shape.
pub fn read_into(bytes: &[u8], prefix: &str, layout: &model::ParamLayout, dst: &mut [f32], origin: &Path) -> Result<()> {
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| KilnError::User(format!("{}: {e}", origin.display())))?;
    for p in &layout.params {
        let name = format!("{prefix}{}", p.name);
        let t = st.tensor(&name).map_err(|_| KilnError::User(format!("{}: missing tensor `{name}`", origin.display())))?;
        if t.shape() != p.shape.as_slice() || t.dtype() != Dtype::F32 {
            return user(format!("{}: tensor `{name}` has shape {:?} {:?}, expected {:?} F32", origin.display(), t.shape(), t.dtype(), p.shape));
        }
        for (d, chunk) in dst[p.range()].iter_mut().zip(t.data().chunks_exact(4)) {
            *d = f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        }
    }
    Ok(())
}

/// Row `rank` of a `[world, len]` tensor `name` of `bytes` (a checkpoint's optimizer file), if
/// it holds one of `world` rows of `len`; `None` when absent or of another shape.
pub fn read_row(bytes: &[u8], name: &str, rank: usize, world: usize, len: usize) -> Option<Vec<f32>> {
    let st = safetensors::SafeTensors::deserialize(bytes).ok()?;
    let t = st.tensor(name).ok()?;
    if t.shape() != [world, len] || t.dtype() != Dtype::F32 {
        return None;
    }
    Some(t.data()[rank * len * 4..(rank + 1) * len * 4].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// Gives the calling thread the lowest scheduling priority (Linux: `SCHED_IDLE`, and `nice` 19,
/// for this thread alone), so a background write takes the cores only when training leaves
/// them idle.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
        // SCHED_IDLE: run only on a core nothing else wants, so the writer does not preempt a
        // training thread mid-kernel (with every core in a parallel matmul, one preempted
        // thread stalls them all); nice 19 above stays as the fallback if this is refused.
        let param = libc::sched_param { sched_priority: 0 };
        libc::sched_setscheduler(0, libc::SCHED_IDLE, &param);
    }
}
