//! The `kiln plan` flags as `plan::cli` declares them (feature `clap`, which `kiln` turns on): each struct field
//! is one flag, with the spelling `kiln plan --help` shows.

use clap::Parser;
use plan::cli::{ClusterArgs, LayoutArgs, ModelArgs};

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    layout: LayoutArgs,
}

#[test]
fn every_field_is_its_flag() {
    let f = Flags::try_parse_from([
        "plan", "--model", "gpt2-124m", "--models-file", "m.json", "--vocab", "50304", "--biases", "false", "--gpu", "h100-sxm",
        "--gpus", "8", "--gpus-per-node", "4", "--global-batch", "64", "--tp", "2", "--schedule", "1f1b", "--virtual-stages", "1",
        "--sequence-parallel", "--dp-overlap", "false", "--comm-overlap", "true", "--fp32-grads", "false", "--zero", "1",
    ])
    .unwrap();
    assert_eq!((f.model.model.as_deref(), f.model.models_file.as_deref(), f.model.vocab, f.model.biases), (Some("gpt2-124m"), Some("m.json"), Some(50304), Some(false)));
    assert_eq!((f.cluster.gpu.as_str(), f.cluster.gpus, f.cluster.gpus_per_node), ("h100-sxm", 8, Some(4)));
    let l = &f.layout;
    assert_eq!((l.global_batch, l.tp, l.schedule.as_deref(), l.virtual_stages, l.zero), (64, Some(2), Some("1f1b"), Some(1), Some(1)));
    // A bare --sequence-parallel is true; the overlap flags keep their --dp-/--comm- spelling.
    assert_eq!((l.sequence_parallel, l.overlap_dp, l.overlap_comm, l.fp32_grads), (Some(true), Some(false), Some(true), Some(false)));
    assert!(Flags::try_parse_from(["plan", "--gpu", "a100-80gb", "--gpus", "8"]).is_err(), "--global-batch is required");
    // The optimizer flags, by the run's names; a wrong one is refused naming the flag and the names.
    let f = Flags::try_parse_from(["plan", "--gpu", "h100-sxm", "--gpus", "8", "--global-batch", "32", "--optimizer", "muon", "--optim-state", "int8"]).unwrap();
    let m = plan::models::find_model("llama2-7b", &[]).unwrap();
    let (c, _, _) = plan::cli::resolve_layout(&f.layout, &m).unwrap();
    assert_eq!((c.optimizer, c.optim_state), (Some(plan::policy::OptimName::Muon), Some(plan::policy::StateForm::Int8)));
    let f = Flags::try_parse_from(["plan", "--gpu", "h100-sxm", "--gpus", "8", "--global-batch", "32", "--optimizer", "sgd"]).unwrap();
    let e = plan::cli::resolve_layout(&f.layout, &m).unwrap_err().0;
    assert!(e.contains("--optimizer") && e.contains("adamw, lion, muon or adafactor") && e.contains("sgd"), "{e}");
}
