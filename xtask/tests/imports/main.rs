//! The import graph: no circle of `use` between the modules of one level
//! of a crate's module tree. Checked for the whole of `crates/gpu-emu/src`
//! (`gpu_emu_has_no_import_cycle`) and for metrale-comm's `nccl_backend`
//! (`nccl_backend_has_no_import_cycle`); [`check`] takes any crate and any
//! subtree of it (`under`), so another module directory can be held to it
//! the same way. `cargo test -p xtask --test imports --
//! --nocapture` prints each level's modules in dependency order, those
//! depended on first (`{a, b}`: neither needs the other).
//!
//! Files: `lex.rs` (code as tokens), `tree.rs` (the module tree, the paths
//! named, their resolution), this file (the levels, the cycles, the
//! report, and the tests of the check on small in-memory crates).
//!
//! # The rule
//! At every module `m` of the checked subtree, the nodes are `m`'s child
//! modules and `m`'s own items (shown as `self`). There is an edge `a -> b`
//! when code anywhere under child `a` (its file, its own children, inline
//! `mod` blocks) names something under child `b`, and `self -> b` when
//! `m`'s own file does; a child naming one of `m`'s own items (or an item
//! of `m`'s ancestors, seen at the ancestor's level) is `a -> self`. The
//! check fails on any cycle among these nodes, and its message names the
//! cycle with one reference (file, line, path) for each of its edges.
//!
//! So a module's file may use its children, or its children may use its
//! items, never both; siblings depend on each other one way only.
//!
//! # What counts as naming
//! - a path starting with `crate::`, `super::` or `self::` (also `$crate::`),
//!   anywhere in code: `use` trees (grouped, nested, `self`, globs, `as`),
//!   expressions, types, macro calls;
//! - a path starting with the name of a child module of the current
//!   module, or of a module glob-imported into it (`use super::*`), as
//!   Rust 2018 resolves it;
//! - a path through a `pub use` re-export counts as naming what it
//!   re-exports (resolved to the module that defines it); the `pub use`
//!   itself, like a `mod` declaration, is not an edge.
//!
//! Comments (doc comments and their intra-doc links included) and string,
//! char and raw string literals are skipped. `cfg` attributes are ignored:
//! test modules are part of the graph. A `#[path = ...]` attribute on a
//! module is refused (the file would not be where the check looks). Names
//! brought in by a non-glob `use` are not followed further: the `use`
//! itself is the edge.

mod lex;
mod tree;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};

use tree::{Graph, Ref};

/// One level's edges: (from, to) -> the first reference that makes it.
type Edges = BTreeMap<(String, String), Ref>;

/// The node at `level` that module `m` (at or under `level`) belongs to.
fn node(level: &[String], m: &[String]) -> String {
    m.get(level.len())
        .cloned()
        .unwrap_or_else(|| "self".to_owned())
}

/// The dependency graph of every level under `under`, by level.
fn levels(g: &Graph, under: &[String]) -> BTreeMap<Vec<String>, Edges> {
    let mut out: BTreeMap<Vec<String>, Edges> = BTreeMap::new();
    for m in g.children.keys().filter(|m| m.starts_with(under)) {
        out.entry(m.clone()).or_default();
    }
    for r in &g.refs {
        let Some(to) = g.resolve(&r.from, &r.segs, 0) else {
            continue;
        };
        debug_assert!(g.is_module(&to));
        let common = r.from.iter().zip(&to).take_while(|(a, b)| a == b).count();
        let level = r.from[..common].to_vec();
        let (a, b) = (node(&level, &r.from), node(&level, &to));
        if a == b || !level.starts_with(under) {
            continue;
        }
        out.entry(level)
            .or_default()
            .entry((a, b))
            .or_insert_with(|| r.clone());
    }
    out
}

