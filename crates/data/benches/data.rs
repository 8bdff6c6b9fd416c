//! Plain-timing bench (`cargo bench -p data`): BPE training to vocab 4096 on ~1 MB
//! (tinyshakespeare when present) and on the default corpus, default-corpus loading, and
//! encoding speed. Prints one JSON object per line.

use std::time::Instant;

fn main() {
    let t0 = Instant::now();
    let corpus = data::default_corpus();
    let load_s = t0.elapsed().as_secs_f64();
    let mut texts = Vec::new();
    let shakes = concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data/tinyshakespeare.txt");
    if let Ok(s) = std::fs::read_to_string(shakes) {
        let mut end = 1_000_000.min(s.len());
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        texts.push(("tinyshakespeare_1mb", s[..end].to_string()));
    }
    match corpus {
        Ok((text, files)) => {
            println!("{{\"bench\":\"default_corpus\",\"files\":{},\"bytes\":{},\"load_s\":{load_s:.3}}}", files.len(), text.len());
            texts.push(("default_corpus", text));
        }
        Err(e) => eprintln!("note: {e}"),
    }
    for (name, text) in texts {
        let t0 = Instant::now();
        let tok = data::Tokenizer::Hf(data::train_bpe(&text, 4096, &["<|endoftext|>"]).expect("bpe training"));
        let train_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let ids = tok.encode(&text).unwrap();
        let encode_s = t1.elapsed().as_secs_f64();
        assert_eq!(tok.decode(&ids), text, "round trip");
        println!(
            "{{\"bench\":\"bpe_train\",\"corpus\":\"{name}\",\"bytes\":{},\"vocab\":{},\"train_s\":{train_s:.3},\"encode_s\":{encode_s:.3},\"bytes_per_token\":{:.3}}}",
            text.len(),
            tok.vocab_size(),
            text.len() as f64 / ids.len() as f64
        );
        let gpt2 = data::Tokenizer::from_spec("gpt2", None).unwrap();
        let t2 = Instant::now();
        let n = gpt2.encode(&text).unwrap().len();
        println!(
            "{{\"bench\":\"gpt2_encode\",\"corpus\":\"{name}\",\"bytes\":{},\"tokens\":{n},\"encode_s\":{:.3}}}",
            text.len(),
            t2.elapsed().as_secs_f64()
        );
    }
}
