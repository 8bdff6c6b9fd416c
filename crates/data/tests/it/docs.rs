//! Documents from jsonl (plain, gzip, zstd) and parquet, each tokenized on its own with BOS/EOS,
//! against the ids the Python `tokenizers` library gives (`tests/fixtures/docs/make.py`); chat
//! and prompt/completion documents against transformers' `apply_chat_template`; and every bad
//! input naming its file, line, row or field with nothing written.

use std::path::{Path, PathBuf};

use data::{load_docs, prepare_with, DocFormat, DocOpts, Split, Tokenizer, TokenizerChoice};

use crate::temp_dir;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/docs")).join(name)
}

fn tokenizer_dir(name: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/tokenizers")).join(name)
}

fn json(name: &str) -> serde_json::Value {
    let p = fixture(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("fixture {} not readable: {e}", p.display()))).unwrap()
}

fn ids_of(v: &serde_json::Value) -> Vec<Vec<u32>> {
    v.as_array().unwrap().iter().map(|d| d.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()).collect()
}

/// Every document of a split as its ids.
fn documents(s: &Split) -> Vec<Vec<u32>> {
    (0..s.docs.len()).map(|d| {
        let r = s.docs.range(d);
        let mut v = vec![0; r.len()];
        s.tokens.copy_to(r.start, &mut v);
        v
    }).collect()
}

fn mask_of(s: &Split, d: usize) -> Vec<u32> {
    let r = s.docs.range(d);
    let mut v = vec![0; r.len()];
    s.mask.as_ref().expect("a loss mask").copy_to(r.start, &mut v);
    v
}

fn opts(format: DocFormat) -> DocOpts {
    DocOpts { text_field: "text".into(), format }
}

fn prepare(input: &Path, tok: &str, out: &Path, frac: f64, o: &DocOpts) -> Result<data::PrepareReport, data::DataError> {
    prepare_with(&[input.to_path_buf()], tok, out, frac, o, &mut |_| {})
}

#[test]
fn prepare_jsonl_gz_zst_and_parquet_gives_the_library_ids_plus_eos() {
    let expected = json("expected.json");
    for name in ["qwen2", "sp-bpe"] {
        let want = ids_of(&expected[name]);
        let tok = tokenizer_dir(name);
        for file in ["docs.jsonl", "docs.jsonl.gz", "docs.jsonl.zst", "docs.parquet"] {
            let out = temp_dir("prep-docs");
            let rep = prepare(&fixture(file), tok.to_str().unwrap(), &out, 0.0, &DocOpts::default()).unwrap();
            assert_eq!(rep.documents, want.len(), "{name} {file}");
            let ds = load_docs(&[out.clone()], TokenizerChoice::Spec("auto"), 0.0, &DocOpts::default()).unwrap();
            assert_eq!(documents(&ds.train), want, "{name} {file}");
            assert!(ds.train.tokens.is_mapped() && ds.val.is_empty());
            // The prepared directory carries the tokenizer's config (its BOS/EOS) beside it.
            assert!(out.join("tokenizer_config.json").is_file());
            // Loading the file directly gives the same documents.
            let direct = load_docs(&[fixture(file)], TokenizerChoice::Spec(tok.to_str().unwrap()), 0.0, &DocOpts::default()).unwrap();
            assert_eq!(documents(&direct.train), want, "{name} {file} direct");
        }
    }
}

#[test]
fn the_validation_split_is_the_tail_and_cuts_a_document_in_two() {
    let tok = tokenizer_dir("sp-bpe");
    let docs = ids_of(&json("expected.json")["sp-bpe"]);
    let want: Vec<u32> = docs.concat();
    let out = temp_dir("prep-split");
    let rep = prepare(&fixture("docs.jsonl"), tok.to_str().unwrap(), &out, 0.3, &DocOpts::default()).unwrap();
    let ds = load_docs(&[out.clone()], TokenizerChoice::Spec("auto"), 0.0, &DocOpts::default()).unwrap();
    let n = want.len();
    let cut = (n as f64 * 0.7) as usize;
    assert_eq!((rep.train_tokens, rep.val_tokens), (cut, n - cut));
    assert_eq!(ds.train.tokens.to_vec(), want[..cut]);
    assert_eq!(ds.val.tokens.to_vec(), want[cut..]);
    // Boundaries are kept on both sides, a cut inside a document adding one.
    let ends: Vec<usize> = docs.iter().scan(0, |s, d| { *s += d.len(); Some(*s) }).collect();
    assert_eq!(ds.train.docs.len() + ds.val.docs.len(), rep.documents + !ends.contains(&cut) as usize);
    assert_eq!(ds.train.docs.to_vec().last(), Some(&(cut as u64)));
    // No intermediate files are left behind.
    let mut names: Vec<String> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["meta.json", "tokenizer.json", "tokenizer_config.json", "train.docs", "train.tok", "val.docs", "val.tok"]);
}

