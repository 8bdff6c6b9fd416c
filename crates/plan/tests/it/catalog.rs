//! Every catalogue entry resolves, and every accelerator can plan a model (smoke test of the data files).

use plan::cli::{estimate_cmd, ClusterArgs, LayoutArgs, ModelArgs};
use plan::hardware::HardwareCatalog;
use plan::models::builtin_models;

#[test]
fn every_model_and_accelerator_plans() {
    let models = builtin_models();
    assert!(models.len() >= 25);
    for m in &models {
        assert!(m.params(m.seq) > 0, "{}", m.name);
    }
    for a in HardwareCatalog::builtin().accelerators {
        let m = ModelArgs {
            model: Some("llama2-7b".into()),
            ..Default::default()
        };
        let c = ClusterArgs {
            gpu: a.name.clone(),
            gpus: 16,
            ..Default::default()
        };
        let l = LayoutArgs {
            global_batch: 64,
            ..Default::default()
        };
        let j = estimate_cmd(&m, &c, &l, true).unwrap_or_else(|e| panic!("{}: {e}", a.name));
        let v: serde_json::Value = serde_json::from_str(&j).unwrap();
        let mfu = v["mfu"].as_f64().unwrap();
        assert!(mfu > 0.2 && mfu < 0.75, "{}: MFU {mfu}", a.name);
        assert_eq!(v["fits"], true, "{}", a.name);
    }
}

