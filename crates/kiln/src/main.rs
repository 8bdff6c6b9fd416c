/// Counts every allocation by category for `metrics.jsonl` (see `kiln::memory::track`).
#[global_allocator]
static ALLOC: kiln::memory::track::Tracking = kiln::memory::track::Tracking;

fn main() {
    std::process::exit(kiln::cli::main());
}
