//! Why a file could not be read as a memory snapshot.

use std::fmt;
use std::path::PathBuf;

use headroom_alloc::format_size;

use crate::limits::{MAX_GZIP_RATIO, MAX_PICKLE_BYTES, MAX_STACK};

/// A bound that keeps a hostile or corrupt file from taking unbounded time or memory: each
/// says which bound was hit and what to do about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Limit {
    /// The file is larger than [`MAX_PICKLE_BYTES`].
    FileSize,
    /// The gzip stream decompresses past `limit` bytes: [`MAX_PICKLE_BYTES`], or
    /// [`MAX_GZIP_RATIO`] times the `compressed` bytes read so far when that is less.
    Decompressed { compressed: u64, limit: u64 },
    /// More than [`MAX_STACK`] values (or marks) on the pickle machine's stack.
    Stack { offset: usize },
    /// A memo slot beyond the number of opcodes read so far.
    Memo { index: usize, offset: usize },
    /// The converter would visit more values than the pickle made: one object stands for many
    /// segments, blocks or trace entries.
    Shared { made: u64 },
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let max = format_size(MAX_PICKLE_BYTES);
        match self {
            Limit::FileSize => write!(
                f,
                "the file is larger than {max}, the largest snapshot headroom reads; record a \
                 shorter trace (torch.cuda.memory._record_memory_history(max_entries=...)) or \
                 dump the snapshot sooner"
            ),
            Limit::Decompressed { compressed, limit } if *limit < MAX_PICKLE_BYTES => write!(
                f,
                "the gzip data grows more than {MAX_GZIP_RATIO}-fold (its first {} decompress \
                 past {}), where snapshots compress less than 25:1: a decompression bomb, not a \
                 snapshot; if it is a real snapshot, gunzip it and pass the .pickle",
                format_size(*compressed),
                format_size(*limit)
            ),
            Limit::Decompressed { .. } => write!(
                f,
                "the snapshot decompresses past {max}, the largest snapshot headroom reads; \
                 record a shorter trace (torch.cuda.memory._record_memory_history(max_entries=...)) \
                 or dump the snapshot sooner"
            ),
            Limit::Stack { offset } => write!(
                f,
                "the pickle holds more than {MAX_STACK} values on its stack at byte {offset}, \
                 which pickle.dump never does (it appends 1000 items at a time); the file is \
                 not a snapshot: dump it again with torch.cuda.memory._dump_snapshot()"
            ),
            Limit::Memo { index, offset } => write!(
                f,
                "the pickle stores memo slot {index} at byte {offset}, more slots than it has \
                 opcodes before it, which pickle.dump never does; the file is corrupt: dump it \
                 again with torch.cuda.memory._dump_snapshot()"
            ),
            Limit::Shared { made } => write!(
                f,
                "the pickle reuses objects: its segments, blocks and trace entries expand past \
                 the {made} values it holds, while _dump_snapshot writes each of them once; the \
                 file is not a snapshot: dump it again with torch.cuda.memory._dump_snapshot()"
            ),
        }
    }
}

/// A malformed pickle stream. Offsets are into the decompressed bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PickleError {
    Truncated {
        offset: usize,
    },
    UnknownOpcode {
        opcode: u8,
        offset: usize,
    },
    /// An opcode that builds class instances; snapshots only hold builtins.
    Unsupported {
        opcode: &'static str,
        offset: usize,
    },
    StackUnderflow {
        offset: usize,
    },
    BadMemo {
        index: usize,
        offset: usize,
    },
    Protocol(u8),
    Malformed {
        offset: usize,
        what: &'static str,
    },
}

impl fmt::Display for PickleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PickleError::Truncated { offset } => {
                write!(f, "the pickle ends early (at byte {offset})")
            }
            PickleError::UnknownOpcode { opcode, offset } => {
                write!(f, "unknown pickle opcode 0x{opcode:02x} at byte {offset}")
            }
            PickleError::Unsupported { opcode, offset } => write!(
                f,
                "pickle opcode {opcode} at byte {offset} builds a Python object; memory snapshots hold only builtins"
            ),
            PickleError::StackUnderflow { offset } => {
                write!(f, "corrupt pickle: stack underflow at byte {offset}")
            }
            PickleError::BadMemo { index, offset } => {
                write!(
                    f,
                    "corrupt pickle: bad memo reference {index} at byte {offset}"
                )
            }
            PickleError::Protocol(v) => {
                write!(f, "pickle protocol {v} is not supported (2 to 5 are)")
            }
            PickleError::Malformed { offset, what } => {
                write!(f, "corrupt pickle at byte {offset}: {what}")
            }
        }
    }
}

/// Why bytes are not a memory snapshot.
#[derive(Debug)]
pub enum DecodeError {
    /// Gzip data that does not decompress.
    Gzip(std::io::Error),
    Pickle(PickleError),
    /// A valid pickle that is not a `torch.cuda.memory._snapshot()`.
    NotASnapshot(String),
    /// A size or sharing bound (see [`Limit`]).
    Limit(Limit),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Gzip(e) => write!(f, "gzip data is corrupt ({e})"),
            DecodeError::Pickle(e) => e.fmt(f),
            DecodeError::NotASnapshot(what) => write!(f, "not a memory snapshot: {what}"),
            DecodeError::Limit(limit) => limit.fmt(f),
        }
    }
}

impl std::error::Error for DecodeError {}

impl From<PickleError> for DecodeError {
    fn from(e: PickleError) -> Self {
        DecodeError::Pickle(e)
    }
}

impl From<Limit> for DecodeError {
    fn from(limit: Limit) -> Self {
        DecodeError::Limit(limit)
    }
}

/// A snapshot file that could not be loaded.
#[derive(Debug)]
pub enum SnapshotError {
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    Decode {
        path: PathBuf,
        source: DecodeError,
    },
}

impl fmt::Display for SnapshotError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SnapshotError::Io { path, source } => {
                write!(f, "cannot read {}: {source}", path.display())
            }
            SnapshotError::Decode {
                path,
                source: source @ DecodeError::Limit(_),
            } => write!(f, "{}: {source}", path.display()),
            SnapshotError::Decode { path, source } => write!(
                f,
                "{}: {source}; expected a torch.cuda.memory._dump_snapshot() pickle (.pickle or .pickle.gz)",
                path.display()
            ),
        }
    }
}

impl std::error::Error for SnapshotError {}
