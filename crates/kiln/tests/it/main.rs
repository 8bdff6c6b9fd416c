//! Integration tests for the kiln binary: one test binary, modules per concern.
mod bench;
mod common;
mod errors;
mod obs;
mod parallel;
mod reliability;
mod training;
