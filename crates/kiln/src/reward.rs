//! Rewards for reinforcement learning with verifiable rewards (`grpo.rewards`): each completion
//! of a prompt is scored by a weighted sum of rewards, each one of
//!
//! - `exact`: 1 if the completion's final answer (the last match of `grpo.answer_pattern`, its
//!   first group if it has one) equals the prompt's reference answer, after trimming, else 0;
//! - `numeric:TOL`: 1 if the final answer and the reference are numbers within `TOL`;
//! - `regex:PATTERN`: 1 if `PATTERN` matches somewhere in the completion;
//! - `format:PATTERN`: 1 if `PATTERN` matches the whole completion (a format reward);
//! - `command:CMD`: a user's reward, `sh -c CMD` reading one JSON object per completion on its
//!   standard input (`{"prompt", "completion", "answer"}`) and writing one number per line.
//!
//! Patterns are Python-style regular expressions (`fancy-regex`).

use crate::error::{user, KilnError, Result};
use fancy_regex::Regex;
use std::io::Write;
use std::process::{Command, Stdio};

/// One reward.
#[derive(Debug)]
pub enum Reward {
    Exact,
    Numeric(f64),
    Search(Regex),
    Format(Regex),
    Command(String),
}

/// What a reward scores: a completion of a prompt, and the prompt's reference answer.
#[derive(Clone, Copy, Debug)]
pub struct Scored<'a> {
    pub prompt: &'a str,
    pub completion: &'a str,
    pub answer: &'a str,
}

/// The run's rewards and their weights, and how a final answer is found.
#[derive(Debug)]
pub struct Rewards {
    pub list: Vec<(String, Reward, f64)>,
    answer: Regex,
}

fn compile(key: &str, pattern: &str) -> Result<Regex> {
    Regex::new(pattern).map_err(|e| KilnError::User(format!("{key}: `{pattern}` is not a regular expression: {e}")))
}

impl Reward {
    /// A reward from its spec (see the module comment).
    pub fn parse(spec: &str) -> Result<Reward> {
        let (kind, arg) = spec.split_once(':').unwrap_or((spec, ""));
        match (kind, arg) {
            ("exact", "") => Ok(Reward::Exact),
            ("numeric", tol) => match tol.parse::<f64>() {
                Ok(t) if t >= 0.0 && t.is_finite() => Ok(Reward::Numeric(t)),
                _ => user(format!("grpo.rewards: `{spec}`: numeric:TOL needs a non-negative tolerance (e.g. numeric:1e-6)")),
            },
            ("regex", p) if !p.is_empty() => Ok(Reward::Search(compile("grpo.rewards", p)?)),
            ("format", p) if !p.is_empty() => Ok(Reward::Format(compile("grpo.rewards", &format!("^(?:{p})$"))?)),
            ("command", c) if !c.trim().is_empty() => Ok(Reward::Command(c.to_string())),
            _ => user(format!("grpo.rewards: `{spec}` is not a reward: exact, numeric:TOL, regex:PATTERN, format:PATTERN or command:CMD")),
        }
    }
}

impl Rewards {
    /// The rewards of `specs`, weighted by `weights` (empty: 1 each), final answers found by
    /// `answer_pattern`.
    pub fn new(specs: &[String], weights: &[f64], answer_pattern: &str) -> Result<Rewards> {
        if specs.is_empty() {
            return user("grpo.rewards is empty: name at least one reward (e.g. [\"exact\"])");
        }
        if !weights.is_empty() && weights.len() != specs.len() {
            return user(format!("grpo.reward_weights has {} weights for {} rewards", weights.len(), specs.len()));
        }
        if let Some(w) = weights.iter().find(|w| !w.is_finite()) {
            return user(format!("grpo.reward_weights: {w} is not a number"));
        }
        let list = specs.iter().enumerate().map(|(i, s)| Ok((s.clone(), Reward::parse(s)?, weights.get(i).copied().unwrap_or(1.0)))).collect::<Result<_>>()?;
        Ok(Rewards { list, answer: compile("grpo.answer_pattern", answer_pattern)? })
    }

    /// The final answer of `completion`: the last match of the answer pattern (its first group
    /// where it has one).
    pub fn final_answer<'a>(&self, completion: &'a str) -> Option<&'a str> {
        let last = self.answer.captures_iter(completion).filter_map(|c| c.ok()).last()?;
        last.get(1).or_else(|| last.get(0)).map(|m| m.as_str())
    }

    /// Each reward's score of each item: `[reward][item]`.
    pub fn each(&self, items: &[Scored]) -> Result<Vec<Vec<f64>>> {
        self.list.iter().map(|(_, r, _)| self.score_one(r, items)).collect()
    }

    /// Each item's weighted sum of rewards.
    pub fn total(&self, each: &[Vec<f64>]) -> Vec<f64> {
        let n = each.first().map_or(0, |e| e.len());
        (0..n).map(|i| self.list.iter().zip(each).map(|((_, _, w), e)| w * e[i]).sum()).collect()
    }

    fn score_one(&self, r: &Reward, items: &[Scored]) -> Result<Vec<f64>> {
        let hit = |b: bool| if b { 1.0 } else { 0.0 };
        Ok(match r {
            Reward::Exact => items.iter().map(|s| hit(self.final_answer(s.completion).is_some_and(|a| a.trim() == s.answer.trim()))).collect(),
            Reward::Numeric(tol) => items
                .iter()
                .map(|s| {
                    let got = self.final_answer(s.completion).and_then(|a| a.trim().parse::<f64>().ok());
                    hit(matches!((got, s.answer.trim().parse::<f64>()), (Some(g), Ok(w)) if (g - w).abs() <= *tol))
                })
                .collect(),
            Reward::Search(re) => items.iter().map(|s| hit(re.is_match(s.completion).unwrap_or(false))).collect(),
            Reward::Format(re) => items.iter().map(|s| hit(re.is_match(s.completion).unwrap_or(false))).collect(),
            Reward::Command(cmd) => command_scores(cmd, items)?,
        })
    }
}

/// A user's reward command: one JSON object per item in, one number per line out.
fn command_scores(cmd: &str, items: &[Scored]) -> Result<Vec<f64>> {
    let what = format!("grpo.rewards: command:{cmd}");
    let mut child = Command::new("sh").arg("-c").arg(cmd).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().map_err(|e| KilnError::User(format!("{what}: cannot start: {e}")))?;
    let input: String = items.iter().map(|s| serde_json::json!({"prompt": s.prompt, "completion": s.completion, "answer": s.answer}).to_string() + "\n").collect();
    let mut stdin = child.stdin.take().expect("piped");
    // (Written from a thread: a command that answers as it reads would otherwise block on a full pipe.)
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().map_err(|e| KilnError::User(format!("{what}: {e}")))?;
    let _ = writer.join();
    if !out.status.success() {
        return user(format!("{what}: exited with {}", out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let scores: Vec<f64> = text
        .lines()
        .enumerate()
        .map(|(i, l)| l.trim().parse::<f64>().ok().filter(|x| x.is_finite()).ok_or_else(|| KilnError::User(format!("{what}: output line {} is {:?}, not a number", i + 1, l.trim()))))
        .collect::<Result<_>>()?;
    if scores.len() != items.len() {
        return user(format!("{what}: wrote {} scores for {} completions", scores.len(), items.len()));
    }
    Ok(scores)
}
