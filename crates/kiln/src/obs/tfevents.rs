//! TensorBoard event files, written without TensorFlow, and `metrics.jsonl` beside them.
//!
//! An event file (`events.out.tfevents.<unix time>.<hostname>`) is a sequence of TFRecords:
//!
//! ```text
//! u64 length (LE) | u32 masked crc32c(length bytes) | payload | u32 masked crc32c(payload)
//! masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8        (wrapping, crc32c = Castagnoli)
//! ```
//!
//! Each payload is a hand-encoded `tensorflow.Event` protobuf (`tensorflow/core/util/event.proto`):
//! field 1 `wall_time` (double), 2 `step` (int64), 3 `file_version` (string, "brain.Event:2" in
//! the first record), 5 `summary` (`Summary { repeated Value value = 1; }`,
//! `Value { string tag = 1; float simple_value = 2; }`), 7, the run-status
//! log (a message whose field 1 is the status, START = 1).
//!
//! Resuming a run starts a new file whose first event after the version is a
//! status START at the first new step: TensorBoard then drops the events of the old file
//! at that step and later (the steps the resumed run writes again), as TensorFlow's own
//! summary writers do on restart.

use std::fs;
use std::io::{BufRead, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

// ---------------------------------------------------------------------------------------------
// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), table-driven.

const fn crc32c_table() -> [u32; 256] {
    let mut t = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { (c >> 1) ^ 0x82F6_3B78 } else { c >> 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

static CRC32C: [u32; 256] = crc32c_table();

/// CRC-32C of `bytes` (`crc32c(b"123456789") == 0xE3069283`).
pub fn crc32c(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c = CRC32C[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    !c
}

/// The TFRecord masking of a CRC.
pub fn masked_crc32c(bytes: &[u8]) -> u32 {
    let c = crc32c(bytes);
    // ((c >> 15) | (c << 17)) + 0xa282ead8
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One framed record.
pub fn frame_record(payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(payload.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc32c(payload).to_le_bytes());
    out
}

// ---------------------------------------------------------------------------------------------
// Protobuf encoding of the few messages we write.

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire: u8) {
    put_varint(out, ((field as u64) << 3) | wire as u64);
}

fn put_bytes(out: &mut Vec<u8>, field: u32, b: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// What an event carries besides its time and step.
#[derive(Clone, Debug, PartialEq)]
pub enum EventBody {
    FileVersion(String),
    /// `(tag, simple_value)` pairs.
    Scalars(Vec<(String, f32)>),
    /// The run-status log with status START (field 7: `{ status = 1: START }`).
    RunStart,
    /// Anything else (decoding only).
    Other,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub wall_time: f64,
    pub step: i64,
    pub body: EventBody,
}

/// The protobuf bytes of an `Event`.
pub fn encode_event(e: &Event) -> Vec<u8> {
    let mut out = Vec::new();
    put_key(&mut out, 1, 1);
    out.extend_from_slice(&e.wall_time.to_le_bytes());
    if e.step != 0 {
        put_key(&mut out, 2, 0);
        put_varint(&mut out, e.step as u64);
    }
    match &e.body {
        EventBody::FileVersion(v) => put_bytes(&mut out, 3, v.as_bytes()),
        EventBody::Scalars(vals) => {
            let mut summary = Vec::new();
            for (tag, x) in vals {
                let mut value = Vec::new();
                put_bytes(&mut value, 1, tag.as_bytes());
                put_key(&mut value, 2, 5);
                value.extend_from_slice(&x.to_le_bytes());
                put_bytes(&mut summary, 1, &value);
            }
            put_bytes(&mut out, 5, &summary);
        }
        EventBody::RunStart => put_bytes(&mut out, 7, &[0x08, 0x01]),
        EventBody::Other => {}
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Decoding, for tests and tools: enough protobuf to read back what we (and TensorFlow) write.

struct Pb<'a> {
    b: &'a [u8],
    i: usize,
}

enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(&'a [u8]),
}

impl<'a> Pb<'a> {
    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let &byte = self.b.get(self.i).ok_or("truncated varint")?;
            self.i += 1;
            v |= ((byte & 0x7f) as u64) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("varint too long".into())
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.i.checked_add(n).filter(|&e| e <= self.b.len()).ok_or("truncated field")?;
        let s = &self.b[self.i..end];
        self.i = end;
        Ok(s)
    }

    fn next(&mut self) -> Result<Option<(u32, Field<'a>)>, String> {
        if self.i >= self.b.len() {
            return Ok(None);
        }
        let key = self.varint()?;
        let field = (key >> 3) as u32;
        let f = match key & 7 {
            0 => Field::Varint(self.varint()?),
            1 => Field::Fixed64(self.take(8)?.try_into().unwrap()),
            2 => {
                let n = self.varint()? as usize;
                Field::Bytes(self.take(n)?)
            }
            5 => Field::Fixed32(self.take(4)?.try_into().unwrap()),
            w => return Err(format!("unsupported wire type {w}")),
        };
        Ok(Some((field, f)))
    }
}

/// Decodes an `Event` payload.
pub fn decode_event(payload: &[u8]) -> Result<Event, String> {
    let mut pb = Pb { b: payload, i: 0 };
    let mut e = Event { wall_time: 0.0, step: 0, body: EventBody::Other };
    while let Some((field, f)) = pb.next()? {
        match (field, f) {
            (1, Field::Fixed64(b)) => e.wall_time = f64::from_le_bytes(b),
            (2, Field::Varint(v)) => e.step = v as i64,
            (3, Field::Bytes(b)) => e.body = EventBody::FileVersion(String::from_utf8_lossy(b).into_owned()),
            (5, Field::Bytes(b)) => {
                let mut vals = Vec::new();
                let mut s = Pb { b, i: 0 };
                while let Some((sf, sv)) = s.next()? {
                    if let (1, Field::Bytes(vb)) = (sf, sv) {
                        let (mut tag, mut x) = (String::new(), None);
                        let mut v = Pb { b: vb, i: 0 };
                        while let Some((vf, vv)) = v.next()? {
                            match (vf, vv) {
                                (1, Field::Bytes(t)) => tag = String::from_utf8_lossy(t).into_owned(),
                                (2, Field::Fixed32(f)) => x = Some(f32::from_le_bytes(f)),
                                _ => {}
                            }
                        }
                        if let Some(x) = x {
                            vals.push((tag, x));
                        }
                    }
                }
                e.body = EventBody::Scalars(vals);
            }
            (7, Field::Bytes(b)) => {
                let mut s = Pb { b, i: 0 };
                while let Some((sf, sv)) = s.next()? {
                    if let (1, Field::Varint(1)) = (sf, sv) {
                        e.body = EventBody::RunStart;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(e)
}

/// Reads every record of an event file, checking both CRCs of each.
pub fn read_records(path: &Path) -> Result<Vec<Vec<u8>>, String> {
    let bytes = fs::read(path).map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
    let mut out = Vec::new();
    let mut i = 0usize;
    while i < bytes.len() {
        let at = |what: &str| format!("{}: record {} at byte {i}: {what}", path.display(), out.len());
        if bytes.len() - i < 12 {
            return Err(at("truncated header"));
        }
        let len_b = &bytes[i..i + 8];
        let crc = u32::from_le_bytes(bytes[i + 8..i + 12].try_into().unwrap());
        if crc != masked_crc32c(len_b) {
            return Err(at("length CRC mismatch"));
        }
        let len = u64::from_le_bytes(len_b.try_into().unwrap()) as usize;
        let start = i + 12;
        if bytes.len() - start < len.saturating_add(4) {
            return Err(at("truncated payload"));
        }
        let payload = &bytes[start..start + len];
        let crc = u32::from_le_bytes(bytes[start + len..start + len + 4].try_into().unwrap());
        if crc != masked_crc32c(payload) {
            return Err(at("payload CRC mismatch"));
        }
        out.push(payload.to_vec());
        i = start + len + 4;
    }
    Ok(out)
}

/// Reads and decodes an event file.
pub fn read_events(path: &Path) -> Result<Vec<Event>, String> {
    read_records(path)?.iter().map(|p| decode_event(p).map_err(|e| format!("{}: {e}", path.display()))).collect()
}

/// The event files in `dir`, oldest first (the order TensorBoard reads them in).
pub fn event_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().contains("tfevents")))
        .collect();
    v.sort();
    v
}

/// The scalars TensorBoard shows for a run directory: every event file in order, with the
/// events at or after a status START step purged from earlier files. `(tag, step, value)`.
pub fn read_scalars(dir: &Path) -> Result<Vec<(String, i64, f32)>, String> {
    let mut out: Vec<(String, i64, f32)> = Vec::new();
    for f in event_files(dir) {
        for e in read_events(&f)? {
            match e.body {
                EventBody::RunStart => out.retain(|(_, s, _)| *s < e.step),
                EventBody::Scalars(vals) => out.extend(vals.into_iter().map(|(t, x)| (t, e.step, x))),
                _ => {}
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Writing.

fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

fn hostname() -> String {
    let h = fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| fs::read_to_string("/etc/hostname"))
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let h: String = h.trim().chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_' { c } else { '_' }).collect();
    if h.is_empty() { "localhost".into() } else { h }
}

/// An open event file.
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<fs::File>,
}

impl EventWriter {
    /// Creates a new event file in `dir` (never reusing an existing name: a second file in the
    /// same second gets a `.1`, `.2`, … suffix, which sorts after it) and writes the version
    /// record.
    pub fn create(dir: &Path) -> Result<EventWriter, String> {
        let secs = now() as u64;
        let base = format!("events.out.tfevents.{secs}.{}", hostname());
        let mut n = 0;
        let (path, file) = loop {
            let name = if n == 0 { base.clone() } else { format!("{base}.{n}") };
            let p = dir.join(name);
            match fs::OpenOptions::new().write(true).create_new(true).open(&p) {
                Ok(f) => break (p, f),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => n += 1,
                Err(e) => return Err(format!("{}: cannot create: {e}", p.display())),
            }
        };
        let mut w = EventWriter { path, file: BufWriter::new(file) };
        w.write(&Event { wall_time: now(), step: 0, body: EventBody::FileVersion("brain.Event:2".into()) })?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write(&mut self, e: &Event) -> Result<(), String> {
        self.file.write_all(&frame_record(&encode_event(e))).map_err(|err| format!("{}: cannot write: {err}", self.path.display()))
    }

    pub fn flush(&mut self) -> Result<(), String> {
        self.file.flush().map_err(|err| format!("{}: cannot write: {err}", self.path.display()))
    }
}

/// `metrics.jsonl` and a TensorBoard event file of the same scalars, in a run directory.
pub struct MetricsWriter {
    jsonl_path: PathBuf,
    jsonl: fs::File,
    events: EventWriter,
}

impl MetricsWriter {
    /// Opens `run_dir/metrics.jsonl` for appending and starts a new event file beside it.
    /// With `keep_up_to_step = Some(s)` (a resumed run) the lines of steps after `s` (and lines
    /// without a step), except `"kind": "fault"` events, are first dropped, atomically, and the new event file starts with a
    /// A status START at step `s + 1` so TensorBoard drops the old file's later steps too.
    pub fn open(run_dir: &Path, keep_up_to_step: Option<u64>) -> Result<MetricsWriter, String> {
        fs::create_dir_all(run_dir).map_err(|e| format!("{}: cannot create: {e}", run_dir.display()))?;
        let jsonl_path = run_dir.join("metrics.jsonl");
        if let Some(s) = keep_up_to_step {
            truncate_metrics(&jsonl_path, s)?;
        }
        let mut jsonl = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(&jsonl_path)
            .map_err(|e| format!("{}: cannot open: {e}", jsonl_path.display()))?;
        // A line cut short by a crash must not swallow the next one.
        let len = jsonl.metadata().map(|m| m.len()).unwrap_or(0);
        if len > 0 {
            use std::io::{Seek, SeekFrom};
            let mut last = [0u8; 1];
            jsonl.seek(SeekFrom::Start(len - 1)).and_then(|_| jsonl.read_exact(&mut last)).map_err(|e| format!("{}: cannot read: {e}", jsonl_path.display()))?;
            if last[0] != b'\n' {
                jsonl.write_all(b"\n").map_err(|e| format!("{}: cannot write: {e}", jsonl_path.display()))?;
            }
        }
        let mut events = EventWriter::create(run_dir)?;
        if let Some(s) = keep_up_to_step {
            events.write(&Event { wall_time: now(), step: s as i64 + 1, body: EventBody::RunStart })?;
        }
        events.flush()?;
        Ok(MetricsWriter { jsonl_path, jsonl, events })
    }

    /// The event file this writer appends to.
    pub fn event_file(&self) -> &Path {
        self.events.path()
    }

    /// Appends `line` to metrics.jsonl (flushed) and writes each of its numeric fields other
    /// than `step` as a scalar tagged `<kind>/<key>` (`train/loss`, `eval/val_loss`) at the
    /// line's `step`.
    pub fn log(&mut self, line: &serde_json::Value) -> Result<(), String> {
        let obj = line.as_object().ok_or_else(|| format!("metrics line is not a JSON object: {line}"))?;
        let step = obj.get("step").and_then(|s| s.as_u64()).ok_or_else(|| format!("metrics line has no non-negative integer `step`: {line}"))?;
        writeln!(self.jsonl, "{line}").and_then(|_| self.jsonl.flush()).map_err(|e| format!("{}: cannot write: {e}", self.jsonl_path.display()))?;
        let kind = obj.get("kind").and_then(|k| k.as_str());
        let vals: Vec<(String, f32)> = obj
            .iter()
            .filter(|(k, _)| k.as_str() != "step")
            .filter_map(|(k, v)| v.as_f64().map(|x| (kind.map_or_else(|| k.clone(), |kd| format!("{kd}/{k}")), x as f32)))
            .collect();
        if !vals.is_empty() {
            self.events.write(&Event { wall_time: now(), step: step as i64, body: EventBody::Scalars(vals) })?;
            self.events.flush()?;
        }
        Ok(())
    }
}

/// Keeps only the metrics lines of steps ≤ `step`, through a temporary file and a rename.
fn truncate_metrics(path: &Path, step: u64) -> Result<(), String> {
    let Ok(f) = fs::File::open(path) else { return Ok(()) };
    let mut kept = String::new();
    for line in std::io::BufReader::new(f).lines() {
        let line = line.map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
        let v = serde_json::from_str::<serde_json::Value>(&line).ok();
        let s = v.as_ref().and_then(|v| v.get("step").and_then(|s| s.as_u64()));
        // Fault events stay: they are the record of what made the run resume.
        let fault = v.as_ref().is_some_and(|v| v["kind"] == "fault");
        if fault || s.is_some_and(|s| s <= step) {
            kept.push_str(&line);
            kept.push('\n');
        }
    }
    crate::util::write_atomic(path, kept.as_bytes()).map_err(|e| e.to_string())
}
