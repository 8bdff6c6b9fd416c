#![no_main]
// Any single allocation over 1 GiB aborts with a message: a crash libFuzzer reports.
#[global_allocator]
static ALLOC: kiln::fuzz::Capped = kiln::fuzz::Capped;
// kiln catches the panics of third-party parsers (parquet, tokenizers) and reports them as the
// file's error; libfuzzer-sys's hook would abort on those too, so it is replaced. A panic kiln
// does not catch still reaches libfuzzer-sys's catch_unwind, which aborts: a crash.
libfuzzer_sys::fuzz_target!(init: std::panic::set_hook(Box::new(|i| eprintln!("{i}"))), |data: &[u8]| kiln::fuzz::run("checkpoint", data));
