//! `load`, `load_with` and `prepare`, including every error path.

use std::path::PathBuf;

use data::{load, load_with, prepare, read_shard, write_bin, Tokenizer};

use crate::{assert_names, shakespeare, shakespeare_path, temp_dir};

fn s(p: &std::path::Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn text_files_join_and_split_like_nanogpt() {
    let dir = temp_dir("text");
    std::fs::write(dir.join("a.txt"), "hello").unwrap();
    std::fs::write(dir.join("b.txt"), "world").unwrap();
    let paths = vec![dir.join("a.txt"), dir.join("b.txt")];
    let ds = load(&paths, "byte", 0.25).unwrap();
    let all: Vec<u32> = "hello\n\nworld".bytes().map(u32::from).collect();
    let n = all.len(); // 12
    let n_train = (n as f64 * 0.75) as usize;
    assert_eq!(ds.train.tokens.to_vec(), all[..n_train]);
    assert_eq!(ds.val.tokens.to_vec(), all[n_train..]);
    assert_eq!(ds.description, "2 files, 2 documents, 12 tokens (byte, vocab 256)");
    // Byte has no end-of-text token: the second document starts with the separator.
    assert_eq!(ds.train.docs.to_vec(), vec![0, 5, 9]);
    assert_eq!(ds.val.docs.to_vec(), vec![0, 3]);
    assert_eq!(ds.files, paths);
}

#[test]
fn tinyshakespeare_char_matches_nanogpt() {
    let text = shakespeare();
    let ds = load(&[shakespeare_path()], "char", 0.1).unwrap();
    assert_eq!(ds.tokenizer.vocab_size(), 65);
    // nanoGPT shakespeare_char: train has 1,003,854 tokens, val has 111,540.
    assert_eq!(text.len(), 1_115_394);
    assert_eq!((ds.train.len(), ds.val.len()), (1_003_854, 111_540));
    assert_eq!(ds.description, "1 file, 1 document, 1115394 tokens (char, vocab 65)");
}

#[test]
fn directories_walk_sorted_skip_hidden_and_binary() {
    let dir = temp_dir("walk");
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    std::fs::create_dir_all(dir.join(".git")).unwrap();
    std::fs::write(dir.join("b.txt"), "B").unwrap();
    std::fs::write(dir.join("sub/a.md"), "A").unwrap();
    std::fs::write(dir.join("a.txt"), "A0").unwrap();
    std::fs::write(dir.join(".hidden"), "H").unwrap();
    std::fs::write(dir.join(".git/config"), "G").unwrap();
    std::fs::write(dir.join("image.png"), [0x89u8, 0x50, 0xff, 0xfe]).unwrap();
    std::fs::write(dir.join("empty.txt"), "").unwrap();
    let ds = load(&[dir.clone()], "byte", 0.0).unwrap();
    assert_eq!(Tokenizer::Byte.decode(&ds.train.tokens.to_vec()), "A0\n\nB\n\nA");
    assert_eq!(ds.val.len(), 0);
    assert_eq!(ds.skipped, 2);
    assert_eq!(ds.files, vec![dir.join("a.txt"), dir.join("b.txt"), dir.join("sub/a.md")]);
    assert!(ds.description.contains("2 files skipped"), "{}", ds.description);
}

#[test]
fn token_files_bin_pair_and_mixed_inputs() {
    let dir = temp_dir("bins");
    let d = dir.join("nano");
    std::fs::create_dir_all(&d).unwrap();
    write_bin(&d.join("train.bin"), &[15496, 995, 50256]).unwrap();
    write_bin(&d.join("val.bin"), &[11]).unwrap();
    std::fs::write(d.join("meta.pkl"), [0x80u8, 4]).unwrap();
    let ds = load(&[d.clone()], "gpt2", 0.1).unwrap();
    assert_eq!((ds.train.tokens.to_vec(), ds.val.tokens.to_vec()), (vec![15496, 995, 50256], vec![11]));
    assert!(ds.train.tokens.is_mapped());
    // `auto` on token files means gpt2.
    assert_eq!(load(&[d.clone()], "auto", 0.1).unwrap().tokenizer.kind(), "gpt2");

    // A single .bin with no split: mapped, split by views.
    let one = d.join("train.bin");
    let ds = load(&[one.clone()], "gpt2", 0.34).unwrap();
    assert!(ds.train.tokens.is_mapped());
    assert_eq!((ds.train.len(), ds.val.len()), (1, 2));

    // Text + token file: stream order follows the paths.
    let txt = dir.join("t.txt");
    std::fs::write(&txt, "Hello world").unwrap();
    let ds = load(&[txt.clone(), one.clone()], "gpt2", 0.0).unwrap();
    // The text document ends with GPT-2's end-of-text; the token file is taken as it is.
    assert_eq!(ds.train.tokens.to_vec(), vec![15496, 995, 50256, 15496, 995, 50256]);
    assert_eq!(ds.train.docs.to_vec(), vec![0, 3, 6]);
    assert_eq!(ds.description, "2 files, 2 documents, 6 tokens (gpt2, vocab 50257)");

    // A split directory cannot be mixed with other inputs.
    assert_names(load(&[d.clone(), txt], "gpt2", 0.1).unwrap_err(), s(&d));
}

#[test]
fn prepare_then_load_round_trips() {
    let dir = temp_dir("prep");
    let src = dir.join("corpus.txt");
    let text = "First Citizen:\nBefore we proceed any further, hear me speak.\n".repeat(50);
    std::fs::write(&src, &text).unwrap();
    let out = dir.join("prepared");
    let rep = prepare(&[src.clone()], "char", &out, 0.1).unwrap();
    assert_eq!(rep.train_tokens + rep.val_tokens, text.chars().count());
    assert_eq!(rep.tokenizer, "char");
    for f in ["train.tok", "val.tok", "kiln-tokenizer.json", "meta.json"] {
        assert!(out.join(f).is_file(), "{f} missing");
    }
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["tokenizer"], "char");
    assert_eq!(meta["train_tokens"], rep.train_tokens);
    assert_eq!(meta["sources"][0], s(&src));

    let direct = load(&[src.clone()], "char", 0.1).unwrap();
    assert!(!out.join("tokenizer.json").exists(), "kiln's own kinds never write tokenizer.json");
    for spec in ["auto", "char", s(&out.join("kiln-tokenizer.json"))] {
        let ds = load(&[out.clone()], spec, 0.5).unwrap();
        assert_eq!(ds.tokenizer, direct.tokenizer, "{spec}");
        assert_eq!(ds.train.tokens.to_vec(), direct.train.tokens.to_vec(), "{spec}: own split wins over val_fraction");
        assert_eq!(ds.val.tokens.to_vec(), direct.val.tokens.to_vec());
        assert!(ds.train.tokens.is_mapped());
    }
    let again = load_with(&[out.clone()], direct.tokenizer.clone(), 0.1).unwrap();
    assert_eq!(again.val.len(), rep.val_tokens);
    let (t, v) = read_shard(&out.join("train.tok")).unwrap();
    assert_eq!((t.len(), v), (rep.train_tokens, direct.tokenizer.vocab_size()));

    // gpt2 prepare writes u16 shards; byte too.
    let out2 = dir.join("prepared-gpt2");
    let rep = prepare(&[src.clone()], "gpt2", &out2, 0.1).unwrap();
    let size = std::fs::metadata(out2.join("train.tok")).unwrap().len();
    assert_eq!(size, 32 + 2 * rep.train_tokens as u64);

    // Refuses to overwrite its own input.
    assert_names(prepare(&[out2.clone()], "auto", &out2, 0.1).unwrap_err(), s(&out2));
}

