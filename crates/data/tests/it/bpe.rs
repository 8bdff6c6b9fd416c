use std::time::Instant;

use data::{pre_split, train_bpe, train_bpe_with_specials, Tokenizer};

use crate::{sample_text, temp_dir};

fn pieces(s: &str) -> Vec<&str> {
    let mut v = Vec::new();
    pre_split(s, |w| v.push(w));
    v
}

#[test]
fn pre_split_matches_gpt2_pattern() {
    assert_eq!(pieces("Hello world"), ["Hello", " world"]);
    assert_eq!(pieces("I'm here, it's 2024!!"), ["I", "'m", " here", ",", " it", "'s", " 2024", "!!"]);
    assert_eq!(pieces("a  b\n\nc   "), ["a", " ", " b", "\n", "\n", "c", "   "]);
    assert_eq!(pieces("fn main() {}"), ["fn", " main", "()", " {}"]);
    // Pieces always concatenate back to the input.
    let s = "  x\t\ty  \n\n  'll 'LL ünï 12ab…  ";
    assert_eq!(pieces(s).concat(), s);
    let long = "=".repeat(1000);
    let p = pieces(&long);
    assert!(p.len() >= 4 && p.iter().all(|w| w.len() <= data::MAX_PIECE_BYTES));
    assert_eq!(p.concat(), long);
}

fn bpe(t: &Tokenizer) -> &data::Bpe {
    match t {
        Tokenizer::Bpe(b) => b,
        other => panic!("expected bpe, got {}", other.kind()),
    }
}

#[test]
fn bpe_trains_to_requested_vocab_round_trips_and_compresses() {
    let text = sample_text(300_000);
    let mut cut = text.len() - 20_000;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    let (train, unseen) = text.split_at(cut);
    let t0 = Instant::now();
    let t = train_bpe(train, 1024).unwrap();
    eprintln!("bpe: {} bytes -> vocab 1024 in {:?} (debug build)", train.len(), t0.elapsed());
    assert_eq!(t.kind(), "bpe");
    assert_eq!(t.vocab_size(), 1024);
    assert_eq!(bpe(&t).merges().len(), 768);
    // Exact round trip on text not seen in training, including chars never seen at all.
    let extra = format!("{unseen}\nZebra-crossing ünïcödé 日本 🎉 x=y+1;\r\n\t\t}}");
    let ids = t.encode(&extra);
    assert_eq!(t.decode(&ids), extra);
    assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
    // Compression: English at vocab 1024 should be well under half a token per byte.
    let ratio = unseen.len() as f64 / t.encode(unseen).len() as f64;
    assert!(ratio > 2.3, "only {ratio:.2} bytes per token");
    // Merges are ordered: each creates a new id from earlier ones, and decoding a merged id
    // gives the concatenation of its parts.
    let b = bpe(&t);
    for (i, &(x, y)) in b.merges().iter().enumerate() {
        assert!(x < 256 + i as u32 && y < 256 + i as u32);
    }
    let (x, y) = b.merges()[0];
    assert_eq!(t.decode(&[256]), t.decode(&[x, y]));
}

#[test]
fn bpe_is_deterministic_and_saves() {
    let text = sample_text(100_000);
    let a = train_bpe(&text, 600).unwrap();
    let b = train_bpe(&text, 600).unwrap();
    assert_eq!(bpe(&a).merges(), bpe(&b).merges());
    assert_eq!(a.to_json(), b.to_json());
    // Most frequent pair in English text with a GPT-2 split: "e" + " " never crosses a word,
    // so the first merge is within words; check it is the true most frequent pair.
    let mut counts = std::collections::HashMap::new();
    pre_split(&text, |w| {
        for p in w.as_bytes().windows(2) {
            *counts.entry((p[0] as u32, p[1] as u32)).or_insert(0u64) += 1;
        }
    });
    let best = counts.iter().max_by_key(|(&(x, y), &c)| (c, std::cmp::Reverse((x, y)))).unwrap();
    assert_eq!(bpe(&a).merges()[0], *best.0);

    let dir = temp_dir("bpe");
    let path = dir.join("tok.json");
    a.save(&path).unwrap();
    let back = Tokenizer::load(&path).unwrap();
    let probe = sample_text(120_000);
    let probe = &probe[100_000..];
    assert_eq!(back.encode(probe), a.encode(probe));
    assert_eq!(back.vocab_size(), 600);
}

