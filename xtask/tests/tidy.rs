//! Tidy: house-style rules no compiler lint enforces, checked over every `.rs`
//! file of the workspace (`crates/`, `xtask/`, `benches/`; not `target/` and
//! not the generated `crates/*/src/bindings.rs`).
//!
//! Rules, each reported as `path:line: problem; fix`:
//! - a file's first line is a `//!` module doc;
//! - every `unsafe {` block and `unsafe impl` has a comment containing
//!   `SAFETY:` in the comment block directly above its line (blank lines and
//!   `#[...]` attributes may sit between);
//! - no comment carries a date stamp (`YYYY-MM-DD`, 19xx/20xx) or an owner tag
//!   (`TODO`, `FIXME` or `XXX` followed by a parenthesised name);
//! - no file is over [`MAX_LINES`] lines (src, tests, benches, examples and
//!   xtask alike; the generated bindings are not checked, and committed PTX
//!   is not a `.rs` file), except the files in [`BEING_SPLIT`], which must
//!   each still be over it and still exist, so that the list cannot go stale;
//! - a file of [`LOCK_ORDER_DIRS`] that declares a struct with two or more
//!   `Mutex<`/`RwLock<` in its fields, or two or more lock statics, says
//!   "lock order" (any case) in its `//!` doc (docs/style.md, "Locks").
//!
//! The checks are line-based heuristics: text inside a string literal on the
//! same line is ignored by counting quotes before it.

use std::path::{Path, PathBuf};

/// The most lines a hand-written source file may have (docs/style.md, "File
/// layout"). A file that grows past it is split by responsibility, not by
/// line count.
const MAX_LINES: usize = 800;

/// The source trees whose files with several locks must state their lock
/// order.
const LOCK_ORDER_DIRS: &[&str] = &[
    "crates/metrale-comm/src",
    "crates/metrale-rendezvous/src",
    "crates/nccl-safe/src",
];

/// Checks one file's text; returns `(line, message)` for each problem.
fn check_text(text: &str) -> Vec<(usize, String)> {
    let mut problems = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    if !lines.first().is_some_and(|l| l.starts_with("//!")) {
        problems.push((
            1,
            "file does not start with a `//!` module doc; add one saying what the \
             file is for and its invariants"
                .to_owned(),
        ));
    }
    for (i, line) in lines.iter().enumerate() {
        if let Some(kind) = unsafe_site(line)
            && !has_safety_comment(&lines, i)
        {
            problems.push((
                i + 1,
                format!(
                    "`{kind}` without a `// SAFETY:` comment directly above it; add one \
                     saying, in the present tense, why it is sound"
                ),
            ));
        }
        if let Some(comment) = comment_part(line) {
            if let Some(date) = find_date(comment) {
                problems.push((
                    i + 1,
                    format!("comment carries the date `{date}`; remove it (history lives in git)"),
                ));
            }
            if let Some(tag) = find_owner_tag(comment) {
                problems.push((
                    i + 1,
                    format!("comment carries an owner tag `{tag}`; drop the name"),
                ));
            }
        }
    }
    problems
}

/// Byte offset of `needle` in `line` outside string literals and before any
/// `//` comment, if any.
fn find_code(line: &str, needle: &str) -> Option<usize> {
    let code_end = comment_start(line).unwrap_or(line.len());
    let code = &line[..code_end];
    let mut from = 0;
    while let Some(pos) = code[from..].find(needle) {
        let at = from + pos;
        let before_ok = code[..at]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
        if before_ok && !in_string(code, at) {
            return Some(at);
        }
        from = at + needle.len();
    }
    None
}

/// Whether byte `at` of `line` lies inside a `"..."` literal (quote parity,
/// ignoring escaped quotes).
fn in_string(line: &str, at: usize) -> bool {
    let mut inside = false;
    let mut escaped = false;
    for c in line[..at].chars() {
        match c {
            '\\' if inside => escaped = !escaped,
            '"' if !escaped => inside = !inside,
            _ => escaped = false,
        }
        if c != '\\' {
            escaped = false;
        }
    }
    inside
}

/// Byte offset where a `//` comment starts on `line`, outside strings.
fn comment_start(line: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(pos) = line[from..].find("//") {
        let at = from + pos;
        if !in_string(line, at) {
            return Some(at);
        }
        from = at + 2;
    }
    None
}

/// The comment text of `line`, if it has one.
fn comment_part(line: &str) -> Option<&str> {
    comment_start(line).map(|at| &line[at..])
}

