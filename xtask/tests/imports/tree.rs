//! The import check's view of a crate: its module tree (from `mod`
//! declarations and inline `mod` blocks), the paths its code names, its
//! `pub use` re-exports and glob imports, and the resolution of a path to
//! the module it leads into.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::lex::{Tok, lex};

/// One path named in code.
#[derive(Debug, Clone)]
pub(crate) struct Ref {
    /// The module whose code names it (inline modules included).
    pub(crate) from: Vec<String>,
    /// Its segments as written (`crate`, `super`, `self` kept).
    pub(crate) segs: Vec<String>,
    /// Whether it ends in `::*`.
    pub(crate) glob: bool,
    pub(crate) file: PathBuf,
    pub(crate) line: usize,
}

/// A `pub use` of a module: what a path through `name` resolves to.
#[derive(Debug, Clone)]
struct Reexport {
    /// The module holding the `pub use`.
    at: Vec<String>,
    segs: Vec<String>,
}

/// A crate's module tree and every path its code names.
#[derive(Default)]
pub(crate) struct Graph {
    /// Module path -> its child modules' names.
    pub(crate) children: BTreeMap<Vec<String>, BTreeSet<String>>,
    /// Module path -> the file that holds it.
    pub(crate) files: BTreeMap<Vec<String>, PathBuf>,
    /// Module path -> (name -> re-export), and its glob re-exports.
    reexports: BTreeMap<Vec<String>, BTreeMap<String, Reexport>>,
    glob_reexports: BTreeMap<Vec<String>, Vec<Reexport>>,
    /// Module path -> modules glob-imported into it.
    globs: BTreeMap<Vec<String>, Vec<Ref>>,
    pub(crate) refs: Vec<Ref>,
}

/// An item of a `use` tree: its full path, the name it binds, whether it
/// is a glob.
type UseItem = (Vec<String>, Option<String>, bool);

/// Parses a `use` tree at `toks[*i]` (after `use`), with `prefix` before it.
fn use_tree(toks: &[(Tok, usize)], i: &mut usize, prefix: Vec<String>, out: &mut Vec<UseItem>) {
    let mut path = prefix;
    loop {
        match toks.get(*i).map(|t| &t.0) {
            Some(Tok::Sep) => *i += 1,
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push((path, None, true));
                return;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    match toks.get(*i).map(|t| &t.0) {
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        None => return,
                        _ => use_tree(toks, i, path.clone(), out),
                    }
                }
            }
            Some(Tok::Ident(s)) if s == "self" && !path.is_empty() => {
                *i += 1;
                let alias = use_alias(toks, i);
                let name = alias.or_else(|| path.last().cloned());
                out.push((path, name, false));
                return;
            }
            Some(Tok::Ident(s)) => {
                path.push(s.clone());
                *i += 1;
                if toks.get(*i).map(|t| &t.0) != Some(&Tok::Sep) {
                    let alias = use_alias(toks, i);
                    let name = alias.or_else(|| path.last().cloned());
                    out.push((path, name, false));
                    return;
                }
            }
            _ => {
                out.push((path, None, false));
                return;
            }
        }
    }
}

/// `as NAME` after a use item, if present.
fn use_alias(toks: &[(Tok, usize)], i: &mut usize) -> Option<String> {
    if toks.get(*i).map(|t| &t.0) == Some(&Tok::Ident("as".into())) {
        let name = match toks.get(*i + 1).map(|t| &t.0) {
            Some(Tok::Ident(n)) => Some(n.clone()),
            _ => Some("_".into()),
        };
        *i += 2;
        return name;
    }
    None
}

/// The file of module `name` declared in `file` (whose module owns a
/// directory when it is `lib.rs`, `main.rs` or `mod.rs`), inside the
/// inline modules `inline`.
fn child_file(file: &Path, inline: &[String], name: &str) -> Vec<PathBuf> {
    let dir = file.parent().unwrap_or(Path::new(""));
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let mut base = if matches!(stem, "lib" | "main" | "mod") {
        dir.to_path_buf()
    } else {
        dir.join(stem)
    };
    for m in inline {
        base = base.join(m);
    }
    vec![
        base.join(format!("{name}.rs")),
        base.join(name).join("mod.rs"),
    ]
}

