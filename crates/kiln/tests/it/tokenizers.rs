//! `kiln tokenizer encode` / `decode` on the shared Hugging Face tokenizers: every hard case
//! gives exactly the ids the `tokenizers` library gave, and decodes to its text.

use crate::common::*;
use std::fs;
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/tokenizers").join(name)
}

#[test]
fn encode_and_decode_match_the_library_on_every_case() {
    let d = scratch("tokcases");
    for name in ["gpt2", "qwen2", "sp-bpe"] {
        let dir = fixture(name);
        let p = dir.join("cases.json");
        let cases: Vec<serde_json::Value> = serde_json::from_str(&fs::read_to_string(&p).unwrap_or_else(|e| panic!("fixture {}: {e}", p.display()))).unwrap();
        // One process per tokenizer: every case through a file (some hold characters argv cannot: NUL).
        let mut args = vec!["tokenizer".to_string(), "encode".into(), "--tokenizer".into(), dir.display().to_string()];
        for (i, c) in cases.iter().enumerate() {
            let f = d.join(format!("{name}-{i}.txt"));
            fs::write(&f, c["text"].as_str().unwrap()).unwrap();
            args.extend(["--file".to_string(), f.display().to_string()]);
        }
        let o = kiln(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let lines: Vec<serde_json::Value> = stdout(&o).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), cases.len(), "{name}");
        for (got, c) in lines.iter().zip(&cases) {
            assert_eq!(got["ids"], c["ids"], "{name}: ids of {:?}", c["text"]);
        }
        let mut args = vec!["tokenizer".to_string(), "decode".into(), "--tokenizer".into(), dir.join("tokenizer.json").display().to_string()];
        for c in &cases {
            args.extend(["--ids".to_string(), c["ids"].to_string()]);
        }
        let o = kiln(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let lines: Vec<serde_json::Value> = stdout(&o).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), cases.len(), "{name}");
        for (got, c) in lines.iter().zip(&cases) {
            assert_eq!(got["text"], c["decoded"], "{name}: decoding {:?}", c["ids"]);
        }
    }
    // A file that is not a tokenizer: exit 2, naming it.
    let bad = d.join("tokenizer.json");
    fs::write(&bad, "{\"model\": 3}").unwrap();
    assert_user_error(&kiln(&["tokenizer", "encode", "--tokenizer", bad.to_str().unwrap(), "--text", "x"]), &[bad.to_str().unwrap()]);
}
