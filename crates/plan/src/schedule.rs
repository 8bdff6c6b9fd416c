//! The pipeline schedule kinds (GPipe: Huang et al. 2019; 1F1B / PipeDream-Flush: Narayanan et al. 2019/2021;
//! interleaved 1F1B: Narayanan et al. SC21): the one definition the planner's formulas and `parallel::pp`'s
//! schedules-as-data (which re-exports it as `parallel::pp::Kind`) both take, with its parsing from the
//! config/flag string and its name.

use serde::Serialize;

use crate::PlanError;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Gpipe,
    #[serde(rename = "1f1b")]
    OneFOneB,
    Interleaved,
}

impl Kind {
    /// `gpipe`, `1f1b` or `interleaved` (any case; `interleaved-1f1b` as Megatron-LM names it). The error
    /// names the value, not the flag or key: callers add theirs.
    pub fn parse(s: &str) -> Result<Kind, String> {
        match s.to_ascii_lowercase().as_str() {
            "gpipe" => Ok(Kind::Gpipe),
            "1f1b" => Ok(Kind::OneFOneB),
            "interleaved" | "interleaved-1f1b" => Ok(Kind::Interleaved),
            _ => Err(format!("schedule must be gpipe, 1f1b or interleaved, got `{s}`")),
        }
    }

    /// The canonical spelling, which [`Kind::parse`] reads back.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Gpipe => "gpipe",
            Kind::OneFOneB => "1f1b",
            Kind::Interleaved => "interleaved",
        }
    }
}

/// [`Kind::parse`] for the planner's `--schedule` flag (and a validation table's `schedule` column).
pub(crate) fn parse_flag(s: &str) -> Result<Kind, PlanError> {
    Kind::parse(s).map_err(|e| PlanError(format!("--schedule: {e}")))
}