#[test]
fn a_hugging_face_dataset_directory_reads_its_parquet_files_only() {
    let dir = temp_dir("hfds");
    std::fs::create_dir_all(dir.join("data")).unwrap();
    std::fs::write(dir.join("README.md"), "---\nlicense: mit\n---\n# A dataset card, not a document\n").unwrap();
    std::fs::copy(fixture("docs.parquet"), dir.join("data/train-00000-of-00002.parquet")).unwrap();
    std::fs::copy(fixture("docs.parquet"), dir.join("data/train-00001-of-00002.parquet")).unwrap();
    let tok = tokenizer_dir("qwen2");
    let ds = load_docs(&[dir.clone()], TokenizerChoice::Spec(tok.to_str().unwrap()), 0.0, &DocOpts::default()).unwrap();
    let want = ids_of(&json("expected.json")["qwen2"]);
    assert_eq!(documents(&ds.train), [want.clone(), want].concat());
    assert_eq!(ds.skipped, 1);
}

#[test]
fn a_custom_text_field_is_read() {
    let dir = temp_dir("field");
    let p = dir.join("c.jsonl");
    std::fs::write(&p, "{\"body\": \"ab\"}\n\n{\"body\": \"c\"}\n").unwrap();
    let o = DocOpts { text_field: "body".into(), format: DocFormat::Text };
    let ds = load_docs(&[p], TokenizerChoice::Spec("gpt2"), 0.0, &o).unwrap();
    assert_eq!(documents(&ds.train), vec![vec![397, 50256], vec![66, 50256]]);
}