/// `unsafe {` or `unsafe impl` if `line` opens one in code.
fn unsafe_site(line: &str) -> Option<&'static str> {
    if find_code(line, "unsafe {").is_some() {
        Some("unsafe {")
    } else if find_code(line, "unsafe impl").is_some() {
        Some("unsafe impl")
    } else {
        None
    }
}

/// Whether the comment block directly above line `i` (skipping blank lines
/// and attributes) contains `SAFETY:`.
fn has_safety_comment(lines: &[&str], i: usize) -> bool {
    let mut j = i;
    // rustfmt may break `let x = unsafe { .. }` after the `=`: the comment
    // then sits above the `let` line.
    if lines[i].trim_start().starts_with("unsafe") {
        while j > 0
            && lines[j - 1].trim_end().ends_with('=')
            && !lines[j - 1].trim().starts_with("//")
        {
            j -= 1;
        }
    }
    // Skip blank lines and attributes between the comment and the code.
    while j > 0 {
        let t = lines[j - 1].trim();
        if t.is_empty() || t.starts_with("#[") {
            j -= 1;
        } else {
            break;
        }
    }
    // Walk up the block of comment lines.
    while j > 0 {
        let t = lines[j - 1].trim();
        if !t.starts_with("//") {
            break;
        }
        if t.contains("SAFETY:") {
            return true;
        }
        j -= 1;
    }
    false
}

/// A `YYYY-MM-DD` date (years 19xx/20xx) in `text`.
fn find_date(text: &str) -> Option<&str> {
    let b = text.as_bytes();
    let digit = |k: usize| b.get(k).is_some_and(u8::is_ascii_digit);
    let num = |k: usize| (b[k] - b'0') as u32 * 10 + (b[k + 1] - b'0') as u32;
    for s in 0..b.len().saturating_sub(9) {
        if (s > 0 && digit(s - 1)) || digit(s + 10) {
            continue;
        }
        let shape = (0..4).all(|k| digit(s + k))
            && b[s + 4] == b'-'
            && digit(s + 5)
            && digit(s + 6)
            && b[s + 7] == b'-'
            && digit(s + 8)
            && digit(s + 9);
        if !shape {
            continue;
        }
        let century = num(s);
        let (month, day) = (num(s + 5), num(s + 8));
        if (century == 19 || century == 20) && (1..=12).contains(&month) && (1..=31).contains(&day)
        {
            return Some(&text[s..s + 10]);
        }
    }
    None
}

/// An owner tag (`TODO`, `FIXME` or `XXX` with a parenthesised name) in
/// `text`.
fn find_owner_tag(text: &str) -> Option<&str> {
    for tag in ["TODO(", "FIXME(", "XXX("] {
        if let Some(at) = text.find(tag)
            && let Some(close) = text[at..].find(')')
        {
            return Some(&text[at..at + close + 1]);
        }
    }
    None
}

