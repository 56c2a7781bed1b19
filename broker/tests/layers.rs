//! The AMQP crate is built in layers: a module imports only from modules of lower layers, so its
//! import graph has no cycle. This test reads `src/` and checks both rules; a new module must be
//! given its layer here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Bottom up. A module may use (`crate::x`) only modules of a lower layer.
const LAYERS: &[&[&str]] = &[
    // Data and leaf helpers.
    &[
        "config",
        "amqp_values",
        "backoff",
        "wake",
        "exchange_probe",
        "identity",
    ],
    // The bridge's message types, acknowledgement records, one connection, the reconnect driver.
    &["bridge", "ack", "connection", "reconnect"],
    &["events", "outbound"],
    // One publish on its way; the frame of an AMQP thread.
    &["batch", "runtime_thread"],
    // The clients of a broker and what they do on a connection.
    &["publisher", "declare", "listener", "inbox"],
    &["session"],
    &["supervisor"],
    &["thread"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file below `dir`, as (path relative to src, text).
fn sources(dir: &Path, out: &mut Vec<(String, String)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(src_dir()).unwrap();
            let text = std::fs::read_to_string(&path).unwrap();
            out.push((rel.to_string_lossy().into_owned(), text));
        }
    }
}

/// The code of a file without its comments (doc comments name modules too).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The names that follow `prefix::` in `code`, including every item of `prefix::{a, b::c}`.
fn paths_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let pat = format!("{prefix}::");
    let mut rest = code;
    while let Some(i) = rest.find(&pat) {
        let before = rest[..i].chars().last();
        rest = &rest[i + pat.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for item in group[..end].split(',') {
                let name: String = item
                    .trim()
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    names.insert(name);
                }
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            names.insert(name);
        }
    }
    names
}

/// `connection/open.rs` → ("connection", Some("open")); `session.rs` → ("session", None).
fn module_of(file: &str) -> (String, Option<String>) {
    let file = file.trim_end_matches(".rs");
    match file.split_once('/') {
        Some((top, "mod")) => (top.to_string(), None),
        Some((top, sub)) => (top.to_string(), Some(sub.to_string())),
        None => (file.to_string(), None),
    }
}

/// Edges between files: `crate::m` to module `m`, `super::x` to the sibling file `x`.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    sources(&src_dir(), &mut files);
    let modules: BTreeSet<String> = files.iter().map(|(f, _)| module_of(f).0).collect();
    let mut edges = BTreeMap::new();
    for (file, text) in &files {
        let (top, sub) = module_of(file);
        let code = code(text);
        let mut to = BTreeSet::new();
        for m in paths_after(&code, "crate") {
            if modules.contains(&m) && m != top {
                to.insert(m);
            }
        }
        if sub.is_some() {
            for s in paths_after(&code, "super") {
                if files
                    .iter()
                    .any(|(f, _)| module_of(f) == (top.clone(), Some(s.clone())))
                {
                    to.insert(format!("{top}/{s}"));
                }
            }
        }
        // A module's root stands for its files: it depends on each of them.
        if file.ends_with("/mod.rs") {
            for (f, _) in &files {
                if let (t, Some(s)) = module_of(f) {
                    if t == top {
                        to.insert(format!("{t}/{s}"));
                    }
                }
            }
        }
        let node = match &sub {
            Some(s) => format!("{top}/{s}"),
            None if file.ends_with("/mod.rs") => format!("{top}/mod"),
            None => top,
        };
        edges.entry(node).or_insert_with(BTreeSet::new).extend(to);
    }
    edges
}

#[test]
fn every_module_imports_only_from_lower_layers() {
    let mut wrong = Vec::new();
    for (node, to) in graph() {
        let top = node.split('/').next().unwrap_or_default().to_string();
        if top == "lib" {
            continue;
        }
        let Some(mine) = layer_of(&top) else {
            wrong.push(format!("{node}: not in LAYERS (give it a layer)"));
            continue;
        };
        for m in to.iter().filter(|m| !m.contains('/')) {
            match layer_of(m) {
                Some(theirs) if theirs < mine => {}
                _ => wrong.push(format!(
                    "{node} (layer {mine}) uses {m} (layer {:?})",
                    layer_of(m)
                )),
            }
        }
    }
    assert!(wrong.is_empty(), "layering broken:\n{}", wrong.join("\n"));
}

#[test]
fn the_import_graph_has_no_cycle() {
    let edges = graph();
    // Depth-first search; a node met again while still on the path closes a cycle.
    fn visit(
        n: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == n) {
            let mut cycle = path[i..].to_vec();
            cycle.push(n.to_string());
            return Some(cycle);
        }
        if !done.insert(n.to_string()) {
            return None;
        }
        path.push(n.to_string());
        for m in edges.get(n).into_iter().flatten() {
            let target = if edges.contains_key(m) {
                m.clone()
            } else {
                format!("{m}/mod")
            };
            if let Some(c) = visit(&target, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    for n in edges.keys() {
        if let Some(cycle) = visit(n, &edges, &mut Vec::new(), &mut done) {
            panic!("import cycle: {}", cycle.join(" -> "));
        }
    }
}

#[test]
fn the_checks_see_imports_and_cycles() {
    // The parser finds grouped, nested and plain paths, and skips comments.
    let code = code("use crate::{a, b::C};\nlet x = crate::d::f(); // crate::e\nuse super::g;");
    assert_eq!(
        paths_after(&code, "crate"),
        ["a", "b", "d"].iter().map(|s| s.to_string()).collect()
    );
    assert_eq!(
        paths_after(&code, "super"),
        ["g"].iter().map(|s| s.to_string()).collect()
    );
    // And the graph of the real crate is not empty: session uses the reconnect driver.
    let edges = graph();
    assert!(edges["session"].contains("reconnect"), "{edges:?}");
    assert!(
        edges["connection/mod"].contains("connection/errors"),
        "{edges:?}"
    );
    assert!(
        edges["connection/open"].contains("connection/tls"),
        "{edges:?}"
    );
}
