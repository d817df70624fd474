//! Running the built `headroom` binary and reading what it prints: what every module shares.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

/// The repository root.
pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A file under crates/headroom-cli/tests/fixtures, as an absolute path.
pub fn fixture(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(path)
}

/// [`fixture`] as a command-line argument.
pub fn p(path: &str) -> String {
    fixture(path).display().to_string()
}

/// Runs in the repository root, so paths in messages are the relative ones given.
pub fn headroom(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(args)
        .current_dir(repo())
        .output()
        .expect("the binary runs")
}

/// Stdout of a run that must succeed.
pub fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).expect("utf-8")
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The one JSON object a successful run prints.
pub fn json_of(out: &Output) -> Value {
    serde_json::from_str(&stdout(out)).expect("stdout is one JSON object")
}

/// [`json_of`] the run of `args`.
pub fn json(args: &[&str]) -> Value {
    json_of(&headroom(args))
}

/// The error message of a run that must fail as bad input.
pub fn bad_input(args: &[&str]) -> String {
    let out = headroom(args);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(out.stdout.is_empty(), "nothing on stdout for bad input");
    assert!(!err.contains("panicked"), "{err}");
    err
}