/// Every `.rs` file the rules apply to, sorted.
fn workspace_files(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack: Vec<PathBuf> = ["crates", "xtask", "benches"]
        .iter()
        .map(|d| root.join(d))
        .filter(|d| d.is_dir())
        .collect();
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("tidy: cannot read {}: {e}", dir.display()));
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if name != "target" && !name.starts_with('.') {
                    stack.push(path);
                }
            } else if name.ends_with(".rs") && !is_generated(root, &path) {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The line limit's verdict on the file `rel` of `lines` lines: the
/// problem, if any.
fn check_length(rel: &str, lines: usize) -> Option<String> {
    (lines > MAX_LINES).then(|| {
        format!(
            "{rel}:{}: {lines} lines, over the {MAX_LINES}-line limit; split the file by \
             responsibility (a module directory with one file per part), not by line count",
            MAX_LINES + 1
        )
    })
}

/// The code of `line` with string literals blanked and any `//` comment
/// cut off.
fn code_only(line: &str) -> String {
    let end = comment_start(line).unwrap_or(line.len());
    line[..end]
        .char_indices()
        .map(|(i, c)| if in_string(line, i) { ' ' } else { c })
        .collect()
}

/// The number of `Mutex<` and `RwLock<` in `code` (not `MutexGuard<`,
/// `parking_lot::Mutex<` counted).
fn locks_in(code: &str) -> usize {
    ["Mutex<", "RwLock<"]
        .iter()
        .map(|lock| {
            code.match_indices(lock)
                .filter(|(at, _)| {
                    code[..*at]
                        .chars()
                        .next_back()
                        .is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
                })
                .count()
        })
        .sum()
}

/// Whether a line of code starts a struct item (`struct`, with any
/// visibility).
fn starts_struct(code: &str) -> bool {
    let t = code.trim_start();
    let t = t.strip_prefix("pub").map_or(t, |rest| {
        let rest = rest.trim_start();
        match rest.strip_prefix('(') {
            Some(r) => r.split_once(')').map_or(rest, |(_, after)| after),
            None => rest,
        }
    });
    t.trim_start().starts_with("struct ")
}

/// Why `text` must state a lock order it does not: the line and name of
/// its first struct with two or more locks in its fields, or its second
/// lock static, when its `//!` doc does not say "lock order" (any case).
/// Line-based: a struct item runs from its `struct` line until its braces
/// or parentheses close (or its `;`), counting every lock type in it.
fn lock_order_problem(text: &str) -> Option<(usize, String)> {
    let doc: String = text
        .lines()
        .take_while(|l| l.starts_with("//!"))
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase();
    if doc.contains("lock order") {
        return None;
    }
    let mut statics = 0;
    // The struct item being read: its first line, name, bracket depth,
    // `<` depth (in its header only) and locks so far.
    let mut open: Option<(usize, String, i32, i32, usize)> = None;
    for (i, line) in text.lines().enumerate() {
        let code = code_only(line);
        let mut item = code.as_str();
        if open.is_none() && starts_struct(&code) {
            // Past `struct `: a visibility's parentheses are not counted.
            item = code.split_once("struct ").map_or(item, |(_, rest)| rest);
            let name: String = item
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            open = Some((i + 1, name, 0, 0, 0));
        }
        if let Some((first, name, depth, angle, locks)) = open.as_mut() {
            *locks += locks_in(item);
            let mut closed = false;
            let mut prev = ' ';
            for c in item.chars() {
                match c {
                    // Generics in the header (`Fn()` in a bound, `->`).
                    '<' if *depth == 0 => *angle += 1,
                    '>' if *depth == 0 && prev != '-' => *angle -= 1,
                    _ if *angle > 0 => {}
                    '{' | '(' => *depth += 1,
                    '}' | ')' => {
                        *depth -= 1;
                        closed |= *depth == 0;
                    }
                    ';' if *depth == 0 => closed = true,
                    _ => {}
                }
                prev = c;
            }
            if closed {
                if *locks >= 2 {
                    return Some((
                        *first,
                        format!(
                            "struct `{name}` holds {locks} locks but the module doc states no \
                             lock order; add a `Lock order:` paragraph to the `//!` doc (which \
                             lock is taken first, which are leaves)"
                        ),
                    ));
                }
                open = None;
            }
            continue;
        }
        let t = code.trim_start();
        let is_static = t.starts_with("static ")
            || (t.starts_with("pub") && t.split_whitespace().nth(1) == Some("static"));
        if is_static && locks_in(&code) > 0 {
            statics += 1;
            if statics >= 2 {
                return Some((
                    i + 1,
                    "a second lock static but the module doc states no lock order; add a \
                     `Lock order:` paragraph to the `//!` doc (which lock is taken first, \
                     which are leaves)"
                        .to_owned(),
                ));
            }
        }
    }
    None
}

/// Whether `path` is generated bindings (`crates/*/src/bindings.rs`).
fn is_generated(root: &Path, path: &Path) -> bool {
    let rel: Vec<_> = path
        .strip_prefix(root)
        .unwrap_or(path)
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    matches!(rel.as_slice(), [c, _, s, b] if c == "crates" && s == "src" && b == "bindings.rs")
}

#[test]
fn workspace_is_tidy() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf();
    let files = workspace_files(&root);
    assert!(
        files.iter().any(|f| f.ends_with("xtask/tests/tidy.rs")),
        "tidy found no files under {}",
        root.display()
    );
    let mut report = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file)
            .unwrap_or_else(|e| panic!("tidy: cannot read {}: {e}", file.display()));
        let rel = file
            .strip_prefix(&root)
            .unwrap_or(file)
            .display()
            .to_string();
        for (line, msg) in check_text(&text) {
            report.push(format!("{rel}:{line}: {msg}"));
        }
    }
    assert!(
        report.is_empty(),
        "tidy: {} problem(s) in {} files checked:\n{}",
        report.len(),
        files.len(),
        report.join("\n")
    );
}

#[test]
fn no_file_over_the_line_limit() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf();
    let mut report = Vec::new();
    for file in workspace_files(&root) {
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("tidy: cannot read {}: {e}", file.display()));
        let rel = file
            .strip_prefix(&root)
            .unwrap_or(&file)
            .to_string_lossy()
            .replace('\\', "/");
        report.extend(check_length(&rel, text.lines().count()));
    }
    assert!(
        report.is_empty(),
        "tidy: {} file(s) break the {MAX_LINES}-line rule:\n{}",
        report.len(),
        report.join("\n")
    );
}