#[test]
fn bpe_specials_and_small_inputs() {
    let text = "ab ab ab<|endoftext|>ab cd";
    let t = train_bpe_with_specials(text, 300, &["<|endoftext|>"]).unwrap();
    // Few distinct pairs: training stops early, vocab reports the truth.
    assert!(t.vocab_size() < 300);
    let eot = (t.vocab_size() - 1) as u32;
    let ids = t.encode("ab<|endoftext|>cd");
    assert!(ids.contains(&eot));
    assert_eq!(t.decode(&ids), "ab<|endoftext|>cd");
    assert!(train_bpe("", 300).is_err());
    let e = train_bpe("abc", 100).unwrap_err();
    assert!(e.to_string().contains("100"), "{e}");
}

/// A from-scratch trainer (recount everything every step) must pick the same merges as the
/// incremental one, and encoding must agree with applying the merges in order.
#[test]
fn bpe_matches_naive_reference() {
    let text = sample_text(30_000);
    let n_merges = 120;
    let mut freq: std::collections::BTreeMap<&str, u64> = Default::default();
    pre_split(&text, |w| *freq.entry(w).or_insert(0) += 1);
    let mut words: Vec<(Vec<u32>, u64)> = freq.iter().map(|(w, &c)| (w.bytes().map(u32::from).collect(), c)).collect();
    let mut naive = Vec::new();
    for step in 0..n_merges {
        let mut counts: std::collections::HashMap<(u32, u32), u64> = Default::default();
        for (w, c) in &words {
            for p in w.windows(2) {
                *counts.entry((p[0], p[1])).or_insert(0) += c;
            }
        }
        let (&best, _) = counts.iter().max_by_key(|(&p, &c)| (c, std::cmp::Reverse(p))).unwrap();
        naive.push(best);
        let id = 256 + step as u32;
        for (w, _) in &mut words {
            let mut out = Vec::with_capacity(w.len());
            let mut i = 0;
            while i < w.len() {
                if i + 1 < w.len() && (w[i], w[i + 1]) == best {
                    out.push(id);
                    i += 2;
                } else {
                    out.push(w[i]);
                    i += 1;
                }
            }
            *w = out;
        }
    }
    let t = train_bpe(&text, 256 + n_merges).unwrap();
    assert_eq!(bpe(&t).merges(), naive.as_slice());
    // Encoding the training text reproduces the words' final segmentation.
    let seg: std::collections::HashMap<&str, &Vec<u32>> = freq.keys().copied().zip(words.iter().map(|(w, _)| w)).collect();
    let mut expect = Vec::new();
    pre_split(&text, |w| expect.extend_from_slice(seg[w]));
    assert_eq!(t.encode(&text), expect);
}

/// `pre_split` against the real GPT-2 pattern (as tiktoken's r50k_base writes it), after the
/// same [`data::MAX_PIECE_BYTES`] cut.
#[test]
fn pre_split_agrees_with_the_gpt2_regex() {
    let re = fancy_regex::Regex::new(r"'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s").unwrap();
    let mut texts = vec![
        sample_text(200_000),
        "  x\t\ty  \n\n  'll 'LL ünï 12ab…  \r\n\r\n\tfn f<'a>(x: &'a str) -> Vec<u8> { x.bytes().collect() }\n\n\n   ".to_string(),
        "日本語のテキスト、句読点。 Ελληνικά  ١٢٣ 🎉🎉 a\u{00a0}b \u{2003}c".to_string(),
    ];
    texts.push(crate::prefix(&crate::rust_books().0, 300_000).to_string());
    for text in &texts {
        let mut expect: Vec<&str> = Vec::new();
        for m in re.find_iter(text) {
            let m = m.unwrap().as_str();
            let mut rest = m;
            while rest.len() > data::MAX_PIECE_BYTES {
                let mut cut = data::MAX_PIECE_BYTES;
                while !rest.is_char_boundary(cut) {
                    cut -= 1;
                }
                expect.push(&rest[..cut]);
                rest = &rest[cut..];
            }
            expect.push(rest);
        }
        let got = pieces(text);
        if got != expect {
            let i = got.iter().zip(&expect).position(|(a, b)| a != b).unwrap_or(got.len().min(expect.len()));
            panic!("first difference at piece {i}: ours {:?} vs regex {:?}", &got[i..(i + 3).min(got.len())], &expect[i..(i + 3).min(expect.len())]);
        }
    }
}
