//! Opening a shared library by a list of candidate names, with typed errors.
//! Shared by cuda-sys and nccl-sys.
//!
//! Invariant: nothing here panics; every failure becomes a [`LoadError`]
//! that names the library and, for a symbol, the symbol.

use std::fmt;

/// Why a library or one of its symbols could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// No candidate could be opened.
    #[error("{what} library not found: {}", Attempts(.attempts))]
    NotFound {
        /// What was looked for ("CUDA driver", "NCCL").
        what: &'static str,
        /// Each path tried, with the loader's reason.
        attempts: Vec<(String, String)>,
    },
    /// The library lacks a symbol the caller needs.
    #[error(
        "{library} has no symbol `{symbol}`{}",
        .since.map(|v| format!(" (added in NCCL {v}; upgrade NCCL)")).unwrap_or_default()
    )]
    MissingSymbol {
        /// The path the library was opened from.
        library: String,
        /// The missing symbol.
        symbol: &'static str,
        /// For NCCL: the version that added the symbol, when known.
        since: Option<&'static str>,
    },
    /// The library is older than this crate supports.
    #[error("{library} is {what} {found}; {required} or newer is required")]
    TooOld {
        /// What was opened ("NCCL").
        what: &'static str,
        /// The path the library was opened from.
        library: String,
        /// The version it reports.
        found: String,
        /// The oldest version supported.
        required: &'static str,
    },
}

struct Attempts<'a>(&'a [(String, String)]);

impl fmt::Display for Attempts<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (path, why)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "tried {path}: {why}")?;
        }
        Ok(())
    }
}

impl LoadError {
    /// A single failed open of `path`.
    pub fn open_failed(what: &'static str, path: &str, reason: String) -> Self {
        LoadError::NotFound {
            what,
            attempts: vec![(path.to_owned(), reason)],
        }
    }
}

/// Opens a shared library.
///
/// # Safety
/// Loading runs the library's initialisers: `path` must name a library that is
/// safe to load into this process.
pub unsafe fn open_library(path: &str) -> Result<libloading::Library, String> {
    // SAFETY: the caller vouches for the library (this function's contract).
    unsafe { libloading::Library::new(path) }.map_err(|e| e.to_string())
}

/// Opens the library named by the environment variable `env` when set, else
/// the first of `candidates` that `open` accepts.
pub fn open_first<T>(
    what: &'static str,
    env: &str,
    candidates: &[&str],
    open: impl Fn(&str) -> Result<T, LoadError>,
) -> Result<T, LoadError> {
    let from_env = std::env::var(env).ok().filter(|v| !v.is_empty());
    let names: Vec<String> = match from_env {
        Some(path) => vec![path],
        None => candidates.iter().map(|c| (*c).to_owned()).collect(),
    };
    let mut attempts = Vec::new();
    for name in &names {
        match open(name) {
            Ok(t) => return Ok(t),
            Err(LoadError::NotFound { attempts: a, .. }) => attempts.extend(a),
            Err(other) => return Err(other),
        }
    }
    Err(LoadError::NotFound { what, attempts })
}
