//! Opens real shared libraries that implement only part of NCCL's API, built
//! here with the system C compiler, and checks that what they lack comes back
//! as typed errors, not panics.

use nccl_sys::{LoadError, Nccl, call, ncclResult_t};
use std::path::PathBuf;
use std::process::Command;

/// Builds a shared library from C source into the test's temp dir.
fn build_lib(name: &str, source: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("nccl-sys-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join(format!("{name}.c"));
    let out = dir.join(format!("lib{name}.so"));
    std::fs::write(&src, source).unwrap();
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("a C compiler (`cc`) is needed for this test");
    assert!(status.success(), "cc failed to build {name}");
    out
}

#[test]
fn a_symbol_an_older_nccl_lacks_is_a_typed_error() {
    // Reports 2.26.0 and has no window registration (added in 2.27).
    let lib = build_lib(
        "fakenccl226",
        "int ncclGetVersion(int* v) { *v = 22600; return 0; }\n\
         int ncclGetUniqueId(void* id) { (void)id; return 0; }\n",
    );
    // SAFETY: the library defines ncclGetVersion and ncclGetUniqueId with
    // NCCL's signatures; the other symbols are absent and never called.
    let nccl = unsafe { Nccl::open(lib.to_str().unwrap()) }.expect("2.26 is supported");
    assert_eq!(nccl.version(), 22600);
    let mut win = std::ptr::null_mut();
    // SAFETY: the call is refused before any function pointer is used.
    let err = unsafe {
        call!(
            &nccl,
            ncclCommWindowRegister(std::ptr::null_mut(), std::ptr::null_mut(), 0, &mut win, 0)
        )
    }
    .unwrap_err();
    match &err {
        LoadError::MissingSymbol {
            library,
            symbol,
            since,
        } => {
            assert!(library.ends_with("libfakenccl226.so"), "{library}");
            assert_eq!(*symbol, "ncclCommWindowRegister");
            assert_eq!(*since, Some("2.27"));
        }
        other => panic!("expected MissingSymbol, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("ncclCommWindowRegister") && text.contains("2.27"),
        "{text}"
    );

    // A symbol that is there still works.
    let mut id = nccl_sys::ncclUniqueId::default();
    // SAFETY: the fake ncclGetUniqueId ignores its argument.
    let rc = unsafe { call!(&nccl, ncclGetUniqueId(&mut id)) }.unwrap();
    assert_eq!(rc, ncclResult_t::ncclSuccess);
}

#[test]
fn nccl_older_than_2_19_is_refused() {
    let lib = build_lib(
        "fakenccl218",
        "int ncclGetVersion(int* v) { *v = 21803; return 0; }\n",
    );
    // SAFETY: the library defines ncclGetVersion with NCCL's signature.
    let err = unsafe { Nccl::open(lib.to_str().unwrap()) }.unwrap_err();
    match &err {
        LoadError::TooOld {
            found, required, ..
        } => {
            assert_eq!(found, "2.18.3");
            assert_eq!(*required, "2.19");
        }
        other => panic!("expected TooOld, got {other:?}"),
    }
}

#[test]
fn a_library_without_nccl_get_version_is_a_typed_error() {
    let lib = build_lib("notnccl", "int unrelated(void) { return 1; }\n");
    // SAFETY: the library has no initialisers and nothing of it is called.
    let err = unsafe { Nccl::open(lib.to_str().unwrap()) }.unwrap_err();
    assert!(
        matches!(
            &err,
            LoadError::MissingSymbol {
                symbol: "ncclGetVersion",
                ..
            }
        ),
        "{err:?}"
    );
}
