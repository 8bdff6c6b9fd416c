/// Counts every allocation by category for `metrics.jsonl` (see `kiln::memory::track`).
#[global_allocator]
static ALLOC: kiln::memory::track::Tracking = kiln::memory::track::Tracking;

fn main() {
    kiln::util::mark_main_thread();
    std::process::exit(kiln::cli::main());
}
