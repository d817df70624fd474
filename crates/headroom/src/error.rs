//! Errors of the library. Every one is the user's to fix, so each message says what was given,
//! what is allowed, and where it can be seen.

use std::fmt;
use std::path::PathBuf;

#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// A field of a run spec (or of a model config) holds a value that cannot be used.
    Field {
        field: String,
        value: String,
        allowed: String,
    },
    /// `model:` names neither a catalog entry nor a config file.
    UnknownModel {
        name: String,
        suggestions: Vec<String>,
    },
    /// A YAML or JSON document that does not parse.
    Syntax {
        path: PathBuf,
        line: Option<usize>,
        column: Option<usize>,
        message: String,
    },
    /// A file that cannot be read.
    Io { path: PathBuf, message: String },
    /// A model type or setup headroom does not model (yet).
    Unsupported { what: String, supported: String },
    /// A calibration row that cannot be estimated, and why.
    Row { id: String, error: Box<Error> },
    /// A log given as an out-of-memory log holds no PyTorch out-of-memory message;
    /// `driver_error`: it holds the driver's `CUDA error: out of memory` instead.
    NoOomMessage { source: String, driver_error: bool },
}

impl Error {
    /// The same error with its field named inside `prefix` (`lora.r`, `instances[0].model`).
    pub fn prefixed(self, prefix: &str) -> Self {
        match self {
            Error::Field {
                field,
                value,
                allowed,
            } => Error::Field {
                field: format!("{prefix}.{field}"),
                value,
                allowed,
            },
            other => other,
        }
    }

    pub fn field(
        field: impl Into<String>,
        value: impl fmt::Display,
        allowed: impl Into<String>,
    ) -> Self {
        Error::Field {
            field: field.into(),
            value: value.to_string(),
            allowed: allowed.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Field {
                field,
                value,
                allowed,
            } => {
                write!(f, "`{field}`: {value} is not allowed; {allowed}")
            }
            Error::UnknownModel { name, suggestions } => {
                write!(
                    f,
                    "`model`: {name:?} is not a catalog model, a config.json or a model directory"
                )?;
                if !suggestions.is_empty() {
                    write!(f, "; did you mean {}?", suggestions.join(", "))?;
                }
                write!(f, " (`headroom models` lists the catalog)")
            }
            Error::Syntax {
                path,
                line,
                column,
                message,
            } => {
                write!(f, "{}", path.display())?;
                if let Some(line) = line {
                    write!(f, ":{line}")?;
                    if let Some(column) = column {
                        write!(f, ":{column}")?;
                    }
                }
                write!(f, ": {message}")
            }
            Error::Io { path, message } => write!(f, "{}: {message}", path.display()),
            Error::Unsupported { what, supported } => {
                write!(f, "{what} is not modelled; supported: {supported}")
            }
            Error::Row { id, error } => write!(f, "row {id}: {error}"),
            Error::NoOomMessage {
                source,
                driver_error,
            } => {
                write!(
                    f,
                    "{source}: no PyTorch out-of-memory message found (expected `CUDA out of \
                     memory. Tried to allocate …` or its HIP form)"
                )?;
                if *driver_error {
                    write!(
                        f,
                        "; it has `CUDA error: out of memory`, raised by the driver outside \
                         PyTorch's allocator (context creation, NCCL, cuBLAS handles), which \
                         carries no numbers"
                    )?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;
