//! The one error type of the binary: a message for people and the exit code that goes with it.

use std::fmt;

/// Exit code for bad input (a spec, a file, a flag): the user must change something.
pub const EXIT_BAD_INPUT: u8 = 2;
/// Exit code for a failure that is not the input's fault.
pub const EXIT_FAILURE: u8 = 1;

#[derive(Debug)]
pub struct CliError {
    pub code: u8,
    pub message: String,
    /// The library's error it came from, with its field, value and what is allowed, for the
    /// Python bindings to raise as `headroom.SpecError`.
    pub source: Option<headroom::Error>,
}

impl CliError {
    /// Bad input: name the field, the value and what is allowed.
    pub fn input(message: impl Into<String>) -> Self {
        Self {
            code: EXIT_BAD_INPUT,
            message: message.into(),
            source: None,
        }
    }

    /// A library error in the file at `path`, named in the message.
    pub fn in_file(path: &std::path::Path, err: headroom::Error) -> Self {
        Self {
            message: format!("{}: {err}", path.display()),
            ..Self::from(err)
        }
    }

    pub fn failure(message: impl Into<String>) -> Self {
        Self {
            code: EXIT_FAILURE,
            message: message.into(),
            source: None,
        }
    }
}

/// Every library error is the input's to fix (a spec, a file, a flag), so it exits 2.
impl From<headroom::Error> for CliError {
    fn from(err: headroom::Error) -> Self {
        Self {
            source: Some(err.clone()),
            ..Self::input(err.to_string())
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

pub type CliResult<T = ()> = Result<T, CliError>;
