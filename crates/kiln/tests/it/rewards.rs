//! The verifiable rewards: final answers found by the pattern, exact and numeric matches,
//! regex and format rewards, a user's command, weights; and every bad spec refused in one line.

use kiln::reward::{Rewards, Scored};

const NUMBER: &str = r"(-?\d+(?:\.\d+)?)";

fn item<'a>(completion: &'a str, answer: &'a str) -> Scored<'a> {
    Scored { prompt: "q", completion, answer }
}

#[test]
fn built_in_rewards_score_completions() {
    let specs: Vec<String> = ["exact", "numeric:0.01", "regex:=", "format:\\d+\\."].iter().map(|s| s.to_string()).collect();
    let r = Rewards::new(&specs, &[], NUMBER).unwrap();
    assert_eq!(r.final_answer("3 + 4 = 7, so 7."), Some("7"));
    assert_eq!(r.final_answer("no number"), None);
    let items = [item("12.", "12"), item("so 11.999", "12"), item("x = 13", "12"), item("", "12"), item("12.004", "12")];
    let each = r.each(&items).unwrap();
    assert_eq!(each[0], vec![1.0, 0.0, 0.0, 0.0, 0.0], "exact");
    assert_eq!(each[1], vec![1.0, 1.0, 0.0, 0.0, 1.0], "numeric within 0.01");
    assert_eq!(each[2], vec![0.0, 0.0, 1.0, 0.0, 0.0], "regex anywhere");
    assert_eq!(each[3], vec![1.0, 0.0, 0.0, 0.0, 0.0], "format: the whole completion");
    assert_eq!(r.total(&each), vec![3.0, 1.0, 1.0, 0.0, 1.0]);
    // Weights, and a pattern with a group: GSM8K's "#### 42".
    let r = Rewards::new(&["exact".into(), "regex:####".into()], &[2.0, 0.5], r"####\s*(\S+)").unwrap();
    let each = r.each(&[item("work... #### 42", "42"), item("#### 41", "42")]).unwrap();
    assert_eq!(r.total(&each), vec![2.5, 0.5]);
}

#[test]
fn a_users_command_scores_json_lines() {
    // Scores each completion by its length, reading the JSON lines it is given.
    let cmd = "python3 -c \"import sys, json; [print(len(json.loads(l)['completion'])) for l in sys.stdin]\"";
    let r = Rewards::new(&[format!("command:{cmd}")], &[], NUMBER).unwrap();
    let each = r.each(&[item("ab", "1"), item("abcd", "1"), item("", "1")]).unwrap();
    assert_eq!(each[0], vec![2.0, 4.0, 0.0]);
    // Too few lines, a word, a failure: each named.
    for (cmd, needle) in [("echo 1", "wrote 1 scores for 2 completions"), ("printf 'x\\ny\\n'", "output line 1 is \"x\""), ("exit 3", "exited with")] {
        let r = Rewards::new(&[format!("command:{cmd}")], &[], NUMBER).unwrap();
        let e = r.each(&[item("a", "1"), item("b", "1")]).unwrap_err().to_string();
        assert!(e.contains(needle) && e.contains("grpo.rewards"), "{cmd}: {e}");
    }
}

#[test]
fn bad_reward_specs_are_refused_naming_them() {
    let cases: [(&[&str], &[f64], &str, &str); 6] = [
        (&[], &[], NUMBER, "grpo.rewards is empty"),
        (&["exactly"], &[], NUMBER, "`exactly` is not a reward"),
        (&["numeric:-1"], &[], NUMBER, "non-negative tolerance"),
        (&["regex:("], &[], NUMBER, "not a regular expression"),
        (&["exact"], &[1.0, 2.0], NUMBER, "2 weights for 1 rewards"),
        (&["exact"], &[], "(", "grpo.answer_pattern"),
    ];
    for (specs, w, pat, needle) in cases {
        let specs: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
        let e = Rewards::new(&specs, w, pat).unwrap_err().to_string();
        assert!(e.contains(needle), "{specs:?}: {e}");
    }
}