impl Graph {
    /// Reads module `path` from `file` and, recursively, its children.
    pub(crate) fn load(
        &mut self,
        read: &dyn Fn(&Path) -> Option<String>,
        path: Vec<String>,
        file: PathBuf,
    ) -> Result<(), String> {
        let text = read(&file).ok_or_else(|| format!("cannot read {}", file.display()))?;
        self.files.insert(path.clone(), file.clone());
        self.children.entry(path.clone()).or_default();
        let toks = lex(&text);
        // The inline modules open at this point: (name, brace depth inside).
        let mut inline: Vec<(String, usize)> = Vec::new();
        let mut depth = 0usize;
        let mut i = 0;
        let here = |inline: &[(String, usize)]| -> Vec<String> {
            let mut p = path.clone();
            p.extend(inline.iter().map(|(n, _)| n.clone()));
            p
        };
        while i < toks.len() {
            let (tok, line) = (&toks[i].0, toks[i].1);
            let prev = i.checked_sub(1).map(|k| &toks[k].0);
            match tok {
                Tok::Punct('{') => {
                    depth += 1;
                    i += 1;
                }
                Tok::Punct('}') => {
                    if inline.last().is_some_and(|(_, d)| *d == depth) {
                        inline.pop();
                    }
                    depth = depth.saturating_sub(1);
                    i += 1;
                }
                Tok::Punct('#') => {
                    // `#[path = ..]` would move a module's file.
                    let is_path = toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Punct('['))
                        && toks.get(i + 2).map(|t| &t.0) == Some(&Tok::Ident("path".into()))
                        && toks.get(i + 3).map(|t| &t.0) == Some(&Tok::Punct('='));
                    if is_path {
                        return Err(format!(
                            "{}:{line}: `#[path]` on a module is not supported by the import check",
                            file.display()
                        ));
                    }
                    i += 1;
                }
                Tok::Ident(kw) if kw == "pub" => {
                    // Skip a visibility's path: `pub(in crate::x)` is no reference.
                    i += 1;
                    if toks.get(i).map(|t| &t.0) == Some(&Tok::Punct('(')) {
                        while i < toks.len() && toks[i].0 != Tok::Punct(')') {
                            i += 1;
                        }
                        i += 1;
                    }
                }
                Tok::Ident(kw) if kw == "mod" && prev != Some(&Tok::Sep) => {
                    let Some(Tok::Ident(name)) = toks.get(i + 1).map(|t| &t.0) else {
                        i += 1;
                        continue;
                    };
                    let name = name.clone();
                    let at = here(&inline);
                    self.children
                        .entry(at.clone())
                        .or_default()
                        .insert(name.clone());
                    match toks.get(i + 2).map(|t| &t.0) {
                        Some(Tok::Punct(';')) => {
                            let names: Vec<String> =
                                inline.iter().map(|(n, _)| n.clone()).collect();
                            let candidates = child_file(&file, &names, &name);
                            let Some(f) = candidates.iter().find(|f| read(f).is_some()) else {
                                return Err(format!(
                                    "{}:{line}: no file for `mod {name};` (looked for {})",
                                    file.display(),
                                    candidates[0].display()
                                ));
                            };
                            let mut child = at;
                            child.push(name);
                            self.load(read, child, f.clone())?;
                            i += 3;
                        }
                        Some(Tok::Punct('{')) => {
                            depth += 1;
                            inline.push((name.clone(), depth));
                            let mut child = at;
                            child.push(name);
                            self.children.entry(child.clone()).or_default();
                            self.files.entry(child).or_insert_with(|| file.clone());
                            i += 3;
                        }
                        _ => i += 1,
                    }
                }
                Tok::Ident(kw) if kw == "use" && prev != Some(&Tok::Sep) => {
                    let public = matches!(prev, Some(Tok::Ident(p)) if p == "pub")
                        || (prev == Some(&Tok::Punct(')')) && {
                            // `pub(crate) use`, `pub(super) use`, `pub(in ..) use`
                            let mut k = i - 1;
                            while k > 0 && toks[k].0 != Tok::Punct('(') {
                                k -= 1;
                            }
                            k > 0 && toks[k - 1].0 == Tok::Ident("pub".into())
                        });
                    i += 1;
                    let mut items = Vec::new();
                    use_tree(&toks, &mut i, Vec::new(), &mut items);
                    let from = here(&inline);
                    for (segs, name, glob) in items {
                        let r = Ref {
                            from: from.clone(),
                            segs: segs.clone(),
                            glob,
                            file: file.clone(),
                            line,
                        };
                        if glob {
                            self.globs.entry(from.clone()).or_default().push(r.clone());
                        }
                        if public {
                            let re = Reexport {
                                at: from.clone(),
                                segs,
                            };
                            if glob {
                                self.glob_reexports
                                    .entry(from.clone())
                                    .or_default()
                                    .push(re);
                            } else if let Some(n) = name.filter(|n| n != "_") {
                                self.reexports
                                    .entry(from.clone())
                                    .or_default()
                                    .insert(n, re);
                            }
                        } else {
                            self.refs.push(r);
                        }
                    }
                }
                Tok::Ident(first)
                    if toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Sep)
                        && !matches!(prev, Some(Tok::Sep | Tok::Punct('.'))) =>
                {
                    let mut segs = vec![first.clone()];
                    let mut k = i + 1;
                    while toks.get(k).map(|t| &t.0) == Some(&Tok::Sep) {
                        match toks.get(k + 1).map(|t| &t.0) {
                            Some(Tok::Ident(s)) => {
                                segs.push(s.clone());
                                k += 2;
                            }
                            _ => break,
                        }
                    }
                    self.refs.push(Ref {
                        from: here(&inline),
                        segs,
                        glob: false,
                        file: file.clone(),
                        line,
                    });
                    i = k;
                }
                _ => i += 1,
            }
        }
        Ok(())
    }

    pub(crate) fn is_module(&self, p: &[String]) -> bool {
        self.children.contains_key(p)
    }

    /// The module a path written in module `from` leads into: the deepest
    /// module it names (the item, if any, is that module's own); `None`
    /// for paths outside the crate.
    pub(crate) fn resolve(
        &self,
        from: &[String],
        segs: &[String],
        hops: usize,
    ) -> Option<Vec<String>> {
        if hops > 16 {
            return None;
        }
        let first = segs.first()?;
        let (mut at, rest): (Vec<String>, &[String]) = match first.as_str() {
            "crate" => (Vec::new(), &segs[1..]),
            "$crate" => (Vec::new(), &segs[1..]),
            "self" => (from.to_vec(), &segs[1..]),
            "super" => {
                let mut at = from.to_vec();
                let mut k = 0;
                while segs.get(k).is_some_and(|s| s == "super") {
                    at.pop()?;
                    k += 1;
                }
                (at, &segs[k..])
            }
            name if self.has_child(from, name) => (from.to_vec(), segs),
            name => {
                // A child of a module glob-imported here (`use super::*`).
                let via = self.globs.get(from)?.iter().find_map(|g| {
                    let m = self.resolve(&g.from, &g.segs, hops + 1)?;
                    self.has_child(&m, name).then_some(m)
                })?;
                (via, segs)
            }
        };
        for (k, s) in rest.iter().enumerate() {
            if self.has_child(&at, s) {
                at.push(s.clone());
                continue;
            }
            if let Some(re) = self.reexports.get(&at).and_then(|m| m.get(s)) {
                let mut next = re.segs.clone();
                next.extend(rest[k + 1..].iter().cloned());
                return self.resolve(&re.at, &next, hops + 1).or(Some(at));
            }
            if let Some(globs) = self.glob_reexports.get(&at) {
                for re in globs {
                    let mut next = re.segs.clone();
                    next.extend(rest[k..].iter().cloned());
                    if let Some(m) = self.resolve(&re.at, &next, hops + 1)
                        && m.len() > at.len()
                    {
                        return Some(m);
                    }
                }
            }
            break;
        }
        Some(at)
    }

    fn has_child(&self, m: &[String], name: &str) -> bool {
        self.children.get(m).is_some_and(|c| c.contains(name))
    }
}
