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
