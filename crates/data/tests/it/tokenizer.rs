use std::path::Path;

use data::Tokenizer;

use crate::{assert_names, shakespeare, temp_dir};

const SAMPLE: &str = "Hello, world! Ünïcödé — 日本語 🎉\n\tTabs  and  spaces.\n";

#[test]
fn byte_round_trip() {
    let t = Tokenizer::from_spec("byte", None).unwrap();
    assert_eq!(t.vocab_size(), 256);
    assert_eq!(t.kind(), "byte");
    let ids = t.encode(SAMPLE).unwrap();
    assert_eq!(ids.len(), SAMPLE.len());
    assert_eq!(&ids[..5], &[72, 101, 108, 108, 111]);
    assert_eq!(t.decode(&ids), SAMPLE);
    // Lossy, never panics: a cut multi-byte char and an id out of range.
    assert_eq!(t.decode(&[0xE6, 104, 1000]), "\u{FFFD}h\u{FFFD}");
}

#[test]
fn char_round_trip_and_vocab() {
    let t = Tokenizer::from_spec("char", Some("hello world")).unwrap();
    assert_eq!(t.kind(), "char");
    assert_eq!(t.vocab_size(), 8); // " dehlorw"
    assert_eq!(t.encode("hello").unwrap(), vec![3, 2, 4, 4, 5]);
    assert_eq!(t.decode(&t.encode("hello world").unwrap()), "hello world");
    assert_eq!(t.decode(&[99]), "\u{FFFD}");
    let err = Tokenizer::from_spec("char", None).unwrap_err();
    assert!(err.to_string().contains("char"), "{err}");
}

#[test]
fn char_vocab_of_tinyshakespeare_is_65() {
    let text = shakespeare();
    let t = Tokenizer::from_spec("char", Some(&text)).unwrap();
    assert_eq!(t.vocab_size(), 65);
    // nanoGPT's shakespeare_char: stoi['\n'] = 0, stoi[' '] = 1, stoi['a'] = 39.
    assert_eq!(t.encode("\n a").unwrap(), vec![0, 1, 39]);
    let ids = t.encode(&text[..10_000]).unwrap();
    assert_eq!(t.decode(&ids), &text[..10_000]);
}

#[test]
fn gpt2_known_ids_and_round_trip() {
    let t = Tokenizer::from_spec("gpt2", None).unwrap();
    assert_eq!(t.vocab_size(), 50257);
    assert_eq!(t.encode("Hello world").unwrap(), vec![15496, 995]);
    assert_eq!(t.encode("Hello world<|endoftext|>").unwrap(), vec![15496, 995, 50256]);
    assert_eq!(t.decode(&t.encode(SAMPLE).unwrap()), SAMPLE);
    assert_eq!(t.decode(&[15496, 60000, 995]), "Hello\u{FFFD} world");
}

#[test]
fn json_save_load_for_every_kind() {
    let dir = temp_dir("tokjson");
    let tokenizers = [
        Tokenizer::Byte,
        Tokenizer::from_spec("char", Some("abc\n")).unwrap(),
        Tokenizer::from_spec("gpt2", None).unwrap(),
        Tokenizer::Hf(data::train_bpe(&crate::sample_text(20_000), 300, &["<|endoftext|>"]).unwrap()),
    ];
    for t in tokenizers {
        let j = t.to_json();
        if t.kind() == "hf" {
            assert!(j.contains("\"model\""), "{j}");
            assert_eq!((t.file_name(), Tokenizer::file_name_of_json(&j)), ("tokenizer.json", "tokenizer.json"));
        } else {
            assert!(j.contains(&format!("\"kind\":\"{}\"", t.kind())), "{j}");
            assert_eq!((t.file_name(), Tokenizer::file_name_of_json(&j)), ("kiln-tokenizer.json", "kiln-tokenizer.json"));
        }
        let path = dir.join(format!("{}.json", t.kind()));
        t.save(&path).unwrap();
        let back = Tokenizer::load(&path).unwrap();
        assert_eq!(back, t);
        let via_spec = Tokenizer::from_spec(path.to_str().unwrap(), None).unwrap();
        assert_eq!(via_spec.encode(SAMPLE).unwrap(), t.encode(SAMPLE).unwrap());
        assert_eq!(via_spec.vocab_size(), t.vocab_size());
    }
    assert_eq!(Tokenizer::Byte.to_json(), r#"{"kind":"byte"}"#);
    assert_eq!(Tokenizer::from_spec("gpt2", None).unwrap().to_json(), r#"{"kind":"gpt2"}"#);
}

#[test]
fn tokenizer_errors_name_the_file() {
    let dir = temp_dir("tokerr");
    let p = dir.join("bad.json");
    std::fs::write(&p, r#"{"kind":"wordpiece"}"#).unwrap();
    assert_names(Tokenizer::load(&p).unwrap_err(), p.to_str().unwrap());
    // kiln's own format had a `bpe` kind; that is a Hugging Face tokenizer.json now.
    std::fs::write(&p, r#"{"kind":"bpe","pattern":"gpt2","merges":[[256,1]],"specials":[]}"#).unwrap();
    assert_names(Tokenizer::load(&p).unwrap_err(), p.to_str().unwrap());
    std::fs::write(&p, r#"{"kind":"char","chars":"aba"}"#).unwrap();
    assert_names(Tokenizer::load(&p).unwrap_err(), p.to_str().unwrap());
    let missing = dir.join("missing.json");
    assert_names(Tokenizer::load(&missing).unwrap_err(), missing.to_str().unwrap());
    assert_names(Tokenizer::from_spec("nonsense", None).unwrap_err(), "nonsense");
    assert_names(Tokenizer::from_json("{", Path::new("run/tokenizer.json")).unwrap_err(), "run/tokenizer.json");
}
