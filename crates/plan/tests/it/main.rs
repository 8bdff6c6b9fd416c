//! Integration tests of the planner. One binary, one module per concern.

mod catalog;
mod comm;
mod context;
mod cpu;
mod errors;
#[cfg(feature = "clap")]
mod flags;
mod flops;
mod korthikanti;
mod phenomena;
mod ranking;
mod search_speed;
mod table1;
mod zero;

use plan::hardware::{Cluster, HardwareCatalog};
use plan::models::ModelShape;
use plan::validate::{parse_table, Row, NARAYANAN_TABLE1};

/// The ten rows of Narayanan et al. 2021 Table 1 (crates/plan/catalog/narayanan2021_table1.csv).
pub fn table1_rows() -> Vec<Row> {
    parse_table(NARAYANAN_TABLE1, "narayanan2021_table1.csv").expect("built-in table parses")
}

pub fn gpt_of(r: &Row) -> ModelShape {
    ModelShape::gpt(&r.name, r.layers, r.hidden, r.heads, 51200, 2048).unwrap()
}

pub fn a100(gpus: u64) -> Cluster {
    Cluster::new(&HardwareCatalog::builtin(), "a100-80gb", gpus, None).unwrap()
}
