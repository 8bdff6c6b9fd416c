//! `kiln plan validate` without building kiln: `cargo run --release -p plan --example validate -- TABLE [--json]`.
fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let table = args.first().map_or("crates/plan/catalog/published_runs.csv", |s| s.as_str());
    let json = args.iter().any(|a| a == "--json");
    let hw = args.iter().position(|a| a == "--hw").and_then(|i| args.get(i + 1)).map(|s| s.as_str());
    match plan::cli::validate_cmd(table, hw, json) {
        Ok(s) => print!("{s}"),
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