/// The shortest cycle through `start` in `edges`, if any.
fn cycle_through(edges: &Edges, start: &str) -> Option<Vec<String>> {
    let mut prev: BTreeMap<String, String> = BTreeMap::new();
    let mut queue = VecDeque::from([start.to_owned()]);
    while let Some(n) = queue.pop_front() {
        for (a, b) in edges.keys().filter(|(a, _)| *a == n) {
            if b == start {
                let mut path = vec![a.clone()];
                while let Some(p) = prev.get(path.last()?) {
                    path.push(p.clone());
                }
                path.reverse();
                path.push(start.to_owned());
                return Some(path);
            }
            if !prev.contains_key(b) && b != start {
                prev.insert(b.clone(), a.clone());
                queue.push_back(b.clone());
            }
        }
    }
    None
}

/// The nodes of `edges` in dependency order, in rounds (a round's nodes
/// depend only on earlier rounds), or `None` if it has a cycle.
fn order(nodes: &BTreeSet<String>, edges: &Edges) -> Option<Vec<Vec<String>>> {
    let mut left: BTreeSet<String> = nodes.clone();
    let mut out = Vec::new();
    while !left.is_empty() {
        let ready: Vec<String> = left
            .iter()
            .filter(|n| !edges.keys().any(|(a, b)| a == *n && left.contains(b)))
            .cloned()
            .collect();
        if ready.is_empty() {
            return None;
        }
        for n in &ready {
            left.remove(n);
        }
        out.push(ready);
    }
    Some(out)
}

/// Rounds as `a < {b, c} < d`.
fn show_order(rounds: &[Vec<String>]) -> String {
    rounds
        .iter()
        .map(|r| match r.as_slice() {
            [one] => one.clone(),
            _ => format!("{{{}}}", r.join(", ")),
        })
        .collect::<Vec<_>>()
        .join(" < ")
}