#[test]
fn several_locks_state_their_lock_order() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf();
    let mut report = Vec::new();
    let mut checked = 0;
    for file in workspace_files(&root) {
        let rel = file
            .strip_prefix(&root)
            .unwrap_or(&file)
            .to_string_lossy()
            .replace('\\', "/");
        if !LOCK_ORDER_DIRS
            .iter()
            .any(|d| rel.starts_with(&format!("{d}/")))
        {
            continue;
        }
        checked += 1;
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("tidy: cannot read {}: {e}", file.display()));
        if let Some((line, msg)) = lock_order_problem(&text) {
            report.push(format!("{rel}:{line}: {msg}"));
        }
    }
    assert!(checked > 0, "tidy found no files under {LOCK_ORDER_DIRS:?}");
    assert!(
        report.is_empty(),
        "tidy: {} file(s) hold several locks without a lock order:\n{}",
        report.len(),
        report.join("\n")
    );
}

#[test]
fn a_struct_or_statics_with_several_locks_need_a_lock_order() {
    let two = "//! Doc.\n\
         pub(crate) struct Two {\n\
         \x20   a: parking_lot::Mutex<u32>,\n\
         \x20   // b: Mutex<u32> in a comment is no lock\n\
         \x20   b: std::sync::RwLock<Vec<u8>>,\n\
         }\n";
    let p = lock_order_problem(two).expect("two locks");
    assert_eq!(p.0, 2);
    assert!(p.1.contains("`Two` holds 2 locks"), "{}", p.1);
    let stated = format!(
        "//! Doc.\n//!\n//! Lock {}: `a`, then `b`.\n{}",
        "ORDER",
        &two[9..]
    );
    assert_eq!(lock_order_problem(&stated), None);
    // One lock a struct, a guard, a name ending in `Mutex`, a string.
    let one = "//! Doc.\n\
         struct A { m: Mutex<u8>, g: Option<MutexGuard<'static, u8>> }\n\
         struct B(Mutex<u8>);\n\
         struct C { r: ReentrantMutex<u8>, s: &'static str }\n\
         fn f(m: &Mutex<u8>, n: &Mutex<u8>) { let _ = \"Mutex<a> Mutex<b>\"; }\n";
    assert_eq!(lock_order_problem(one), None);
    // A tuple struct over several lines, and two lock statics.
    let tuple = "//! Doc.\nstruct T(\n    Mutex<u8>,\n    Mutex<u8>,\n);\n";
    assert_eq!(lock_order_problem(tuple).map(|p| p.0), Some(2));
    let generic =
        "//! Doc.\npub struct G<F: Fn() -> u8> {\n    f: Mutex<F>,\n    g: Mutex<u8>,\n}\n";
    assert_eq!(lock_order_problem(generic).map(|p| p.0), Some(2));
    let statics = "//! Doc.\nstatic A: Mutex<u8> = Mutex::new(0);\n\
         pub(crate) static B: RwLock<u8> = RwLock::new(0);\n";
    assert_eq!(lock_order_problem(statics).map(|p| p.0), Some(3));
}

#[test]
fn the_line_limit() {
    assert_eq!(check_length("crates/a/src/lib.rs", MAX_LINES), None);
    let over = check_length("crates/a/src/lib.rs", MAX_LINES + 1).unwrap();
    assert!(
        over.starts_with("crates/a/src/lib.rs:801: 801 lines"),
        "{over}"
    );
    assert!(over.contains("split the file by responsibility"), "{over}");
}

/// Test inputs spell `unsafe` as `UNSAFE` and `//` as `##` so that this file
/// itself holds none of the patterns it looks for.
fn src(text: &str) -> String {
    text.replace("UNSAFE", "unsafe").replace("##", "//")
}

fn lines_of(problems: &[(usize, String)]) -> Vec<usize> {
    problems.iter().map(|(l, _)| *l).collect()
}

#[test]
fn first_line_must_be_a_module_doc() {
    assert!(check_text(&src("##! Doc.\nfn f() {}\n")).is_empty());
    let p = check_text(&src("#![allow(x)]\n##! Doc.\n"));
    assert_eq!(lines_of(&p), [1]);
    assert!(p[0].1.contains("`//!`"));
    assert_eq!(lines_of(&check_text(&src("## plain\n"))), [1]);
    assert_eq!(lines_of(&check_text("")), [1]);
}