#[test]
fn load_with_checks_char_vocab_and_ids() {
    let dir = temp_dir("with");
    let txt = dir.join("t.txt");
    std::fs::write(&txt, "abcz").unwrap();
    let tok = Tokenizer::from_spec("char", Some("abc")).unwrap();
    let msg = assert_names(load_with(&[txt.clone()], tok.clone(), 0.1).unwrap_err(), s(&txt));
    assert!(msg.contains("'z'"), "{msg}");
    // A char tokenizer given whole can read token files.
    let bin = dir.join("t.bin");
    write_bin(&bin, &[0, 1, 2, 2]).unwrap();
    let ds = load_with(&[bin.clone()], tok.clone(), 0.25).unwrap();
    assert_eq!(ds.tokenizer.decode(&ds.train.tokens.to_vec()), "abc");
    write_bin(&bin, &[0, 1, 7]).unwrap();
    let msg = assert_names(load_with(&[bin.clone()], tok, 0.25).unwrap_err(), s(&bin));
    assert!(msg.contains("index 2") && msg.contains(" 7,") || msg.contains("is 7"), "{msg}");
}

#[test]
fn load_errors_name_the_path() {
    let dir = temp_dir("errs");
    let missing = dir.join("missing.txt");
    assert_names(load(&[missing.clone()], "byte", 0.1).unwrap_err(), s(&missing));

    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let msg = assert_names(load(&[empty.clone()], "byte", 0.1).unwrap_err(), s(&empty));
    assert!(msg.contains("empty"), "{msg}");

    let binary = dir.join("blob.dat");
    std::fs::write(&binary, [0xffu8, 0xfe, 0x00]).unwrap();
    let msg = assert_names(load(&[binary.clone()], "byte", 0.1).unwrap_err(), s(&binary));
    assert!(msg.contains("UTF-8"), "{msg}");

    let empty_dir = dir.join("nothing");
    std::fs::create_dir_all(&empty_dir).unwrap();
    std::fs::write(empty_dir.join("e.txt"), "").unwrap();
    let msg = assert_names(load(&[empty_dir.clone()], "byte", 0.1).unwrap_err(), s(&empty_dir));
    assert!(msg.contains("no tokens"), "{msg}");

    let npy = dir.join("bad.npy");
    std::fs::write(&npy, b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f4'").unwrap();
    assert_names(load(&[npy.clone()], "gpt2", 0.1).unwrap_err(), s(&npy));

    // Token id >= vocab: names the file, the index and the id.
    let bin = dir.join("big.bin");
    write_bin(&bin, &[1, 2, 300]).unwrap();
    let msg = assert_names(load(&[bin.clone()], "byte", 0.1).unwrap_err(), s(&bin));
    assert!(msg.contains("index 2") && msg.contains("300") && msg.contains("256"), "{msg}");

    // Token file with "char": char needs text.
    let msg = assert_names(load(&[bin.clone()], "char", 0.1).unwrap_err(), s(&bin));
    assert!(msg.contains("char"), "{msg}");

    // Prepared dir whose tokenizer disagrees with the spec.
    let src = dir.join("src.txt");
    std::fs::write(&src, "some text for a byte tokenizer").unwrap();
    let out = dir.join("prep");
    prepare(&[src.clone()], "byte", &out, 0.2).unwrap();
    for spec in ["gpt2", "char"] {
        let msg = assert_names(load(&[out.clone()], spec, 0.1).unwrap_err(), s(&out));
        assert!(msg.contains("byte"), "{msg}");
    }
    let msg = assert_names(load_with(&[out.clone()], Tokenizer::from_spec("gpt2", None).unwrap(), 0.1).unwrap_err(), s(&out));
    assert!(msg.contains("gpt2"), "{msg}");

    // A prepared dir with a damaged shard or meta.
    let bytes = std::fs::read(out.join("train.tok")).unwrap();
    std::fs::write(out.join("train.tok"), &bytes[..bytes.len() - 3]).unwrap();
    let msg = assert_names(load(&[out.clone()], "auto", 0.1).unwrap_err(), s(&out.join("train.tok")));
    assert!(msg.contains("expected"), "{msg}");
    std::fs::write(out.join("meta.json"), "{not json").unwrap();
    assert_names(load(&[out.clone()], "auto", 0.1).unwrap_err(), s(&out.join("meta.json")));

    // Bad arguments.
    assert_names(load(&[src.clone()], "byte", 1.0).unwrap_err(), "val_fraction 1");
    assert_names(load(&[src.clone()], "nosuchtokenizer", 0.1).unwrap_err(), "nosuchtokenizer");
    assert!(load(&Vec::<PathBuf>::new(), "byte", 0.1).is_err());
}

/// Regression: the char vocab must come from the joined stream, which adds "\n\n" between
/// files even when no file contains a newline.
#[test]
fn char_vocab_covers_the_join_separator() {
    let dir = temp_dir("charjoin");
    let (a, b) = (dir.join("a.txt"), dir.join("b.txt"));
    std::fs::write(&a, "ab").unwrap();
    std::fs::write(&b, "cd").unwrap();
    let ds = load(&[a, b], "char", 0.0).unwrap();
    assert_eq!(ds.tokenizer.vocab_size(), 5);
    assert_eq!(ds.tokenizer.decode(&ds.train.tokens.to_vec()), "ab\n\ncd");
}

#[test]
fn bpe_spec_trains_on_the_text_and_round_trips_through_prepare() {
    let dir = temp_dir("bpespec");
    let src = dir.join("c.txt");
    std::fs::write(&src, crate::sample_text(50_000)).unwrap();
    let ds = load(&[src.clone()], "bpe:400", 0.1).unwrap();
    assert_eq!((ds.tokenizer.kind(), ds.tokenizer.vocab_size()), ("hf", 400));
    assert!(ds.train.len() + ds.val.len() < 50_000 * 2 / 3);
    let out = dir.join("prep");
    prepare(&[src.clone()], "bpe:400", &out, 0.1).unwrap();
    for spec in ["bpe:400", "auto", s(&out)] {
        let again = load(&[out.clone()], spec, 0.1).unwrap();
        assert_eq!(again.tokenizer, ds.tokenizer, "{spec}");
        assert_eq!(again.train.tokens.to_vec(), ds.train.tokens.to_vec());
    }
    let msg = assert_names(load(&[out.clone()], "bpe:512", 0.1).unwrap_err(), s(&out));
    assert!(msg.contains("bpe:512"), "{msg}");
    assert_names(load(&[src.clone()], "bpe:lots", 0.1).unwrap_err(), "bpe:lots");
    let bin = dir.join("t.bin");
    write_bin(&bin, &[1, 2, 3]).unwrap();
    assert_names(load(&[bin.clone()], "bpe:300", 0.1).unwrap_err(), s(&bin));
}

#[test]
fn load_with_char_without_newline_cannot_join_files() {
    let dir = temp_dir("charnl");
    let (a, b) = (dir.join("a.txt"), dir.join("b.txt"));
    std::fs::write(&a, "ab").unwrap();
    std::fs::write(&b, "ba").unwrap();
    let tok = Tokenizer::from_spec("char", Some("ab")).unwrap();
    assert_eq!(load_with(&[a.clone()], tok.clone(), 0.0).unwrap().train.len(), 2);
    assert_names(load_with(&[a, b.clone()], tok, 0.0).unwrap_err(), s(&b));
}
