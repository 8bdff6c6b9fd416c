//! HF GPT-2 import/export against the `transformers` fixtures in ../shared/fixtures (issue 4).

use model::gpt::IGNORE_INDEX;
use model::hf::{export_hf, import_hf};
use model::Pass;
use std::path::{Path, PathBuf};

/// A `../shared/fixtures` directory; a missing one fails the test, naming its path.
fn fixture(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures").join(name);
    assert!(p.exists(), "fixture {} not found", p.display());
    p
}

fn tokens(dir: &Path) -> Vec<Vec<u32>> {
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("tokens.json")).unwrap()).unwrap();
    v["input_ids"].as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()).collect()
}

fn expected_logits(dir: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("logits").unwrap();
    (t.shape().to_vec(), t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

#[test]
fn gpt2_fixture_logits_and_loss_match_transformers() {
    fixture_matches("gpt2-tiny");
}

#[test]
fn llama_fixture_logits_and_loss_match_transformers() {
    fixture_matches("llama-tiny");
}

#[test]
fn mixtral_fixture_logits_and_loss_match_transformers() {
    fixture_matches("mixtral-tiny");
}

#[test]
fn mixtral_export_reimport_is_bit_identical() {
    export_reimport("mixtral-tiny");
}

#[test]
fn llama_export_reimport_is_bit_identical() {
    export_reimport("llama-tiny");
}

fn fixture_matches(name: &str) {
    let dir = fixture(name);
    let mut m = import_hf(&dir).unwrap();
    let rows = tokens(&dir);
    let (b, t) = (rows.len(), rows[0].len());
    let flat: Vec<u32> = rows.concat();
    let logits = m.forward_logits(&flat, b, t);
    let (shape, want) = expected_logits(&dir);
    assert_eq!(shape, vec![b, t, m.cfg.vocab_size]);
    let max_err = logits.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(max_err <= 1e-4, "max |logit error| {max_err}");
    // Loss: logits at position t predict token t+1, over all 2 × 23 positions.
    let mut targets = vec![IGNORE_INDEX; b * t];
    for (bi, r) in rows.iter().enumerate() {
        for j in 0..t - 1 {
            targets[bi * t + j] = r[j + 1] as i32;
        }
    }
    let loss = m.forward(&flat, &targets, b, t, Pass::Eval);
    let ej: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let want_loss = ej["loss"].as_f64().unwrap() as f32;
    assert!(((loss - want_loss) / want_loss).abs() <= 1e-5, "loss {loss} vs {want_loss}");
    eprintln!("{name}: max |logit error| {max_err:.2e}, loss {loss} vs {want_loss}");
}

#[test]
fn gpt2_export_reimport_is_bit_identical() {
    export_reimport("gpt2-tiny");
}

fn export_reimport(name: &str) {
    let dir = fixture(name);
    let m = import_hf(&dir).unwrap();
    let out = std::env::temp_dir().join(format!("kiln-hf-export-{name}-{}", std::process::id()));
    export_hf(&m, &out).unwrap();
    let back = import_hf(&out).unwrap();
    assert_eq!(m.cfg, back.cfg);
    assert!(m.params.iter().zip(&back.params).all(|(a, b)| a.to_bits() == b.to_bits()));
    // The exported weights file holds exactly the tensors of the original (same names, shapes, bytes).
    let a = std::fs::read(dir.join("model.safetensors")).unwrap();
    let b = std::fs::read(out.join("model.safetensors")).unwrap();
    let (sa, sb) = (safetensors::SafeTensors::deserialize(&a).unwrap(), safetensors::SafeTensors::deserialize(&b).unwrap());
    let mut na = sa.names();
    let mut nb = sb.names();
    na.sort();
    nb.sort();
    assert_eq!(na, nb);
    for n in na {
        assert_eq!(sa.tensor(n).unwrap().data(), sb.tensor(n).unwrap().data(), "{n}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn import_errors_name_the_problem() {
    let gdir = fixture("gpt2-tiny");
    let tmp = std::env::temp_dir().join(format!("kiln-hf-bad-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let cfg = std::fs::read_to_string(gdir.join("config.json")).unwrap().replace("GPT2LMHeadModel", "FalconForCausalLM");
    std::fs::write(tmp.join("config.json"), cfg).unwrap();
    let e = import_hf(&tmp).err().unwrap();
    assert!(e.contains("FalconForCausalLM") && e.contains("config.json"), "{e}");
    std::fs::copy(gdir.join("config.json"), tmp.join("config.json")).unwrap();
    let e = import_hf(&tmp).err().unwrap();
    assert!(e.contains("no model.safetensors"), "{e}");
    // A config whose shapes disagree with the weights: the tensor is named.
    let cfg = std::fs::read_to_string(gdir.join("config.json")).unwrap().replace("\"n_embd\": 64", "\"n_embd\": 32");
    std::fs::write(tmp.join("config.json"), cfg).unwrap();
    std::fs::copy(gdir.join("model.safetensors"), tmp.join("model.safetensors")).unwrap();
    let e = import_hf(&tmp).err().unwrap();
    assert!(e.contains("transformer.") && e.contains("expected F32"), "{e}");
    let _ = std::fs::remove_dir_all(&tmp);
}

#[test]
fn bias_free_gpt2_exports_with_zero_biases_and_same_logits() {
    let cfg = model::GptConfig::gpt2(2, 2, 8, 6, 12, false, 0.0, true);
    let mut m = model::Gpt::new(cfg, 12, 1);
    let out = std::env::temp_dir().join(format!("kiln-hf-nobias-{}", std::process::id()));
    export_hf(&m, &out).unwrap();
    let mut back = import_hf(&out).unwrap();
    assert!(back.cfg.bias);
    let x: Vec<u32> = (0..12).map(|i| i % 12).collect();
    let (a, b) = (m.forward_logits(&x, 2, 6), back.forward_logits(&x, 2, 6));
    assert!(a.iter().zip(&b).all(|(p, q)| (p - q).abs() < 1e-6));
    let _ = std::fs::remove_dir_all(&out);
}
