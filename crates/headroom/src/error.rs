//! Errors of the library. Every one is the user's to fix, so each message says what was given,
//! what is allowed, and where it can be seen.

use std::fmt;
use std::path::PathBuf;

/// Characters of an input value a message shows at most: a longer one is cut, with its
/// length said.
pub const SHOWN_CHARS: usize = 80;

#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// A field of a run spec (or of a model config) holds a value that cannot be used.
    Field {
        field: String,
        value: String,
        allowed: String,
    },
    /// A run that allocates more than any device holds (a tensor of 1 EiB or more, or more
    /// bytes than a device addresses): nothing can be estimated; `field` is what to shrink.
    BeyondAnyDevice {
        field: String,
        value: String,
        allowed: String,
    },
    /// `model:` names neither a catalog entry nor a config file; `field` is where it is
    /// written (`model`, `instances[0].model`).
    UnknownModel {
        field: String,
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

/// The parts of an input error a program reads apart from its message ([`Error::named`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Named {
    pub field: Option<String>,
    pub value: Option<String>,
    pub allowed: Option<String>,
}

impl Error {
    /// A model type the native simulator does not build, which `headroom trace` can still
    /// answer by running the model's own code.
    pub fn is_unmodelled_model_type(&self) -> bool {
        matches!(self, Error::Unsupported { what, .. } if what.starts_with("model_type "))
    }

    /// The same error with its field named inside `prefix` (`lora.r`, `instances[0].model`).
    pub fn prefixed(self, prefix: &str) -> Self {
        self.under(prefix, ".")
    }

    /// The same error with its field named in the file `path` (`models/x/config.json:
    /// num_hidden_layers`).
    pub fn in_file(self, path: &str) -> Self {
        self.under(path, ": ")
    }

    fn under(self, prefix: &str, separator: &str) -> Self {
        match self {
            Error::Field {
                field,
                value,
                allowed,
            } => Error::Field {
                field: format!("{prefix}{separator}{field}"),
                value,
                allowed,
            },
            Error::BeyondAnyDevice {
                field,
                value,
                allowed,
            } => Error::BeyondAnyDevice {
                field: format!("{prefix}{separator}{field}"),
                value,
                allowed,
            },
            Error::UnknownModel {
                field,
                name,
                suggestions,
            } => Error::UnknownModel {
                field: format!("{prefix}{separator}{field}"),
                name,
                suggestions,
            },
            other => other,
        }
    }

    /// What the error names of the input: the field, the value given and what is allowed,
    /// each where it names one (the Python bindings' `SpecError` and the page's error JSON).
    pub fn named(&self) -> Named {
        match self {
            Error::Field {
                field,
                value,
                allowed,
            }
            | Error::BeyondAnyDevice {
                field,
                value,
                allowed,
            } => Named {
                field: Some(field.clone()),
                value: Some(value.clone()),
                allowed: Some(allowed.clone()),
            },
            Error::UnknownModel {
                field,
                name,
                suggestions,
            } => {
                let mut allowed =
                    "a catalog model (`headroom models`), an HF config.json or a model directory"
                        .to_string();
                if !suggestions.is_empty() {
                    allowed += &format!("; did you mean {}?", suggestions.join(", "));
                }
                Named {
                    field: Some(field.clone()),
                    value: Some(name.clone()),
                    allowed: Some(allowed),
                }
            }
            Error::Unsupported { what, supported } => Named {
                field: None,
                value: Some(what.clone()),
                allowed: Some(supported.clone()),
            },
            Error::Row { error, .. } => error.named(),
            Error::Syntax { .. } | Error::Io { .. } | Error::NoOomMessage { .. } => {
                Named::default()
            }
        }
    }

    /// A field's value that cannot be used; a long value is cut to [`SHOWN_CHARS`]
    /// characters (a field path to twice that).
    pub fn field(
        field: impl Into<String>,
        value: impl fmt::Display,
        allowed: impl Into<String>,
    ) -> Self {
        Error::Field {
            field: shown(&field.into(), 2 * SHOWN_CHARS),
            value: shown(&value.to_string(), SHOWN_CHARS),
            allowed: allowed.into(),
        }
    }
}

/// `text`, cut to its first `max` characters with its length said when it is longer: a
/// message must not echo a megabyte of input.
pub fn shown(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_string(),
        Some((end, _)) => format!("{}… ({} characters)", &text[..end], text.chars().count()),
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Field {
                field,
                value,
                allowed,
            }
            | Error::BeyondAnyDevice {
                field,
                value,
                allowed,
            } => {
                write!(f, "`{field}`: {value} is not allowed; {allowed}")
            }
            Error::UnknownModel {
                field,
                name,
                suggestions,
            } => {
                write!(
                    f,
                    "`{field}`: {:?} is not a catalog model, a config.json or a model directory",
                    shown(name, SHOWN_CHARS)
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
