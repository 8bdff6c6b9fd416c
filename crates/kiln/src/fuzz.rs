//! Fuzz targets: one per parser of user input, each taking arbitrary bytes and
//! feeding them to the same code `kiln` runs on a user's files. A target may return any error;
//! it must never panic, abort, hang or allocate beyond [`MEMORY_CAP`] (the memory check's budget
//! is capped to it, so a fuzzed config that plans a large model is refused, not built).
//!
//! Parsers that read a directory take several files from one input, split at [`SEP`]; a
//! checkpoint's manifest gets its checksums fixed up, so inputs reach the code behind the
//! CRC check. Driven by libFuzzer under `fuzz/` (`cargo +nightly fuzz run NAME`, long runs) and
//! by `tests/it/fuzz.rs` (the checked-in corpora and regressions, then a short mutation run,
//! on every CI run).

use std::path::{Path, PathBuf};

/// Separates the files of a multi-file input.
pub const SEP: &[u8] = b"\n--8<--\n";

/// The memory budget every target runs under.
pub const MEMORY_CAP: u64 = 256 << 20;

/// A fuzz target: a name and the function it runs.
pub type Target = (&'static str, fn(&[u8]));

/// Every target, by name.
pub const TARGETS: &[Target] = &[
    ("hf_config", hf_config),
    ("safetensors", safetensors),
    ("checkpoint", checkpoint),
    ("tokenizer", tokenizer),
    ("npy", npy),
    ("token_files", token_files),
    ("prepared", prepared),
    ("jsonl", jsonl),
    ("parquet", parquet),
    ("config", config),
];

/// Runs target `name` on `data`.
pub fn run(name: &str, data: &[u8]) {
    let (_, f) = TARGETS.iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("no fuzz target `{name}`"));
    crate::memory::guard::cap(MEMORY_CAP);
    f(data)
}

/// The parts of a multi-file input (at most `n`; the last takes the rest).
pub fn split(data: &[u8], n: usize) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut rest = data;
    while out.len() + 1 < n {
        match rest.windows(SEP.len()).position(|w| w == SEP) {
            Some(i) => {
                out.push(&rest[..i]);
                rest = &rest[i + SEP.len()..];
            }
            None => break,
        }
    }
    out.push(rest);
    out
}

/// Joins files into one multi-file input (seed corpora).
pub fn join(parts: &[&[u8]]) -> Vec<u8> {
    parts.join(SEP)
}

/// A scratch directory of this process and thread, emptied for each input.
fn scratch(name: &str) -> PathBuf {
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let d = base.join(format!("kiln-fuzz-{}-{name}-{:?}", std::process::id(), std::thread::current().id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("fuzz scratch directory");
    d
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).expect("fuzz scratch directory");
    }
    std::fs::write(&p, bytes).expect("fuzz scratch file");
    p
}

/// A tiny GPT-2 config.json (1 layer, width 8, vocabulary 16) for targets that fuzz the weights.
const TINY_HF_CONFIG: &str = r#"{"architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_head": 2, "n_embd": 8, "n_positions": 8, "vocab_size": 16, "layer_norm_epsilon": 1e-5}"#;

/// `config.json` of a Hugging Face directory: parsed, sized, and (when small) built.
fn hf_config(data: &[u8]) {
    let dir = scratch("hf_config");
    write(&dir, "config.json", data);
    if let Ok((g, _)) = model::hf::read_config(&dir) {
        let budget = crate::memory::guard::Budget::of(0);
        if budget.check("fuzz", crate::memory::guard::weight_bytes(&g), "").is_ok() && g.param_count() < 1 << 20 {
            let m = model::Gpt::zeroed(g, 1);
            std::hint::black_box(m.num_params());
        }
    }
}

/// `model.safetensors` of a Hugging Face directory (a tiny GPT-2's config beside it).
fn safetensors(data: &[u8]) {
    let dir = scratch("safetensors");
    write(&dir, "config.json", TINY_HF_CONFIG.as_bytes());
    write(&dir, "model.safetensors", data);
    let _ = crate::run::import_hf(&dir);
    // QLoRA's reader: headers parsed alone, tensors read at their offsets.
    if let (Ok(r), Ok((g, _))) = (model::hf::TensorReader::open(&dir), model::hf::read_config(&dir)) {
        let (layout, _) = model::layout::gpt_layout(&g);
        for p in &layout.params {
            let mut dst = vec![0.0; p.len()];
            let _ = r.read_into(&p.name, &p.shape, &mut dst);
        }
    }
}

