//! The command line. Every user mistake ends as a one-line `error: …` and exit code 2.

//! Each subcommand's flags and its run function live in its own file (`cmd_*.rs`, `obs::cmd`);
//! this file only names them.

use crate::cmd_bench::{BenchCli, PpScheduleCli};
use crate::cmd_checkpoint::CheckpointCmd;
use crate::cmd_data::{DataCmd, TokenizerCmd};
use crate::cmd_memory::MemoryCli;
use crate::cmd_model::{EvalCli, ExportCli, GenerateCli};
use crate::cmd_train::TrainCli;
use crate::error::{KilnError, Result};
use crate::util::init_threads;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "kiln", version, about = "kiln: an LLM training system")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train a model (default: the `tiny` preset on the Rust books of the local Rust install).
    Train(TrainCli),
    /// Print the memory plan of the run `kiln train` would start with the same flags: per-rank
    /// bytes for parameters, gradients, optimizer state, activations by component, temporary
    /// and communication buffers; exit 2 if it exceeds --memory-limit.
    Memory(MemoryCli),
    /// Generate text from a run's newest valid checkpoint.
    Generate(GenerateCli),
    /// Evaluate a run's newest valid checkpoint; prints one JSON object.
    Eval(EvalCli),
    /// Time training steps on synthetic tokens (JSON), or measure the matmul peak with --peak.
    Bench(BenchCli),
    /// Plan a training run: memory, step time, MFU; search parallel layouts; validate.
    #[command(subcommand)]
    Plan(crate::cmd_plan::PlanCmd),
    /// Plot loss, learning rate and throughput of one or more runs into a PNG.
    Plot(crate::obs::cmd::PlotArgs),
    /// List run directories with their config differences and val losses.
    Runs(crate::obs::cmd::RunsArgs),
    /// Report this machine, the build's backends and the default corpus; non-zero if a default run cannot start.
    Doctor(DoctorCli),
    /// Export a run's newest valid checkpoint (Hugging Face format).
    Export(ExportCli),
    /// Print a pipeline schedule as a timeline (one row per stage), with its bubble.
    PpSchedule(PpScheduleCli),
    /// Checkpoints: inspect (manifest and layout-independent SHA-256 digests as JSON).
    #[command(subcommand)]
    Checkpoint(CheckpointCmd),
    /// Data preparation.
    #[command(subcommand)]
    Data(DataCmd),
    /// Tokenizers.
    #[command(subcommand)]
    Tokenizer(TokenizerCmd),
}

/// Parses the arguments, runs the command, and returns the exit code.
pub fn main() -> i32 {
    // A closed stdout (`kiln data inspect … | head`) ends the process quietly, as it does any
    // Unix tool, instead of a "failed printing to stdout" panic: Rust ignores SIGPIPE by default.
    // SAFETY: restores the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Mesa's Vulkan drivers print "XDG_RUNTIME_DIR is invalid" on stderr when it is unset, a
    // line of noise in every device command's output: give them the temporary directory.
    // SAFETY: no other thread exists yet to read the environment.
    if std::env::var_os("XDG_RUNTIME_DIR").is_none() {
        unsafe { std::env::set_var("XDG_RUNTIME_DIR", std::env::temp_dir()) };
    }
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    match dispatch(cli.cmd) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e}");
            e.exit_code()
        }
    }
}

#[derive(clap::Args)]
pub struct DoctorCli {
    /// Check every device kernel against its CPU twin on --device, from inside this binary (for
    /// machines without a Rust toolchain); exit 2 past the contract.
    #[arg(long)]
    pub check_kernels: bool,
    /// The device --check-kernels runs on: vulkan[:N] or cuda[:N].
    #[arg(long, default_value = "vulkan")]
    pub device: crate::device::DeviceArg,
}

fn dispatch(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Train(a) => crate::cmd_train::run(a),
        Cmd::Memory(m) => crate::cmd_memory::run(m),
        Cmd::Plot(a) => crate::obs::cmd::plot(&a).map_err(KilnError::User),
        Cmd::Runs(a) => crate::obs::cmd::runs(&a).map_err(KilnError::User),
        Cmd::Doctor(d) => {
            init_threads(0);
            if d.check_kernels {
                return crate::bench_kernels::check(d.device);
            }
            crate::obs::cmd::doctor().map_err(KilnError::User)
        }
        Cmd::Plan(p) => crate::cmd_plan::run(p).map_err(KilnError::User),
        Cmd::Bench(b) => crate::cmd_bench::bench(b),
        Cmd::Generate(g) => crate::cmd_model::generate(g),
        Cmd::Eval(e) => crate::cmd_model::eval(e),
        Cmd::PpSchedule(a) => crate::cmd_bench::pp_schedule(a),
        Cmd::Checkpoint(c) => crate::cmd_checkpoint::run(c),
        Cmd::Export(x) => crate::cmd_model::export(x),
        Cmd::Data(d) => crate::cmd_data::data_cmd(d),
        Cmd::Tokenizer(t) => crate::cmd_data::tokenizer_cmd(t),
    }
}