#[test]
fn unsafe_blocks_need_a_safety_comment_above() {
    let ok = src("##! Doc.\n\
         fn f() {\n\
         \x20   ## SAFETY: the pointer is valid.\n\
         \x20   let x = UNSAFE { *p };\n\
         \x20   ## Reason, first line.\n\
         \x20   ## SAFETY: continued block.\n\
         \x20   ## more words.\n\
         \n\
         \x20   UNSAFE { g() };\n\
         }\n\
         ## SAFETY: the handle is only used under a lock.\n\
         #[allow(dead_code)]\n\
         UNSAFE impl Send for X {}\n");
    assert!(check_text(&ok).is_empty(), "{:?}", check_text(&ok));

    let bad = src("##! Doc.\n\
         fn f() {\n\
         \x20   let x = UNSAFE { *p };\n\
         \x20   ## a comment without the word\n\
         \x20   UNSAFE { g() };\n\
         \x20   ## SAFETY: too far away.\n\
         \x20   let y = 1;\n\
         \x20   UNSAFE {\n\
         }\n\
         UNSAFE impl Sync for X {}\n");
    let p = check_text(&bad);
    assert_eq!(lines_of(&p), [3, 5, 8, 10], "{p:?}");
    assert!(p[0].1.contains("`unsafe {`") && p[0].1.contains("SAFETY:"));
    assert!(p[3].1.contains("`unsafe impl`"));
}

#[test]
fn a_comment_above_a_let_split_by_rustfmt_counts() {
    let ok = "//! Doc.\nfn f() {\n    // SAFETY: the call has no preconditions.\n    let rc =\n        unsafe { g() };\n}\n";
    assert!(check_text(ok).is_empty(), "{:?}", check_text(ok));
    let bad = "//! Doc.\nfn f() {\n    let rc =\n        unsafe { g() };\n}\n";
    assert_eq!(lines_of(&check_text(bad)), vec![4]);
}

#[test]
fn unsafe_in_strings_comments_and_names_is_not_a_block() {
    let text = src("##! Doc.\n\
         let s = \"UNSAFE { x }\";\n\
         let t = \"a \\\" UNSAFE impl\";\n\
         ## UNSAFE { in a comment }\n\
         let not_UNSAFE { };\n\
         pub UNSAFE fn f() {}\n\
         UNSAFE extern \"C\" {}\n\
         #[UNSAFE(no_mangle)]\n");
    assert!(check_text(&text).is_empty(), "{:?}", check_text(&text));
    // A string closed before the block does not hide it.
    let p = check_text(&src("##! Doc.\nf(\"s\", UNSAFE { x });\n"));
    assert_eq!(lines_of(&p), [2]);
}

#[test]
fn dates_in_comments_are_refused() {
    let date = format!("{}-{}-{}", "2024", "03", "15");
    let text = src(&format!(
        "##! Doc.\n## Changed {date}.\nlet s = \"{date}\";\nf(); ## fixed {date}\n"
    ));
    let p = check_text(&text);
    assert_eq!(lines_of(&p), [2, 4], "{p:?}");
    assert!(p[0].1.contains(&date));
    assert_eq!(find_date("x 1999-12-31 y"), Some("1999-12-31"));
    assert_eq!(find_date(&format!("{}-{}-{}", "2024", "13", "01")), None);
    assert_eq!(find_date(&format!("{}-{}-{}", "2024", "01", "00")), None);
    assert_eq!(find_date(&format!("{}-{}-{}", "1820", "01", "01")), None);
    assert_eq!(find_date(&format!("1{}-{}-{}", "2024", "01", "01")), None);
    assert_eq!(find_date("version 13.0.96, sm_80"), None);
    assert_eq!(find_date(""), None);
}

#[test]
fn owner_tags_in_comments_are_refused() {
    let tag = format!("{}(alice)", "TODO");
    let p = check_text(&src(&format!("##! Doc.\n## {tag}: later\n## TODO: fine\n")));
    assert_eq!(lines_of(&p), [2], "{p:?}");
    assert!(p[0].1.contains(&tag));
}

#[test]
fn generated_bindings_are_skipped() {
    let root = Path::new("/w");
    assert!(is_generated(
        root,
        Path::new("/w/crates/cuda-sys/src/bindings.rs")
    ));
    assert!(!is_generated(
        root,
        Path::new("/w/crates/cuda-sys/src/lib.rs")
    ));
    assert!(!is_generated(root, Path::new("/w/xtask/src/bindings.rs")));
}