/// A kiln run directory: `config.toml` and one checkpoint's manifest, state, tensors and
/// tokenizer, read back by `kiln eval --run` / `--resume`'s loader.
fn checkpoint(data: &[u8]) {
    let parts = split(data, 6);
    let dir = scratch("checkpoint");
    let names = ["manifest.json", "state.json", "model.safetensors", "optimizer.safetensors", data::KILN_TOKENIZER_FILE];
    let ck = dir.join("checkpoints").join("step-00000001");
    let mut files = Vec::new();
    for (name, bytes) in names.iter().zip(parts.iter().skip(1).chain(std::iter::repeat(&&b""[..]))) {
        if *name != "manifest.json" {
            write(&ck, name, bytes);
            files.push((*name, *bytes));
        }
    }
    write(&dir, "config.toml", parts.first().copied().unwrap_or_default());
    write(&ck, "manifest.json", &fixed_manifest(parts.get(1).copied().unwrap_or_default(), &files));
    if let Ok(r) = crate::run::load_run(&dir) {
        let _ = crate::run::load_model(&r);
    }
}

/// The manifest `bytes` with its file sums and self-checksum made right (when it is a JSON
/// object), so the input reaches what the checksums guard.
pub fn fixed_manifest(bytes: &[u8], files: &[(&str, &[u8])]) -> Vec<u8> {
    let Ok(serde_json::Value::Object(mut m)) = serde_json::from_slice::<serde_json::Value>(bytes) else { return bytes.to_vec() };
    if let Some(serde_json::Value::Object(sums)) = m.get_mut("files") {
        for (name, b) in files {
            if let Some(serde_json::Value::Object(s)) = sums.get_mut(*name) {
                s.insert("bytes".into(), (b.len() as u64).into());
                s.insert("crc32".into(), crc32fast::hash(b).into());
            }
        }
    }
    m.insert("self_crc32".into(), 0.into());
    crate::checkpoint::seal_manifest(serde_json::Value::Object(m))
}

/// A `tokenizer.json` (kiln's or Hugging Face's) and optionally its `tokenizer_config.json`:
/// loaded, then used to encode, decode and render a chat document.
fn tokenizer(data: &[u8]) {
    let parts = split(data, 2);
    let dir = scratch("tokenizer");
    let Ok(text) = std::str::from_utf8(parts[0]) else { return };
    let Ok(mut t) = data::Tokenizer::from_json(text, &dir.join("tokenizer.json")) else { return };
    if let Some(cfg) = parts.get(1) {
        write(&dir, data::HF_TOKENIZER_CONFIG_FILE, cfg);
        match t.with_config_in(&dir) {
            Ok(with) => t = with,
            Err(_) => return,
        }
    }
    if let Ok(ids) = t.encode("Hello, world! ¿Qué tal? 123\n<|endoftext|>") {
        std::hint::black_box(t.decode(&ids));
    }
    let n = t.vocab_size().min(64) as u32;
    std::hint::black_box(t.decode(&(0..n).collect::<Vec<_>>()));
    let chat = serde_json::json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]);
    let _ = t.encode_doc(&data::Doc::Chat(chat), true);
}

/// A `.npy` token file.
fn npy(data: &[u8]) {
    let dir = scratch("npy");
    let _ = data::read_npy(&write(&dir, "x.npy", data));
}

/// The same bytes as a `.bin` token file and as a kiln `.tok` shard.
fn token_files(data: &[u8]) {
    let dir = scratch("token_files");
    let _ = data::read_bin(&write(&dir, "x.bin", data));
    let _ = data::read_shard(&write(&dir, "x.tok", data));
    let _ = data::load_token_files(&[dir.join("x.tok")], 1 << 17, "fuzz");
}

