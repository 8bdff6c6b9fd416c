//! `bpe:N` / `kiln tokenizer train`: a byte-level BPE trained through the `tokenizers` crate,
//! stored as a Hugging Face tokenizer.json.

use data::{train_bpe, Tokenizer};

use crate::{sample_text, temp_dir};

fn hf(t: &Tokenizer) -> &data::HfTokenizer {
    match t {
        Tokenizer::Hf(h) => h,
        other => panic!("expected a Hugging Face tokenizer, got {}", other.kind()),
    }
}

#[test]
fn bpe_trains_to_requested_vocab_round_trips_and_compresses() {
    let text = sample_text(300_000);
    let cut = crate::prefix(&text, text.len() - 20_000).len();
    let (train, unseen) = text.split_at(cut);
    let t = Tokenizer::Hf(train_bpe(train, 1024, &[]).unwrap());
    assert_eq!(t.vocab_size(), 1024);
    assert_eq!(hf(&t).model_type(), "BPE");
    // Exact round trip on text not seen in training, including chars never seen at all.
    let extra = format!("{unseen}\nZebra-crossing ünïcödé 日本 🎉 x=y+1;\r\n\t\t}}");
    let ids = t.encode(&extra).unwrap();
    assert_eq!(t.decode(&ids), extra);
    assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
    // Compression: English at vocab 1024 should be well under half a token per byte.
    let ratio = unseen.len() as f64 / t.encode(unseen).unwrap().len() as f64;
    assert!(ratio > 2.3, "only {ratio:.2} bytes per token");
}

#[test]
fn bpe_is_deterministic_saves_as_a_hugging_face_file_and_loads_back() {
    let text = sample_text(100_000);
    let a = Tokenizer::Hf(train_bpe(&text, 600, &[]).unwrap());
    let b = Tokenizer::Hf(train_bpe(&text, 600, &[]).unwrap());
    assert_eq!(a.to_json(), b.to_json());
    let dir = temp_dir("bpe");
    let path = a.save_in(&dir).unwrap();
    assert_eq!(path.file_name().unwrap(), "tokenizer.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(v["model"]["type"], "BPE");
    assert_eq!(v["pre_tokenizer"]["type"], "ByteLevel");
    let back = Tokenizer::load(&path).unwrap();
    assert_eq!(back, a);
    let probe = sample_text(120_000);
    let probe = &probe[100_000..];
    assert_eq!(back.encode(probe).unwrap(), a.encode(probe).unwrap());
    assert_eq!(back.vocab_size(), 600);
    assert_eq!(Tokenizer::find_in(&dir).unwrap(), Some(a));
}

#[test]
fn bpe_specials_and_small_inputs() {
    let text = "ab ab ab<|endoftext|>ab cd";
    let t = Tokenizer::Hf(train_bpe(text, 300, &["<|endoftext|>"]).unwrap());
    // Few distinct pairs: training stops early, vocab reports the truth.
    assert!(t.vocab_size() < 300, "{}", t.vocab_size());
    let eot = hf(&t).token_to_id("<|endoftext|>").unwrap();
    assert_eq!(hf(&t).special_tokens(), vec![(eot, "<|endoftext|>".to_string())]);
    let ids = t.encode("ab<|endoftext|>cd").unwrap();
    assert!(ids.contains(&eot));
    assert_eq!(t.decode(&ids), "ab<|endoftext|>cd");
    // An id outside the vocabulary decodes to U+FFFD, the rest as usual.
    assert_eq!(t.decode(&[ids[0], 99_999, ids[0]]), format!("{0}\u{FFFD}{0}", t.decode(&ids[..1])));
    assert!(train_bpe("", 300, &[]).is_err());
    let e = train_bpe("abc", 100, &[]).unwrap_err();
    assert!(e.to_string().contains("100"), "{e}");
}
