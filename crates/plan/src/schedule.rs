//! The pipeline schedule kinds (GPipe: Huang et al. 2019; 1F1B / PipeDream-Flush: Narayanan et al. 2019/2021;
//! interleaved 1F1B: Narayanan et al. SC21): the one definition the planner's formulas and `parallel::pp`'s
//! schedules-as-data (which re-exports it as `parallel::pp::Kind`) both take, with its spellings
//! ([`Names`]).

use serde::Serialize;

pub use crate::policy::Names;
use crate::PlanError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Gpipe,
    #[serde(rename = "1f1b")]
    OneFOneB,
    Interleaved,
}

impl Names for Kind {
    /// `interleaved-1f1b` as Megatron-LM names it.
    const NAMES: &'static [(&'static str, Kind)] =
        &[("gpipe", Kind::Gpipe), ("1f1b", Kind::OneFOneB), ("interleaved", Kind::Interleaved), ("interleaved-1f1b", Kind::Interleaved)];
}

/// [`Kind::parse`] for the planner's `--schedule` flag (and a validation table's `schedule` column).
pub(crate) fn parse_flag(s: &str) -> Result<Kind, PlanError> {
    Kind::parse(s).map_err(|e| PlanError(format!("--schedule {e}")))
}