#[test]
fn chat_documents_are_apply_chat_template_ids_with_loss_on_the_assistant_turns() {
    let sft = json("sft.json");
    let tok = Tokenizer::from_spec(tokenizer_dir("qwen2").to_str().unwrap(), None).unwrap();
    let Tokenizer::Hf(h) = &tok else { panic!("an HF tokenizer") };
    let template = h.config().template.as_ref().expect("qwen2 has a chat template");
    for (i, line) in std::fs::read_to_string(fixture("chat.jsonl")).unwrap().lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let (text, _) = template.render_spans(&v["messages"]).unwrap();
        assert_eq!(text, sft["chat_text"][i].as_str().unwrap(), "chat {i} renders as transformers does");
    }
    let ds = load_docs(&[fixture("chat.jsonl")], TokenizerChoice::Given(tok.clone()), 0.0, &opts(DocFormat::Chat)).unwrap();
    assert_eq!(documents(&ds.train), ids_of(&sft["chat_ids"]));
    let masks = ids_of(&sft["chat_mask"]);
    for (d, m) in masks.iter().enumerate() {
        assert_eq!(&mask_of(&ds.train, d), m, "chat {d}");
    }
    // Prompt/completion: the prompt's ids then the completion's and the EOS, loss on the latter.
    let ds = load_docs(&[fixture("pairs.jsonl")], TokenizerChoice::Given(tok), 0.0, &opts(DocFormat::PromptCompletion)).unwrap();
    assert_eq!(documents(&ds.train), ids_of(&sft["pair_ids"]));
    for (d, m) in ids_of(&sft["pair_mask"]).iter().enumerate() {
        assert_eq!(&mask_of(&ds.train, d), m, "pair {d}");
    }
    // Through prepare: the mask is stored and read back.
    let out = temp_dir("prep-chat");
    prepare(&fixture("chat.jsonl"), tokenizer_dir("qwen2").to_str().unwrap(), &out, 0.0, &opts(DocFormat::Chat)).unwrap();
    let back = load_docs(&[out.clone()], TokenizerChoice::Spec("auto"), 0.0, &DocOpts::default()).unwrap();
    for (d, m) in masks.iter().enumerate() {
        assert_eq!(&mask_of(&back.train, d), m, "prepared chat {d}");
    }
    // Split 50/50, the middle chat is cut in two but still one document.
    let half = temp_dir("prep-chat-half");
    prepare(&fixture("chat.jsonl"), tokenizer_dir("qwen2").to_str().unwrap(), &half, 0.5, &opts(DocFormat::Chat)).unwrap();
    let back = load_docs(&[half], TokenizerChoice::Spec("auto"), 0.0, &DocOpts::default()).unwrap();
    assert_eq!(back.train.docs.len() + back.val.docs.len(), masks.len() + 1, "the split cuts a chat");
    assert!(back.description.contains(&format!("{} documents", masks.len())), "{}", back.description);
    // ShareGPT rows (conversations of {from, value}) are the same chats.
    let share = temp_dir("sharegpt").join("share.jsonl");
    let rows: String = std::fs::read_to_string(fixture("chat.jsonl")).unwrap().lines().map(|l| {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        let conv: Vec<serde_json::Value> = v["messages"].as_array().unwrap().iter().map(|m| {
            let from = match m["role"].as_str().unwrap() { "user" => "human", "assistant" => "gpt", r => r };
            serde_json::json!({"from": from, "value": m["content"]})
        }).collect();
        serde_json::json!({"conversations": conv}).to_string() + "\n"
    }).collect();
    std::fs::write(&share, rows).unwrap();
    let tok = Tokenizer::from_spec(tokenizer_dir("qwen2").to_str().unwrap(), None).unwrap();
    let ds = load_docs(&[share], TokenizerChoice::Given(tok), 0.0, &opts(DocFormat::Chat)).unwrap();
    assert_eq!(documents(&ds.train), ids_of(&sft["chat_ids"]), "ShareGPT rows");
    // A model directory as transformers 5 saves it: the template in chat_template.jinja, none in
    // tokenizer_config.json. The same ids; and a prepared set keeps the file.
    let dir = temp_dir("tf5-tokenizer");
    let src = tokenizer_dir("qwen2");
    std::fs::copy(src.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer_config.json")).unwrap()).unwrap();
    let source = cfg.as_object_mut().unwrap().remove("chat_template").unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), source.as_str().unwrap()).unwrap();
    let tf5 = Tokenizer::from_spec(dir.to_str().unwrap(), None).unwrap();
    let ds = load_docs(&[fixture("chat.jsonl")], TokenizerChoice::Given(tf5), 0.0, &opts(DocFormat::Chat)).unwrap();
    assert_eq!(documents(&ds.train), ids_of(&sft["chat_ids"]), "chat_template.jinja");
    let out = temp_dir("prep-chat-tf5");
    prepare(&fixture("chat.jsonl"), dir.to_str().unwrap(), &out, 0.0, &opts(DocFormat::Chat)).unwrap();
    assert_eq!(std::fs::read_to_string(out.join("chat_template.jinja")).unwrap(), source.as_str().unwrap());
    // The file takes the place of a template the config names.
    std::fs::copy(src.join("tokenizer_config.json"), dir.join("tokenizer_config.json")).unwrap();
    std::fs::write(dir.join("chat_template.jinja"), "{% for m in messages %}[{{ m['content'] }}]{% endfor %}").unwrap();
    let Tokenizer::Hf(h) = Tokenizer::from_spec(dir.to_str().unwrap(), None).unwrap() else { panic!("an HF tokenizer") };
    let msgs = serde_json::json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]);
    assert_eq!(h.config().template.as_ref().unwrap().render_spans(&msgs).unwrap().0, "[hi][yo]");
}

/// `f` fails naming `what`; the output directory holds nothing afterwards.
fn fails_writing_nothing(input: &Path, tok: &str, o: &DocOpts, what: &[&str]) {
    let out = temp_dir("bad-out").join("prepared");
    let e = prepare(input, tok, &out, 0.1, o).unwrap_err().to_string();
    assert!(!e.contains('\n'), "one line: {e}");
    for w in what {
        assert!(e.contains(w), "`{e}` should name {w}");
    }
    assert!(!out.exists(), "{} was created", out.display());
    let e2 = load_docs(&[input.to_path_buf()], TokenizerChoice::Spec(tok), 0.1, o).unwrap_err().to_string();
    assert_eq!(e, e2);
}

