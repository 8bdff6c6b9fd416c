//! The fuzz targets (`kiln::fuzz`) on stable, every CI run: each target's checked-in seeds
//! (`fuzz/seeds/`) and regressions (`fuzz/regressions/`: inputs the fuzzers once crashed on),
//! then a short deterministic mutation run from them. The long coverage-guided runs are
//! libFuzzer's (`fuzz/README.md`).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn inputs(kind: &str, target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz").join(kind).join(target);
    let mut out: Vec<(PathBuf, Vec<u8>)> = match std::fs::read_dir(&dir) {
        Ok(d) => d.flatten().map(|e| e.path()).filter(|p| p.is_file()).map(|p| (p.clone(), std::fs::read(&p).unwrap())).collect(),
        Err(_) => Vec::new(),
    };
    out.sort();
    out
}

/// xorshift64*: the mutation run is the same on every machine.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Byte-level mutations, plus the values parsers trip on: huge and negative numbers, maximal
/// integers in binary headers, truncation, duplication.
fn mutate(rng: &mut Rng, seed: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(v.len() + 1);
        match rng.below(9) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            2 => v.truncate(at),
            3 if at < v.len() => {
                let end = (at + 1 + rng.below(64)).min(v.len());
                v.drain(at..end);
            }
            4 => {
                let num: &[u8] = [&b"1000000000000"[..], b"-1", b"18446744073709551615", b"0", b"1e308", b"NaN", b"4294967296", b"\"\"", b"[]", b"null"][rng.below(10)];
                v.splice(at..at, num.iter().copied());
            }
            5 if v.len() >= 8 => {
                let i = rng.below(v.len() - 7);
                let x: u64 = [u64::MAX, 1 << 40, 1 << 32, 0, u32::MAX as u64][rng.below(5)];
                v[i..i + 8].copy_from_slice(&x.to_le_bytes());
            }
            6 if !v.is_empty() => {
                let s = rng.below(v.len());
                let e = (s + 1 + rng.below(256)).min(v.len());
                let chunk = v[s..e].to_vec();
                v.splice(at..at, chunk);
            }
            7 => {
                // Replace a run of digits with another number.
                if let Some(i) = (0..v.len()).map(|k| (at + k) % v.len().max(1)).find(|&i| v.get(i).is_some_and(u8::is_ascii_digit)) {
                    let mut j = i;
                    while j < v.len() && v[j].is_ascii_digit() {
                        j += 1;
                    }
                    let n = format!("{}", [rng.next(), rng.next() % 100, 1 << 31, 1 << 33][rng.below(4)]);
                    v.splice(i..j, n.bytes());
                }
            }
            _ => v.extend_from_slice(b"\n--8<--\n"),
        }
    }
    v
}

/// Runs one input; a panic or an input slower than 10 s fails the test with the input saved.
fn check(target: &str, input: &[u8], what: &str) {
    // An abort (an allocation the system refuses) ends the process without a report: the input
    // it was running is left here.
    let last = std::env::temp_dir().join(format!("kiln-fuzz-last-{target}-{}", std::process::id()));
    std::fs::write(&last, input).unwrap();
    let t0 = Instant::now();
    let r = catch_unwind(AssertUnwindSafe(|| kiln::fuzz::run(target, input)));
    let slow = t0.elapsed() > Duration::from_secs(10);
    if r.is_err() || slow {
        let p = std::env::temp_dir().join(format!("kiln-fuzz-failure-{target}-{}", std::process::id()));
        std::fs::write(&p, input).unwrap();
        panic!("fuzz target {target}: {what} {} (input saved to {}; add it to fuzz/regressions/{target}/)", if slow { "took over 10 s" } else { "panicked" }, p.display());
    }
    let _ = std::fs::remove_file(&last);
}

#[test]
fn every_target_survives_its_corpus_regressions_and_mutations() {
    let targets: Vec<&str> = kiln::fuzz::TARGETS.iter().map(|(n, _)| *n).collect();
    // The targets run in parallel threads of this test; each one's budget (MEMORY_CAP) holds.
    std::thread::scope(|s| {
        for chunk in targets.chunks(targets.len().div_ceil(2)) {
            s.spawn(move || {
                for &t in chunk {
                    let seeds = inputs("seeds", t);
                    assert!(!seeds.is_empty(), "fuzz/seeds/{t}/ is empty: run fuzz/make_seeds.sh");
                    for (p, b) in seeds.iter().chain(inputs("regressions", t).iter()) {
                        check(t, b, &format!("input {}", p.display()));
                    }
                    let mut rng = Rng(0x9E3779B97F4A7C15 ^ t.len() as u64 ^ (t.as_bytes()[0] as u64) << 17);
                    let (t0, mut n) = (Instant::now(), 0);
                    while n < 200 || (t0.elapsed() < Duration::from_secs(3) && n < 20_000) {
                        let base = &seeds[rng.below(seeds.len())].1;
                        let m = mutate(&mut rng, base);
                        check(t, &m, &format!("mutation {n}"));
                        n += 1;
                    }
                }
            });
        }
    });
}
