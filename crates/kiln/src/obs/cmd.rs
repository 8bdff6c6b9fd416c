//! The `plot`, `runs` and `doctor` subcommands, as clap types the CLI flattens in and
//! functions that print.

use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug, Clone)]
pub struct PlotArgs {
    /// Run directories to overlay (each with a metrics.jsonl).
    #[arg(required = true)]
    pub runs: Vec<PathBuf>,
    /// The PNG to write.
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Args, Debug, Clone)]
pub struct RunsArgs {
    /// The directory holding run directories (default runs/).
    pub dir: Option<PathBuf>,
}

/// `kiln plot RUN... --out FILE.png`
pub fn plot(a: &PlotArgs) -> Result<(), String> {
    super::plot_runs(&a.runs, &a.out)?;
    println!("wrote {}", a.out.display());
    Ok(())
}

/// `kiln runs [DIR]`
pub fn runs(a: &RunsArgs) -> Result<(), String> {
    let dir = a.dir.clone().unwrap_or_else(|| PathBuf::from("runs"));
    print!("{}", super::list_runs(&dir)?);
    Ok(())
}

/// `kiln doctor`: prints the report; an error (exit non-zero) when something is missing.
pub fn doctor() -> Result<(), String> {
    let (report, ok) = super::doctor();
    print!("{report}");
    if ok {
        Ok(())
    } else {
        Err("doctor: the default corpus is missing: `kiln train` without --data will fail (install the docs with `rustup component add rust-docs`, or pass --data PATH)".into())
    }
}
