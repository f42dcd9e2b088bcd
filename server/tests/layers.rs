//! The server's modules form layers, one folder each, and their imports no cycle.
//!
//! Read from the source: every file under `src/` is a module; a `crate::...` or
//! `super::...` path in its code (tests and comments left out) is an edge to the module
//! that path names (the longest module prefix). Edges between a module and its own
//! ancestors or descendants are not counted: a parent declares its children and
//! re-exports them, a child uses what its parent shares; that is one unit.
//!
//! A module's layer is the folder it lives in, the first part of its path; lowest first,
//! a module may use its own layer and those below:
//! 0. `core/`: the data the service reads (state, the session registry, the job threads,
//!    metrics, audit, configuration, keys, the jail, the clock); names no dialect;
//! 1. `service/`: what bud does, with its own input, output and error types;
//! 2. `http/`: bud's own routes, streaming, bodies and errors as HTTP, startup;
//! 3. `compat/`: the dialects (E2B, envd, Jupyter, Piston).
//!
//! The root (`lib.rs`) puts them together and is the only file directly under `src/`.
//! A new folder must be placed in a layer here, or this test fails.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const LAYERS: [&str; 4] = ["core", "service", "http", "compat"];

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("reading server/src") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/a/b.rs` -> `a::b`; `src/a/mod.rs` -> `a`; `src/lib.rs` -> `` (the root).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("a file under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts.join("::")
}

/// The code of a file without its tests and comments.
fn code_of(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or_default();
    text.lines()
        .map(|l| l.split("//").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths of a `use` tree or path that starts at `rest` (after `crate::` or
/// `super::`), each as its segments: `a::{b::c, d}` gives `a::b::c` and `a::d`.
fn paths_at(rest: &str, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let mut segs = prefix.to_vec();
    let mut s = rest;
    loop {
        if let Some(inner) = s.strip_prefix('{') {
            let mut depth = 1;
            let mut start = 0;
            for (i, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' | ',' if depth == 1 => {
                        paths_at(inner[start..i].trim(), &segs, out);
                        start = i + 1;
                        if c == '}' {
                            return;
                        }
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            return;
        }
        let end = s.find(|c| !is_ident(c)).unwrap_or(s.len());
        if end == 0 {
            break;
        }
        segs.push(s[..end].to_owned());
        match s[end..].strip_prefix("::") {
            Some(next) => s = next,
            None => break,
        }
    }
    out.push(segs);
}

/// The modules `code` (module `me`) refers to, resolved against `known`.
fn uses(me: &str, code: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let parent: Vec<String> = {
        let mut p: Vec<String> = me.split("::").map(str::to_owned).collect();
        p.pop();
        p.into_iter().filter(|s| !s.is_empty()).collect()
    };
    let mut paths = Vec::new();
    for (kw, base) in [("crate::", Vec::new()), ("super::", parent)] {
        let mut from = 0;
        while let Some(i) = code[from..].find(kw) {
            let at = from + i;
            let before = code[..at].chars().next_back();
            if !before.is_some_and(is_ident) {
                paths_at(&code[at + kw.len()..], &base, &mut paths);
            }
            from = at + kw.len();
        }
    }
    let mut found = BTreeSet::new();
    for segs in paths {
        let target = (1..=segs.len())
            .rev()
            .map(|n| segs[..n].join("::"))
            .find(|m| known.contains(m));
        if let Some(t) = target {
            found.insert(t);
        }
    }
    found
}

fn related(a: &str, b: &str) -> bool {
    let under = |x: &str, y: &str| x.starts_with(&format!("{y}::"));
    a == b || under(a, b) || under(b, a)
}

/// The layer of `m`: the place in [`LAYERS`] of the folder its path starts with.
fn layer_of(m: &str) -> Option<usize> {
    let top = m.split("::").next()?;
    LAYERS.iter().position(|l| *l == top)
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let known: BTreeSet<String> = all.iter().map(|f| module_of(&src, f)).collect();
    let mut g = BTreeMap::new();
    for f in &all {
        let me = module_of(&src, f);
        if me.is_empty() {
            continue; // the root composes everything
        }
        let text = std::fs::read_to_string(f).expect("reading a source file");
        let deps: BTreeSet<String> = uses(&me, &code_of(&text), &known)
            .into_iter()
            .filter(|d| !d.is_empty() && !related(&me, d))
            .collect();
        g.insert(me, deps);
    }
    g
}

fn cycle_from(
    g: &BTreeMap<String, BTreeSet<String>>,
    node: &str,
    path: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if let Some(i) = path.iter().position(|p| p == node) {
        let mut cycle = path[i..].to_vec();
        cycle.push(node.to_owned());
        return Some(cycle);
    }
    if done.contains(node) {
        return None;
    }
    path.push(node.to_owned());
    for next in g.get(node).into_iter().flatten() {
        if let Some(c) = cycle_from(g, next, path, done) {
            return Some(c);
        }
    }
    path.pop();
    done.insert(node.to_owned());
    None
}

#[test]
fn the_modules_import_one_another_without_a_cycle() {
    let g = graph();
    let mut done = BTreeSet::new();

    let cycle = g
        .keys()
        .find_map(|m| cycle_from(&g, m, &mut Vec::new(), &mut done));

    assert!(g.len() > 20, "too few modules found: {:?}", g.keys());
    assert_eq!(cycle, None, "an import cycle");
}

#[test]
fn every_module_uses_only_its_own_layer_and_those_below() {
    let g = graph();
    let mut unplaced = Vec::new();
    let mut upward = Vec::new();

    for (m, deps) in &g {
        let Some(mine) = layer_of(m) else {
            unplaced.push(m.clone());
            continue;
        };
        for d in deps {
            match layer_of(d) {
                Some(theirs) if theirs > mine => upward.push(format!(
                    "{m} ({}) uses {d} ({})",
                    LAYERS[mine], LAYERS[theirs]
                )),
                Some(_) => {}
                None => unplaced.push(d.clone()),
            }
        }
    }

    assert_eq!(unplaced, Vec::<String>::new(), "modules without a layer");
    assert_eq!(upward, Vec::<String>::new(), "uses of a higher layer");
}

#[test]
fn no_file_but_the_root_lies_directly_under_src() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut loose: Vec<String> = std::fs::read_dir(&src)
        .expect("reading server/src")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "rs"))
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    loose.sort();

    assert_eq!(loose, vec!["lib.rs".to_owned()]);
}

#[test]
fn a_layer_is_read_from_the_path() {
    assert_eq!(layer_of("core::sessions"), Some(0));
    assert_eq!(layer_of("service"), Some(1));
    assert_eq!(layer_of("http::jobs"), Some(2));
    assert_eq!(layer_of("compat::e2b::control"), Some(3));
    assert_eq!(layer_of("routes"), None);
}

#[test]
fn the_reader_finds_grouped_nested_and_relative_paths() {
    let known: BTreeSet<String> = ["a", "a::b", "c", "d", "x::y"]
        .into_iter()
        .map(String::from)
        .collect();
    let code = "use crate::{a::b::Thing, c, d::{e, f}};\nlet v = super::y::z(); crate::nope::q();";

    let found = uses("x::w", code, &known);

    assert_eq!(
        found.into_iter().collect::<Vec<_>>(),
        vec!["a::b", "c", "d", "x::y"]
    );
}
