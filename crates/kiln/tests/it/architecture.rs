//! ARCHITECTURE.md's invariants that the source itself can be checked for.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn src(krate: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(krate).join("src")
}

/// The top-level module a file of `root` belongs to (`train/rank.rs` → `train`).
fn top_module(root: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(root).unwrap();
    let first = rel.components().next().unwrap().as_os_str().to_string_lossy().to_string();
    first.trim_end_matches(".rs").to_string()
}

/// The names `text` reaches as `crate::NAME` (also inside `use crate::{a, b}` groups).
fn crate_refs(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    for (i, _) in text.match_indices("crate::") {
        let rest = &text[i + 7..];
        if let Some(group) = rest.strip_prefix('{') {
            for item in group[..group.find('}').unwrap_or(0)].split(',') {
                out.insert(ident(item.trim()));
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out
}

#[test]
fn kiln_modules_import_without_cycles() {
    let root = src("kiln");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let modules: BTreeSet<String> = files.iter().map(|f| top_module(&root, f)).collect();
    let mut deps: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let m = top_module(&root, f);
        let refs = crate_refs(&std::fs::read_to_string(f).unwrap());
        deps.entry(m.clone()).or_default().extend(refs.into_iter().filter(|r| r != &m && modules.contains(r)));
    }
    // Depth-first search for a back edge; the error names the cycle.
    fn visit(m: &str, deps: &BTreeMap<String, BTreeSet<String>>, path: &mut Vec<String>, done: &mut BTreeSet<String>) {
        if let Some(at) = path.iter().position(|x| x == m) {
            panic!("import cycle in crates/kiln/src: {} -> {m}", path[at..].join(" -> "));
        }
        if done.contains(m) {
            return;
        }
        path.push(m.to_string());
        for d in deps.get(m).into_iter().flatten() {
            visit(d, deps, path, done);
        }
        path.pop();
        done.insert(m.to_string());
    }
    let mut done = BTreeSet::new();
    for m in deps.keys() {
        visit(m, &deps, &mut Vec::new(), &mut done);
    }
    assert!(done.len() >= 15, "the check saw only {} modules: {done:?}", done.len());
}

#[test]
fn the_model_names_no_mesh_communicator_or_rank_count() {
    let root = src("model");
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    assert!(files.len() >= 8, "{files:?}");
    let banned = ["parallel::", "Comm", "DeviceMesh", "mesh", "world", "fn rank", "fn size", "tp_size", "tp_rank", ".tp ", "ep_rank"];
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap();
            for b in banned {
                assert!(!code.contains(b), "{}:{}: `{b}` in the model's code: {line}", f.display(), n + 1);
            }
        }
    }
}

/// `line` without its string and character literals' contents and its `//` comment;
/// `in_str` carries a string literal open across lines.
fn code_of(line: &str, in_str: &mut bool) -> String {
    let (mut out, mut chars) = (String::new(), line.chars().peekable());
    while let Some(c) = chars.next() {
        if *in_str {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => *in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => *in_str = true,
            '/' if chars.peek() == Some(&'/') => break,
            // A character literal ('{', '\'', '\\'), not a lifetime ('a).
            '\'' => {
                let rest: String = chars.clone().take(4).collect();
                let len = match rest.strip_prefix('\\') {
                    Some(escaped) => escaped.find('\'').map(|i| i + 2),
                    None => (rest.chars().nth(1) == Some('\'')).then_some(2),
                };
                if let Some(n) = len {
                    chars.nth(n - 1);
                }
            }
            _ => out.push(c),
        }
    }
    out
}

/// Every function of `text` whose body runs past `limit` lines: its name and line.
fn long_functions(text: &str, limit: usize) -> Vec<(String, usize)> {
    let mut in_str = false;
    let lines: Vec<String> = text.lines().map(|l| code_of(l, &mut in_str)).collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let Some(at) = l.find("fn ").filter(|&a| a == 0 || !l.as_bytes()[a - 1].is_ascii_alphanumeric() && l.as_bytes()[a - 1] != b'_') else { continue };
        let name: String = l[at + 3..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if name.is_empty() {
            continue;
        }
        let (mut depth, mut opened) = (0i32, false);
        for (j, m) in lines.iter().enumerate().skip(i) {
            let code = if j == i { &m[at..] } else { &m[..] };
            for c in code.chars() {
                match c {
                    '{' => (depth, opened) = (depth + 1, true),
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if !opened && code.trim_end().ends_with(';') {
                break;
            }
            if opened && depth <= 0 {
                if j - i + 1 > limit {
                    out.push((name.clone(), i + 1));
                }
                break;
            }
        }
    }
    out
}

/// Functions a newcomer can hold: none in the crates' sources runs over 120 lines, and at most
/// ten anywhere take so many arguments that clippy's `too_many_arguments` has to be allowed
/// (arguments that travel together go as one: a shape, a kernel's saved tensors, its gradients).
#[test]
fn functions_stay_short_and_take_few_arguments() {
    let crates = ["tensor", "device", "model", "parallel", "plan", "data", "kiln"];
    let (mut long, mut allows) = (Vec::new(), Vec::new());
    let allow = concat!("too_many", "_arguments");
    for krate in crates {
        let dir = src(krate).join("..");
        let mut files = Vec::new();
        for sub in ["src", "tests", "benches", "examples"] {
            if dir.join(sub).is_dir() {
                rust_files(&dir.join(sub), &mut files);
            }
        }
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            allows.extend(text.lines().enumerate().filter(|(_, l)| l.contains(allow)).map(|(n, _)| format!("{}:{}", f.display(), n + 1)));
            if f.starts_with(src(krate)) {
                long.extend(long_functions(&text, 120).into_iter().map(|(name, n)| format!("{}:{n} {name}", f.display())));
            }
        }
    }
    assert!(long.is_empty(), "functions over 120 lines: {long:#?}");
    assert!(allows.len() <= 10, "{} allows of {allow} (at most 10): {allows:#?}", allows.len());
    // The scan finds what it looks for.
    let sample = format!("fn f() {{\n{}}}\nfn g(x: char) -> bool {{ x == '{{' }}\n", "    let s = \"}\";\n".repeat(130));
    assert_eq!(long_functions(&sample, 120), vec![("f".to_string(), 1)]);
}
