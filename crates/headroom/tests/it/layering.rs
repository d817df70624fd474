//! The library's layers, checked from its sources: every module names only modules of its own
//! layer or of the layers beneath it, and no two modules name each other through a chain of
//! `use`s. A new strategy or model that reaches up (a strategy calling the model code, the
//! spec naming the simulator) fails here rather than growing an import circle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The library's top-level modules, lowest first: each may name those of its own rank or
/// below.
const LIBRARY: [(&str, u32); 16] = [
    ("dtype", 0),
    ("error", 0),
    ("limits", 0),
    ("units", 0),
    ("arch", 1),
    ("gpu", 1),
    ("catalog", 2),
    ("spec", 3),
    ("sim", 4),
    ("estimate", 5),
    ("validate", 6),
    ("plan", 6),
    ("trace", 6),
    ("diagnose", 7),
    ("report", 8),
    ("lib", 9),
];

/// Each layer of the simulator and the layers it may name.
const LAYERS: [(&str, &[&str]); 7] = [
    ("cores", &[]),
    ("engine", &[]),
    ("optim", &["engine"]),
    ("strategy", &["engine", "optim"]),
    ("model", &["engine", "strategy"]),
    ("memo", &["engine"]),
    (
        "harness",
        &["cores", "engine", "optim", "strategy", "model", "memo"],
    ),
];

/// The module path of a source file under `src/`, e.g. `sim::engine::tracer`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The paths a source names through `crate::` or `super::`, each as its segments (the first
/// name of every item of a `{...}` group), test modules left out.
fn named_paths(source: &str) -> Vec<Vec<String>> {
    let code = source.split("#[cfg(test)]").next().unwrap_or(source);
    let code: String = code
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let bytes = code.as_bytes();
    let mut paths = Vec::new();
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(start) {
            let begin = from + at;
            from = begin + start.len();
            if begin > 0 && (bytes[begin - 1].is_ascii_alphanumeric() || bytes[begin - 1] == b'_') {
                continue;
            }
            let mut segments = Vec::new();
            let mut i = begin;
            loop {
                let end = code[i..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .map_or(code.len(), |e| i + e);
                segments.push(code[i..end].to_string());
                if code[end..].starts_with("::") {
                    i = end + 2;
                    if code[i..].starts_with('{') {
                        // Each item of the group continues the path.
                        let close = code[i..].find('}').map_or(code.len(), |c| i + c);
                        for item in code[i + 1..close].split(',') {
                            let first = item.trim().split("::").next().unwrap_or("").trim();
                            if !first.is_empty() && first != "self" {
                                let mut p = segments.clone();
                                p.push(first.to_string());
                                paths.push(p);
                            }
                        }
                        segments.clear();
                        break;
                    }
                } else {
                    break;
                }
            }
            if !segments.is_empty() {
                paths.push(segments);
            }
        }
    }
    paths
}

/// The module a path names, resolved from module `from`: the longest prefix that is a file.
fn resolve(
    from: &[String],
    path: &[String],
    modules: &BTreeSet<Vec<String>>,
) -> Option<Vec<String>> {
    let mut full: Vec<String> = Vec::new();
    let mut rest = path;
    if rest.first().is_some_and(|s| s == "crate") {
        rest = &rest[1..];
    } else {
        full = from.to_vec();
        while rest.first().is_some_and(|s| s == "super") {
            full.pop();
            rest = &rest[1..];
        }
    }
    full.extend(rest.iter().cloned());
    (1..=full.len())
        .rev()
        .map(|n| full[..n].to_vec())
        .find(|m| modules.contains(m))
}

#[test]
fn layers_name_only_what_lies_beneath_and_no_module_names_itself_back() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(&src, f)).collect();
    let allowed: BTreeMap<&str, &[&str]> = LAYERS.into_iter().collect();
    let rank: BTreeMap<&str, u32> = LIBRARY.into_iter().collect();
    for m in modules.iter().filter(|m| m.len() == 1) {
        assert!(
            rank.contains_key(m[0].as_str()),
            "`{}` has no place in the library's layers (LIBRARY)",
            m[0]
        );
    }
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    let mut wrong = Vec::new();
    for file in &files {
        let from = module_of(&src, file);
        let source = std::fs::read_to_string(file).expect("readable source");
        for path in named_paths(&source) {
            let Some(to) = resolve(&from, &path, &modules) else {
                continue;
            };
            // A module naming its own ancestors (`mod.rs` re-exports) is no dependency.
            if to.len() <= from.len() && from[..to.len()] == to[..] {
                continue;
            }
            if rank[from[0].as_str()] < rank[to[0].as_str()] {
                wrong.push(format!("{} names {}", from.join("::"), to.join("::")));
            }
            let within_sim = from[0] == "sim" && to[0] == "sim";
            if let (true, Some(a), Some(b)) = (within_sim, from.get(1), to.get(1))
                && a != b
                && !allowed[a.as_str()].contains(&b.as_str())
            {
                wrong.push(format!("{} names {}", from.join("::"), to.join("::")));
            }
            edges.entry(from.clone()).or_default().insert(to);
        }
    }
    assert!(
        allowed.len()
            == modules
                .iter()
                .filter(|m| m.len() == 2 && m[0] == "sim")
                .count(),
        "every module directly under sim/ is one of the layers {:?}",
        LAYERS.map(|l| l.0)
    );
    assert!(
        wrong.is_empty(),
        "names across layers upward:\n{}",
        wrong.join("\n")
    );
    // No cycle: a depth-first walk never meets a module on its own path.
    fn visit(
        m: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        path: &mut Vec<Vec<String>>,
        done: &mut BTreeSet<Vec<String>>,
    ) -> Option<String> {
        if let Some(i) = path.iter().position(|p| p == m) {
            let cycle: Vec<String> = path[i..].iter().chain([m]).map(|p| p.join("::")).collect();
            return Some(cycle.join(" -> "));
        }
        if !done.insert(m.clone()) {
            return None;
        }
        path.push(m.clone());
        for next in edges.get(m).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    for m in &modules {
        let cycle = visit(m, &edges, &mut Vec::new(), &mut done);
        assert!(
            cycle.is_none(),
            "import circle: {}",
            cycle.unwrap_or_default()
        );
    }
}