/// A prepared directory (`kiln data prepare`'s output): meta, tokenizer, shards, document
/// indexes and loss mask.
fn prepared(data: &[u8]) {
    let names = ["meta.json", data::KILN_TOKENIZER_FILE, "train.tok", "train.docs", "val.tok", "val.docs", "train.mask", "val.mask"];
    let parts = split(data, names.len());
    let dir = scratch("prepared");
    for (name, bytes) in names.iter().zip(&parts) {
        write(&dir, name, bytes);
    }
    if let Ok(ds) = data::load(&[dir], "auto", 0.1) {
        std::hint::black_box((ds.train.len(), ds.val.len()));
    }
}

/// A `.jsonl` corpus, read as text, chat and prompt/completion documents; the same bytes as a
/// `.jsonl.gz` and a `.jsonl.zst` stream (the decompressors' input), and compressed, so the
/// JSON behind each decompressor is fuzzed too.
fn jsonl(data: &[u8]) {
    use std::io::Write;
    let dir = scratch("jsonl");
    read_all(&write(&dir, "x.jsonl", data));
    read_all(&write(&dir, "raw.jsonl.gz", data));
    read_all(&write(&dir, "raw.jsonl.zst", data));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(data).expect("in memory");
    read_all(&write(&dir, "x.jsonl.gz", &gz.finish().expect("in memory")));
    read_all(&write(&dir, "x.jsonl.zst", &zstd::encode_all(data, 1).expect("in memory")));
}

/// A `.parquet` corpus, read as text, chat and prompt/completion documents.
fn parquet(data: &[u8]) {
    let dir = scratch("parquet");
    let p = write(&dir, "x.parquet", data);
    read_all(&p);
}

fn read_all(p: &Path) {
    for format in [data::DocFormat::Text, data::DocFormat::Chat, data::DocFormat::PromptCompletion, data::DocFormat::Preference] {
        let opts = data::DocOpts { text_field: "text".into(), format };
        let read = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let _ = data::read_docs(p, &opts, &read, &mut |docs| {
            std::hint::black_box(docs.iter().map(|d| d.text().len()).sum::<usize>());
            Ok(())
        });
    }
}

/// A TOML config file and `--set` values (one per line after the separator): layered over the
/// tiny preset as `kiln train` does, then sized and planned.
fn config(data: &[u8]) {
    let parts = split(data, 2);
    let dir = scratch("config");
    let path = write(&dir, "config.toml", parts[0]);
    let set = parts.get(1).map(|s| String::from_utf8_lossy(s).lines().map(str::to_string).collect()).unwrap_or_default();
    let args = crate::config::TrainArgs { config: Some(path), set, ..Default::default() };
    let Ok(base) = crate::presets::preset("tiny") else { return };
    let Ok(cfg) = crate::config::layered(&base, &args) else { return };
    let vocab = if cfg.model.vocab_size > 0 { cfg.model.vocab_size } else { 256 };
    let gpt = cfg.gpt_config(vocab);
    let _ = crate::memory::plan_checked(&cfg, &gpt, 0);
}

/// The largest single allocation a target may make (the issue's bound: 1 GiB).
pub const ALLOC_CAP: usize = 1 << 30;

/// The fuzz drivers' global allocator: the system's, aborting with a message on any single
/// allocation above [`ALLOC_CAP`] — allocated or not, touched or not — so libFuzzer (and the
/// stable replay test) report it as a crash with its input.
pub struct Capped;

#[cold]
fn too_big(size: usize) -> ! {
    let msg = format!("kiln::fuzz: an allocation of {size} bytes exceeds the 1 GiB cap\n");
    // SAFETY: writes a buffer to stderr, then aborts. (`format!` allocates a few bytes: below the cap.)
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
    }
    std::process::abort()
}

// SAFETY: forwards to the system allocator, checking only sizes.
unsafe impl std::alloc::GlobalAlloc for Capped {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        if l.size() > ALLOC_CAP {
            too_big(l.size());
        }
        std::alloc::System.alloc(l)
    }
    unsafe fn alloc_zeroed(&self, l: std::alloc::Layout) -> *mut u8 {
        if l.size() > ALLOC_CAP {
            too_big(l.size());
        }
        std::alloc::System.alloc_zeroed(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        std::alloc::System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: std::alloc::Layout, new_size: usize) -> *mut u8 {
        if new_size > ALLOC_CAP {
            too_big(new_size);
        }
        std::alloc::System.realloc(p, l, new_size)
    }
}
