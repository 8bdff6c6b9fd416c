//! Real Hugging Face `tokenizer.json` files (`../shared/fixtures/tokenizers`): for every hard case,
//! kiln's ids are exactly the ids the `tokenizers` library gave, and decoding gives its text.

use data::Tokenizer;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/tokenizers")).join(name)
}

struct Case {
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

fn cases(name: &str) -> Vec<Case> {
    let p = fixture(name).join("cases.json");
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("fixture {} not readable: {e}", p.display()));
    let v: Vec<serde_json::Value> = serde_json::from_str(&s).unwrap();
    v.iter()
        .map(|c| Case {
            text: c["text"].as_str().unwrap().to_string(),
            ids: c["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect(),
            decoded: c["decoded"].as_str().unwrap().to_string(),
        })
        .collect()
}

fn check(name: &str, vocab: usize) -> Tokenizer {
    // Both a file and its directory name the tokenizer.
    let tok = Tokenizer::from_spec(fixture(name).join("tokenizer.json").to_str().unwrap(), None).unwrap();
    assert_eq!(tok, Tokenizer::from_spec(fixture(name).to_str().unwrap(), None).unwrap());
    assert_eq!((tok.kind(), tok.vocab_size()), ("hf", vocab), "{name}");
    let cases = cases(name);
    assert!(cases.len() >= 15, "{name}: {} cases", cases.len());
    for c in &cases {
        assert_eq!(tok.encode(&c.text).unwrap(), c.ids, "{name}: ids of {:?}", c.text);
        assert_eq!(tok.decode(&c.ids), c.decoded, "{name}: decoding {:?}", c.text);
    }
    tok
}

#[test]
fn gpt2_tokenizer_json_gives_the_library_ids_and_agrees_with_tiktoken() {
    check("gpt2", 50257);
    let tiktoken = Tokenizer::from_spec("gpt2", None).unwrap();
    for c in cases("gpt2") {
        assert_eq!(tiktoken.encode(&c.text).unwrap(), c.ids, "tiktoken on {:?}", c.text);
    }
}

#[test]
fn qwen2_tokenizer_json_gives_the_library_ids() {
    let tok = check("qwen2", 151646);
    let Tokenizer::Hf(h) = &tok else { unreachable!() };
    let specials: Vec<String> = h.special_tokens().into_iter().map(|(_, t)| t).collect();
    for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
        assert!(specials.iter().any(|t| t == s), "{s} not among {specials:?}");
    }
    // Byte-level BPE is lossless: decode ∘ encode is the identity on every case.
    for c in cases("qwen2") {
        assert_eq!(c.decoded, c.text);
    }
}

#[test]
fn sentencepiece_bpe_with_byte_fallback_gives_the_library_ids() {
    let tok = check("sp-bpe", 2000);
    // Byte fallback: a character never seen in training becomes its UTF-8 bytes (<0xNN>),
    // after the `▁` the normalizer prepends.
    let Tokenizer::Hf(h) = &tok else { unreachable!() };
    let ids = tok.encode("🙂").unwrap();
    let bytes: Vec<u32> = ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"].iter().map(|b| h.token_to_id(b).unwrap()).collect();
    assert_eq!(ids[..], [&[h.token_to_id("▁").unwrap()], &bytes[..]].concat()[..], "{ids:?}");
    assert_eq!(tok.decode(&ids).trim_start(), "🙂");
}

#[test]
fn a_file_that_is_no_tokenizer_is_refused_by_name() {
    let dir = crate::temp_dir("hfbad");
    let p = dir.join("tokenizer.json");
    std::fs::write(&p, r#"{"version": "1.0", "model": {"type": "Nonsense"}}"#).unwrap();
    let msg = crate::assert_names(Tokenizer::load(&p).unwrap_err(), p.to_str().unwrap());
    assert!(msg.contains("Hugging Face"), "{msg}");
    std::fs::write(&p, r#"{"vocab": {}}"#).unwrap();
    crate::assert_names(Tokenizer::load(&p).unwrap_err(), p.to_str().unwrap());
    std::fs::write(&p, "not json").unwrap();
    crate::assert_names(Tokenizer::load(&p).unwrap_err(), p.to_str().unwrap());
    let empty = crate::temp_dir("hfnone");
    crate::assert_names(Tokenizer::from_spec(empty.to_str().unwrap(), None).unwrap_err(), empty.to_str().unwrap());
}

/// kiln's own tokenizers in Hugging Face form (`Tokenizer::to_hf`, what `kiln export` writes):
/// GPT-2's is the fixture's converted r50k tokenizer (the same vocabulary, the same merges in
/// the same order, the same pre-tokenizer and special token), so the library gives the
/// fixture's ids; byte and char give kiln's ids and decodings for every hard case and for a
/// text with characters outside a char vocabulary (dropped by both).
#[test]
fn kiln_tokenizers_have_a_hugging_face_form_with_the_same_ids() {
    let fx: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("gpt2").join("tokenizer.json")).unwrap()).unwrap();
    let gpt2 = Tokenizer::from_spec("gpt2", None).unwrap();
    let h = gpt2.to_hf();
    let ours: serde_json::Value = serde_json::from_str(h.json()).unwrap();
    for key in ["pre_tokenizer", "added_tokens", "normalizer", "post_processor"] {
        assert_eq!(ours[key], fx[key], "gpt2: {key}");
    }
    for key in ["vocab", "merges", "ignore_merges", "byte_fallback", "unk_token"] {
        assert_eq!(ours["model"][key], fx["model"][key], "gpt2: model.{key}");
    }
    let hf = Tokenizer::Hf(h);
    let mut texts: Vec<String> = cases("gpt2").into_iter().map(|c| c.text).collect();
    texts.push("naïve café — 東京 🦀 <|endoftext|> x\r\n\tq".to_string());
    for t in &texts {
        assert_eq!(hf.encode(t).unwrap(), gpt2.encode(t).unwrap(), "gpt2 in HF form: ids of {t:?}");
        let ids = gpt2.encode(t).unwrap();
        assert_eq!(hf.decode(&ids), gpt2.decode(&ids), "gpt2 in HF form: decoding {t:?}");
    }
    let corpus = texts.concat();
    let char_tok = Tokenizer::from_spec("char", Some(&texts[..texts.len() / 2].concat())).unwrap();
    for kiln in [Tokenizer::from_spec("byte", None).unwrap(), char_tok] {
        let hf = Tokenizer::Hf(kiln.to_hf());
        assert_eq!(hf.vocab_size(), kiln.vocab_size(), "{}", kiln.kind());
        for t in texts.iter().chain([&corpus]) {
            let ids = kiln.encode(t).unwrap();
            assert_eq!(hf.encode(t).unwrap(), ids, "{} in HF form: ids of {t:?}", kiln.kind());
            assert_eq!(hf.decode(&ids), kiln.decode(&ids), "{} in HF form: decoding {t:?}", kiln.kind());
        }
    }
}