#[test]
fn bad_documents_name_the_file_line_row_and_field_and_write_nothing() {
    let dir = temp_dir("baddocs");
    let tok = tokenizer_dir("qwen2");
    let tok = tok.to_str().unwrap();
    let text = DocOpts::default();
    let missing = dir.join("missing.jsonl");
    std::fs::write(&missing, "{\"text\": \"fine\"}\n{\"content\": \"no text\"}\n").unwrap();
    fails_writing_nothing(&missing, tok, &text, &["missing.jsonl", "line 2", "`text`", "content"]);
    let malformed = dir.join("malformed.jsonl");
    std::fs::write(&malformed, "{\"text\": \"fine\"}\n\n{\"text\": \"cut\n").unwrap();
    fails_writing_nothing(&malformed, tok, &text, &["malformed.jsonl", "line 3", "not valid JSON"]);
    let number = dir.join("number.jsonl");
    std::fs::write(&number, "{\"text\": 7}\n").unwrap();
    fails_writing_nothing(&number, tok, &text, &["number.jsonl", "line 1", "`text` is a number"]);
    let gz = dir.join("broken.jsonl.gz");
    std::fs::write(&gz, b"\x1f\x8b\x08\x00garbage").unwrap();
    fails_writing_nothing(&gz, tok, &text, &["broken.jsonl.gz"]);
    let o = DocOpts { text_field: "body".into(), format: DocFormat::Text };
    fails_writing_nothing(&fixture("docs.parquet"), tok, &o, &["docs.parquet", "no column `body`", "id, text"]);
    let chat = opts(DocFormat::Chat);
    fails_writing_nothing(&fixture("docs.jsonl"), tok, &chat, &["docs.jsonl", "line 1", "`messages`", "conversations"]);
    // Chats read as text: the message says which format they are.
    fails_writing_nothing(&fixture("chat.jsonl"), tok, &text, &["chat.jsonl", "line 1", "`text`", "--format chat"]);
    let bad_from = dir.join("bad-from.jsonl");
    std::fs::write(&bad_from, "{\"conversations\": [{\"from\": \"bot\", \"value\": \"hi\"}]}\n").unwrap();
    fails_writing_nothing(&bad_from, tok, &chat, &["bad-from.jsonl", "conversations[0].from", "human, gpt or system"]);
    let no_assistant = dir.join("user-only.jsonl");
    std::fs::write(&no_assistant, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n").unwrap();
    fails_writing_nothing(&no_assistant, tok, &chat, &["user-only.jsonl", "line 1", "assistant"]);
    let no_role = dir.join("no-role.jsonl");
    std::fs::write(&no_role, "{\"messages\": [{\"content\": \"hi\"}]}\n").unwrap();
    fails_writing_nothing(&no_role, tok, &chat, &["no-role.jsonl", "messages[0]", "`role`"]);
    // A tokenizer without a chat template cannot render chats.
    fails_writing_nothing(&fixture("chat.jsonl"), "gpt2", &chat, &["chat.jsonl", "document 1", "chat_template"]);
    let pc = opts(DocFormat::PromptCompletion);
    fails_writing_nothing(&fixture("chat.jsonl"), tok, &pc, &["chat.jsonl", "line 1", "`prompt`"]);
    fails_writing_nothing(&fixture("make.py"), tok, &chat, &["make.py", "jsonl or .parquet"]);
}

/// Preference rows (TRL's format) become two documents each, chosen then rejected: text rows as
/// the prompt/completion documents of their prompt, chat rows with loss on the completion's
/// assistant turns only, an implicit prompt (the messages both sides share) equal to an explicit
/// one; and every bad row is refused naming its line and field.
#[test]
fn preference_rows_are_pairs_of_documents() {
    let dir = temp_dir("preference");
    let tok = Tokenizer::from_spec(tokenizer_dir("qwen2").to_str().unwrap(), None).unwrap();
    let text = dir.join("text.jsonl");
    std::fs::write(&text, concat!(
        "{\"prompt\": \"2 + 2 =\", \"chosen\": \" 4\", \"rejected\": \" 5\"}\n",
        "{\"prompt\": \"The capital of France is\", \"chosen\": \" Paris.\", \"rejected\": \" Rome, or maybe Lyon.\"}\n",
    )).unwrap();
    let flat = dir.join("flat.jsonl");
    std::fs::write(&flat, concat!(
        "{\"prompt\": \"2 + 2 =\", \"completion\": \" 4\"}\n{\"prompt\": \"2 + 2 =\", \"completion\": \" 5\"}\n",
        "{\"prompt\": \"The capital of France is\", \"completion\": \" Paris.\"}\n",
        "{\"prompt\": \"The capital of France is\", \"completion\": \" Rome, or maybe Lyon.\"}\n",
    )).unwrap();
    let pref = opts(DocFormat::Preference);
    let ds = load_docs(&[text.clone()], TokenizerChoice::Given(tok.clone()), 0.0, &pref).unwrap();
    let want = load_docs(&[flat], TokenizerChoice::Given(tok.clone()), 0.0, &opts(DocFormat::PromptCompletion)).unwrap();
    // (The flat file's later documents are not firsts; the tokenizer has an EOS, so no separator.)
    assert_eq!(documents(&ds.train), documents(&want.train));
    assert_eq!(ds.train.docs.len(), 4);
    for d in 0..4 {
        assert_eq!(mask_of(&ds.train, d), mask_of(&want.train, d), "document {d}");
    }
    // Chats: an explicit prompt of messages, and the same rows with the prompt inside both sides.
    let user = |q: &str| serde_json::json!({"role": "user", "content": q});
    let bot = |a: &str| serde_json::json!({"role": "assistant", "content": a});
    let explicit = dir.join("explicit.jsonl");
    let implicit = dir.join("implicit.jsonl");
    let prompt = vec![user("hi"), bot("hello!"), user("2 + 2?")];
    let row_e = serde_json::json!({"prompt": prompt, "chosen": [bot("4")], "rejected": [bot("22")]});
    let both = |a: &str| prompt.iter().cloned().chain([bot(a)]).collect::<Vec<_>>();
    let row_i = serde_json::json!({"chosen": both("4"), "rejected": both("22")});
    std::fs::write(&explicit, format!("{row_e}\n")).unwrap();
    std::fs::write(&implicit, format!("{row_i}\n")).unwrap();
    let e = load_docs(&[explicit], TokenizerChoice::Given(tok.clone()), 0.0, &pref).unwrap();
    let i = load_docs(&[implicit], TokenizerChoice::Given(tok.clone()), 0.0, &pref).unwrap();
    assert_eq!(documents(&e.train), documents(&i.train));
    for d in 0..2 {
        let (m, ids) = (mask_of(&e.train, d), &documents(&e.train)[d]);
        assert_eq!(m, mask_of(&i.train, d));
        // Loss on the final assistant turn only: not on the prompt's "hello!".
        let counted: Vec<u32> = ids.iter().zip(&m).filter(|(_, &k)| k == 1).map(|(&t, _)| t).collect();
        let said = tok.decode(&counted);
        assert!(said.starts_with(if d == 0 { "4" } else { "22" }) && !said.contains("hello"), "{said:?}");
    }
    // Bad rows: each names the file, the line and the field.
    let cases: [(&str, &[&str]); 6] = [
        ("{\"prompt\": \"p\", \"chosen\": \"a\"}", &["line 1", "no field `rejected`"]),
        ("{\"prompt\": \"p\", \"chosen\": \"\", \"rejected\": \"b\"}", &["line 1", "`chosen` is empty"]),
        ("{\"chosen\": \"a\", \"rejected\": \"b\"}", &["line 1", "`prompt`"]),
        ("{\"prompt\": \"p\", \"chosen\": \"a\", \"rejected\": [1]}", &["line 1", "both strings, or both arrays"]),
        ("{\"chosen\": [{\"role\": \"user\", \"content\": \"q\"}], \"rejected\": [{\"role\": \"user\", \"content\": \"q\"}]}", &["line 1", "`chosen` has no assistant message"]),
        ("{\"prompt\": [{\"role\": \"user\"}], \"chosen\": [{\"role\": \"assistant\", \"content\": \"a\"}], \"rejected\": [{\"role\": \"assistant\", \"content\": \"b\"}]}", &["line 1", "prompt[0] has no `content`"]),
    ];
    for (k, (row, want)) in cases.iter().enumerate() {
        let bad = dir.join(format!("bad{k}.jsonl"));
        std::fs::write(&bad, format!("{}\n{row}\n", std::fs::read_to_string(&text).unwrap().lines().next().unwrap())).unwrap();
        let err = load_docs(&[bad.clone()], TokenizerChoice::Given(tok.clone()), 0.0, &pref).unwrap_err().to_string();
        let want: Vec<String> = want.iter().map(|w| w.replace("line 1", "line 2")).collect();
        for w in std::iter::once(format!("bad{k}.jsonl")).chain(want) {
            assert!(err.contains(&w), "case {k}: {err:?} lacks {w:?}");
        }
    }
}