fn module_name(m: &[String]) -> String {
    std::iter::once("crate")
        .chain(m.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("::")
}

/// What the check found: one line per level (its modules in dependency
/// order), and the cycles, each with its evidence.
struct Report {
    overview: Vec<String>,
    cycles: Vec<String>,
}

/// Checks the crate whose root file is `root` (read through `read`):
/// every level at or under module `under`.
fn check(
    read: &dyn Fn(&Path) -> Option<String>,
    root: &Path,
    under: &[&str],
    shown: &dyn Fn(&Path) -> String,
) -> Result<Report, String> {
    let mut g = Graph::default();
    g.load(read, Vec::new(), root.to_path_buf())?;
    let under: Vec<String> = under.iter().map(|s| s.to_string()).collect();
    if !g.is_module(&under) {
        return Err(format!("no module {}", module_name(&under)));
    }
    let mut report = Report {
        overview: Vec::new(),
        cycles: Vec::new(),
    };
    for (level, edges) in levels(&g, &under) {
        if g.children[&level].is_empty() {
            continue;
        }
        let mut nodes: BTreeSet<String> = g.children[&level].clone();
        nodes.insert("self".into());
        let file = shown(&g.files[&level]);
        match order(&nodes, &edges) {
            Some(o) => report.overview.push(format!(
                "{} ({file}): {}",
                module_name(&level),
                show_order(&o)
            )),
            None => {
                let mut seen: BTreeSet<Vec<String>> = BTreeSet::new();
                for n in &nodes {
                    let Some(c) = cycle_through(&edges, n) else {
                        continue;
                    };
                    // One report per cycle, whichever node it was found from.
                    let mut key = c[..c.len() - 1].to_vec();
                    key.sort();
                    if !seen.insert(key) {
                        continue;
                    }
                    let mut msg = format!(
                        "import cycle among the modules of `{}` ({file}): {}",
                        module_name(&level),
                        c.join(" -> ")
                    );
                    for w in c.windows(2) {
                        let r = &edges[&(w[0].clone(), w[1].clone())];
                        msg.push_str(&format!(
                            "\n    {} -> {}: {}:{} names `{}{}`",
                            w[0],
                            w[1],
                            shown(&r.file),
                            r.line,
                            r.segs.join("::"),
                            if r.glob { "::*" } else { "" }
                        ));
                    }
                    report.cycles.push(msg);
                }
            }
        }
    }
    Ok(report)
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// Checks `crate_dir/src/lib.rs` at and under `under` on disk.
fn check_on_disk(crate_dir: &str, under: &[&str]) -> Report {
    let root = workspace_root();
    let lib = root.join(crate_dir).join("src/lib.rs");
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let shown = |p: &Path| p.strip_prefix(&root).unwrap_or(p).display().to_string();
    check(&read, &lib, under, &shown).unwrap_or_else(|e| panic!("import check: {e}"))
}

#[test]
fn gpu_emu_has_no_import_cycle() {
    let report = check_on_disk("crates/gpu-emu", &[]);
    // The layering, lowest first (`cargo test -p xtask --test imports --
    // --nocapture` shows it).
    println!("{}", report.overview.join("\n"));
    assert!(
        report.cycles.is_empty(),
        "gpu-emu: {} import cycle(s):\n{}",
        report.cycles.len(),
        report.cycles.join("\n")
    );
}

#[test]
fn nccl_backend_has_no_import_cycle() {
    let report = check_on_disk("crates/metrale-comm", &["nccl_backend"]);
    println!("{}", report.overview.join("\n"));
    assert!(
        report.cycles.is_empty(),
        "metrale-comm's nccl_backend: {} import cycle(s):\n{}",
        report.cycles.len(),
        report.cycles.join("\n")
    );
}

/// Checks an in-memory crate of `(path, text)` files rooted at `lib.rs`.
fn check_files(files: &[(&str, &str)], under: &[&str]) -> Result<Report, String> {
    let map: BTreeMap<PathBuf, String> = files
        .iter()
        .map(|(p, t)| (PathBuf::from(p), t.to_string()))
        .collect();
    let read = |p: &Path| map.get(p).cloned();
    let shown = |p: &Path| p.display().to_string();
    check(&read, Path::new("lib.rs"), under, &shown)
}

fn cycles(files: &[(&str, &str)]) -> Vec<String> {
    check_files(files, &[]).expect("check").cycles
}

#[test]
fn a_cycle_between_siblings_is_named_with_its_references() {
    let c = cycles(&[
        ("lib.rs", "//! Doc.\nmod a;\nmod b;\nmod c;\n"),
        ("a.rs", "use crate::b::X;\n"),
        ("b.rs", "fn f() { super::c::g(); }\n"),
        ("c.rs", "use crate::{a::{self, Y}};\n"),
    ]);
    assert_eq!(c.len(), 1, "{c:?}");
    assert!(
        c[0].contains("`crate` (lib.rs): a -> b -> c -> a"),
        "{}",
        c[0]
    );
    assert!(
        c[0].contains("a -> b: a.rs:1 names `crate::b::X`"),
        "{}",
        c[0]
    );
    assert!(
        c[0].contains("b -> c: b.rs:1 names `super::c::g`"),
        "{}",
        c[0]
    );
    assert!(c[0].contains("c -> a: c.rs:1 names `crate::a`"), "{}", c[0]);
}

#[test]
fn one_way_dependencies_pass_and_are_ordered() {
    let r = check_files(
        &[
            ("lib.rs", "mod a;\nmod b;\npub(crate) fn shared() {}\n"),
            (
                "a.rs",
                "use crate::shared;\nuse crate::b::{self, X as Y};\n",
            ),
            ("b.rs", "fn f() { crate::shared() }\n"),
        ],
        &[],
    )
    .expect("check");
    assert!(r.cycles.is_empty(), "{:?}", r.cycles);
    assert_eq!(r.overview, ["crate (lib.rs): self < b < a"]);
    let r = check_files(
        &[
            ("lib.rs", "mod a;\nmod b;\nmod c;\n"),
            ("a.rs", "use crate::c::X;\n"),
            ("b.rs", "use super::c::Y;\n"),
            ("c.rs", ""),
        ],
        &[],
    )
    .expect("check");
    assert_eq!(r.overview, ["crate (lib.rs): {c, self} < {a, b}"]);
}

#[test]
fn a_parent_that_uses_a_child_which_uses_it_is_a_cycle() {
    let c = cycles(&[
        ("lib.rs", "mod a;\npub(crate) const K: u8 = a::f();\n"),
        ("a.rs", "pub(crate) const fn f() -> u8 { super::K }\n"),
    ]);
    assert_eq!(c.len(), 1, "{c:?}");
    assert!(c[0].contains("a -> self -> a"), "{}", c[0]);
}

#[test]
fn cycles_are_found_at_every_level_and_counted_where_they_meet() {
    let files = [
        ("lib.rs", "mod n;\nmod top;\n"),
        ("top.rs", "use crate::n::x::Y;\n"),
        ("n/mod.rs", "mod x;\nmod y;\n"),
        (
            "n/x.rs",
            "use super::y::Z;\nmod deep { use crate::top::T; }\n",
        ),
        ("n/y.rs", "fn g() { crate::n::x::h() }\n"),
    ];
    let c = cycles(&files);
    assert_eq!(c.len(), 2, "{c:?}");
    assert!(
        c.iter()
            .any(|m| m.contains("`crate` (lib.rs): n -> top -> n"))
    );
    assert!(
        c.iter()
            .any(|m| m.contains("`crate::n` (n/mod.rs): x -> y -> x"))
    );
    // Checked under `n` only, the top level's cycle is not reported.
    let under = check_files(&files, &["n"]).expect("check").cycles;
    assert_eq!(under.len(), 1, "{under:?}");
}

#[test]
fn re_exports_resolve_to_the_module_that_defines_the_item() {
    let c = cycles(&[
        ("lib.rs", "mod a;\nmod b;\n"),
        ("a/mod.rs", "mod inner;\npub(crate) use inner::Thing;\n"),
        ("a/inner.rs", "use crate::b::Other;\n"),
        ("b.rs", "use crate::a::Thing;\n"),
    ]);
    assert_eq!(c.len(), 1, "{c:?}");
    assert!(c[0].contains("a -> b -> a"), "{}", c[0]);
    // Inside `a`, the `pub use` is no edge from `a`'s own items.
    let inner_ok = cycles(&[
        ("lib.rs", "mod a;\n"),
        ("a/mod.rs", "mod inner;\npub(crate) use inner::Thing;\n"),
        ("a/inner.rs", "pub(crate) struct Thing;\nuse super::*;\n"),
    ]);
    assert!(inner_ok.is_empty(), "{inner_ok:?}");
}

#[test]
fn comments_strings_and_test_modules_are_handled() {
    let c = cycles(&[
        ("lib.rs", "mod a;\nmod b;\n"),
        (
            "a.rs",
            "//! See [`crate::b::X`].\n/* crate::b::Y */\nconst S: &str = \"crate::b::Z\";\n\
             const R: &str = r#\"crate::b::W \"quoted\"\"#;\nconst C: char = '\"';\n\
             fn f<'a>(x: &'a u8) -> &'a u8 { x }\n\
             #[cfg(test)]\nmod tests { use super::*; fn t() { self::f(&1); } }\n",
        ),
        ("b.rs", "use crate::a::f;\n"),
    ]);
    assert!(c.is_empty(), "{c:?}");
}

#[test]
fn bare_paths_through_child_modules_and_globs_count() {
    let c = cycles(&[
        ("lib.rs", "mod a;\nmod b;\nfn f() { a::g() }\n"),
        ("a.rs", "pub(crate) fn g() { super::h() }\n"),
        ("b.rs", "use super::*;\nfn k() { a::g() }\n"),
    ]);
    // `self -> a` (the root's `a::g`) and `a -> self` (its `super::h`).
    assert_eq!(c.len(), 1, "{c:?}");
    assert!(c[0].contains("a -> self -> a"), "{}", c[0]);
}

#[test]
fn a_module_moved_by_a_path_attribute_is_refused() {
    let e = check_files(&[("lib.rs", "#[path = \"x.rs\"]\nmod a;\n")], &[])
        .err()
        .expect("refused");
    assert!(e.contains("`#[path]`"), "{e}");
}