#[test]
fn user_hardware_file_extends_the_catalogue() {
    let dir = std::env::temp_dir().join(format!("plan-hw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("hw.json");
    let mut a = HardwareCatalog::builtin().accelerator("h100-sxm").unwrap();
    a.name = "h100-pcie-ish".into();
    a.node.intra = "pcie5".into();
    let cat = HardwareCatalog {
        accelerators: vec![a],
        links: vec![],
    };
    std::fs::write(&f, serde_json::to_string(&cat).unwrap()).unwrap();
    let m = ModelArgs {
        model: Some("llama2-13b".into()),
        ..Default::default()
    };
    let l = LayoutArgs {
        global_batch: 64,
        tp: Some(8),
        ..Default::default()
    };
    let fast = ClusterArgs {
        gpu: "h100-sxm".into(),
        gpus: 8,
        ..Default::default()
    };
    let slow = ClusterArgs {
        gpu: "h100-pcie-ish".into(),
        gpus: 8,
        hardware_file: Some(f.to_string_lossy().into()),
        ..Default::default()
    };
    let t = |c: &ClusterArgs| {
        let v: serde_json::Value = serde_json::from_str(&estimate_cmd(&m, c, &l, true).unwrap()).unwrap();
        v["step_time_s"].as_f64().unwrap()
    };
    assert!(
        t(&slow) > 1.2 * t(&fast),
        "8-way TP over PCIe must be slower than over NVLink"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `kiln plan validate` on the published-runs catalogue keeps the rows the planner's
/// constants may be fitted on (`plan::validate::split_of`) apart from the held-out rest and
/// reports both halves; rows it cannot evaluate are listed with the reason, not dropped
/// silently. The held-out error is what it is (the target is not met yet).
#[test]
fn the_published_runs_catalogue_reports_its_fit_and_held_out_halves() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/catalog/published_runs.csv");
    let text = plan::cli::validate_cmd(path, None, false).unwrap();
    let json: serde_json::Value = serde_json::from_str(&plan::cli::validate_cmd(path, None, true).unwrap()).unwrap();
    let halves = json["halves"].as_array().unwrap();
    let (fit, held) = (&halves[0], &halves[1]);
    assert_eq!((fit["split"].as_str(), held["split"].as_str()), (Some("fit"), Some("holdout")));
    let (nf, nh) = (fit["rows"].as_u64().unwrap(), held["rows"].as_u64().unwrap());
    assert!(nf * 2 <= nf + nh, "at most half the evaluated rows are fitted on: {nf} of {}", nf + nh);
    assert!(nh >= 30, "{nh} held-out rows evaluated");
    assert!(fit["mape_pct"].as_f64().unwrap().is_finite(), "{fit}");
    assert!(held["mape_pct"].as_f64().unwrap().is_finite());
    // Each row's half is the fixed rule's (`plan::validate::split_of`), not a column anyone can edit.
    for r in json["rows"].as_array().unwrap() {
        let name = r["name"].as_str().unwrap();
        let want = if name.starts_with("narayanan2021_") { Some("fit") } else { r["split"].as_str() };
        assert_eq!(r["split"].as_str(), want, "{name}");
    }
    let skipped = json["skipped"].as_array().unwrap();
    assert!(skipped.iter().all(|s| !s[1].as_str().unwrap().is_empty()));
    assert_eq!(json["rows"].as_array().unwrap().len() + skipped.len(), 116);
    assert!(text.contains("holdout") && text.contains("kept out of every fit") && text.contains("skipped"), "{text}");
}

/// The split rule, fixed before fitting: Narayanan et al. Table 1 is fitted on; every other source's rows
/// 1, 4, 7, … (in catalogue order, from 0) are fitted on and the rest held out.
#[test]
fn the_split_rule_is_by_position_within_each_source() {
    use plan::validate::split_of;
    assert_eq!(split_of("narayanan2021", 0), "fit");
    assert_eq!(split_of("narayanan2021", 5), "fit");
    let halves: Vec<&str> = (0..7).map(|k| split_of("megascale2024", k)).collect();
    assert_eq!(halves, ["holdout", "fit", "holdout", "holdout", "fit", "holdout", "holdout"]);
}

/// Elements of the tensors in `dir/model.safetensors` but those `skip` names.
fn stored_elements(dir: &std::path::Path, skip: &dyn Fn(&str) -> bool) -> u64 {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__" && !skip(k))
        .map(|(_, t)| t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).product::<u64>())
        .sum()
}

/// A Hugging Face `config.json` (or its directory, through `--model`) is a model entry: the
/// shared fixtures' parameter counts equal their safetensors' element counts (the planner leaves
/// out the final norm, as Narayanan's eq. (1) does), GPT-2's learned positions and tied head
/// included, Mixtral's experts and router too.
#[test]
fn hugging_face_configs_resolve_to_their_checkpoints_parameter_counts() {
    let shared = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures");
    for name in ["gpt2-tiny", "llama-tiny", "llama31-tiny", "mistral-tiny", "mixtral-tiny"] {
        let dir = shared.join(name);
        let cfg = dir.join("config.json");
        let models = plan::models::parse_models(&std::fs::read_to_string(&cfg).unwrap(), cfg.to_str().unwrap()).unwrap();
        let m = &models[0];
        assert_eq!(m.name, name);
        let stored = stored_elements(&dir, &|k| k.ends_with(".attn.bias") || k.ends_with(".attn.masked_bias"));
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
        let (seq, final_norm) = match v["n_positions"].as_u64() {
            Some(s) => (s, 2 * m.hidden),
            None => (m.seq, m.hidden),
        };
        assert_eq!(m.params(seq) + final_norm, stored, "{name}: {m:?}");
        // The same through `--model DIR`.
        let args = ModelArgs { model: Some(dir.to_str().unwrap().into()), ..Default::default() };
        assert_eq!(&plan::cli::resolve_model(&args).unwrap(), m);
    }
    // DeepSeek-V3's multi-head latent attention, dense and with a dense layer before routed
    // ones (the model crate's fixtures, made with transformers): every stored element but the
    // routers' correction biases (not parameters of the step's cost).
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../model/tests/fixtures");
    for name in ["deepseek-v3-dense-tiny", "deepseek-v3-moe-tiny"] {
        let dir = fixtures.join(name);
        let cfg = dir.join("config.json");
        let m = &plan::models::parse_models(&std::fs::read_to_string(&cfg).unwrap(), cfg.to_str().unwrap()).unwrap()[0];
        assert!(m.mla.is_some_and(|a| (a.q_rank, a.kv_rank, a.rope, a.v) == (16, 12, 4, 6)) && m.head_dim == 12, "{m:?}");
        let stored = stored_elements(&dir, &|k| k.ends_with("e_score_correction_bias"));
        assert_eq!(m.params(m.seq) + m.hidden, stored, "{name}: {m:?}");
    }
    // What the planner cannot express is refused by key: another activation, Qwen2-MoE's shared
    // expert, dense layers among experts.
    let base = serde_json::json!({"architectures": ["X"], "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 100});
    for (key, value) in [("hidden_act", serde_json::json!("gelu")), ("shared_expert_intermediate_size", serde_json::json!(64)), ("mlp_only_layers", serde_json::json!([1]))] {
        let mut v = base.clone();
        v[key] = value;
        let e = plan::models::parse_models(&v.to_string(), "x/config.json").unwrap_err();
        assert!(e.0.contains(key), "{key}: {}", e.0);
    }
}

/// The built-in DeepSeek-V3 with multi-head latent attention has the technical report's size:
/// 671B parameters without the MTP module, 37B of them active per token.
#[test]
fn deepseek_v3_has_the_reports_parameters() {
    let m = plan::models::find_model("deepseek-v3", &[]).unwrap();
    let (total, active) = (m.params(m.seq) as f64 / 1e9, m.active_params(m.seq) as f64 / 1e9);
    assert!((total - 671.0).abs() < 2.0 && (active - 37.0).abs() < 1.0, "{total:.1}B total, {active:.1}B active");
}
