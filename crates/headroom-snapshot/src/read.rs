//! From bytes to a typed [`Snapshot`]: gunzip if needed, unpickle, then check the shape
//! `_snapshot()` produces and convert it, naming the first thing that does not fit.

use std::cell::Cell;
use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::error::{DecodeError, Limit, SnapshotError};
use crate::limits::{MAX_PICKLE_BYTES, decompressed_limit};
use crate::model::{
    AllocatorSettings, Block, BlockState, FrameTable, NO_STACK, Segment, Snapshot, TraceEvent,
};
use crate::pickle::{DictBody, Heap, Value, unpickle};

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Reads a `.pickle` or `.pickle.gz` written by `torch.cuda.memory._dump_snapshot`. A file
/// larger than [`MAX_PICKLE_BYTES`] is refused unread, and no more than that is read from a
/// pipe.
pub fn load(path: &Path) -> Result<Snapshot, SnapshotError> {
    let decode = |source| SnapshotError::Decode {
        path: path.to_path_buf(),
        source,
    };
    let io = |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    if file.metadata().map_err(io)?.len() > MAX_PICKLE_BYTES {
        return Err(decode(Limit::FileSize.into()));
    }
    let mut bytes = Vec::new();
    file.take(MAX_PICKLE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    from_bytes(&bytes).map_err(decode)
}

/// Decodes a snapshot held in memory (gzip-compressed or not), within the bounds of
/// [`crate::limits`].
pub fn from_bytes(bytes: &[u8]) -> Result<Snapshot, DecodeError> {
    if bytes.len() as u64 > MAX_PICKLE_BYTES {
        return Err(Limit::FileSize.into());
    }
    if bytes.starts_with(&GZIP_MAGIC) {
        decode_pickle(&gunzip(bytes)?)
    } else {
        decode_pickle(bytes)
    }
}

/// Decompresses a step at a time, checking the output against the input read so far, so a
/// deflate bomb is refused after a few MiB rather than after [`MAX_PICKLE_BYTES`].
fn gunzip(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    const STEP: u64 = 1 << 20;
    let mut decoder = flate2::read::MultiGzDecoder::new(bytes);
    let mut raw = Vec::with_capacity(bytes.len().saturating_mul(8).min(MAX_PICKLE_BYTES as usize));
    loop {
        let n = (&mut decoder)
            .take(STEP)
            .read_to_end(&mut raw)
            .map_err(DecodeError::Gzip)?;
        let compressed = (bytes.len() - decoder.get_ref().len()) as u64;
        let limit = decompressed_limit(compressed);
        if raw.len() as u64 > limit {
            return Err(Limit::Decompressed { compressed, limit }.into());
        }
        if n == 0 {
            return Ok(raw);
        }
    }
}

fn decode_pickle(raw: &[u8]) -> Result<Snapshot, DecodeError> {
    let (mut heap, top) = unpickle(raw)?;
    let budget = Cell::new(heap.made);
    let parts = Converter {
        heap: &mut heap,
        budget,
    }
    .snapshot(top)?;
    Ok(parts.finish(heap))
}

/// A snapshot before it owns the heap's strings.
struct Parts {
    segments: Vec<Segment>,
    device_traces: Vec<Vec<TraceEvent>>,
    allocator_settings: Option<AllocatorSettings>,
    annotation_count: usize,
}

impl Parts {
    fn finish(self, heap: Heap) -> Snapshot {
        Snapshot {
            segments: self.segments,
            device_traces: self.device_traces,
            allocator_settings: self.allocator_settings,
            annotation_count: self.annotation_count,
            frames: FrameTable {
                strings: heap.strings,
                frames: heap.frames,
                stacks: heap.stacks,
            },
        }
    }
}

struct Converter<'h> {
    heap: &'h mut Heap,
    /// The values the converter may still visit. A pickle that shares nothing holds each item
    /// of each container once, so the converter visits at most the values it made; one that
    /// puts a single list of blocks in every segment would otherwise multiply.
    budget: Cell<u64>,
}

fn not_a_snapshot(what: impl Into<String>) -> DecodeError {
    DecodeError::NotASnapshot(what.into())
}

impl Converter<'_> {
    /// Charges the budget for the items of a list or the entries of a dict about to be read.
    fn visit(&self, v: Value) -> Result<(), DecodeError> {
        let items = match v {
            Value::List(i) | Value::Tuple(i) => self.heap.sequences[i as usize].len(),
            Value::Dict(i) => match &self.heap.dicts[i as usize] {
                DictBody::Entries(entries) => entries.len(),
                DictBody::Event(_) => 0,
            },
            _ => 0,
        };
        let left = self
            .budget
            .get()
            .checked_sub(items as u64)
            .ok_or(Limit::Shared {
                made: self.heap.made,
            })?;
        self.budget.set(left);
        Ok(())
    }

    fn snapshot(&mut self, top: Value) -> Result<Parts, DecodeError> {
        let (segments, traces, settings, annotations) = match top {
            // Old snapshots (<= 2.0) may be a bare list of segments.
            Value::List(_) => (top, None, None, None),
            Value::Dict(_) => {
                self.visit(top)?;
                let segments = self
                    .heap
                    .get(top, "segments")
                    .ok_or_else(|| not_a_snapshot("the pickled dict has no 'segments' key"))?;
                (
                    segments,
                    self.heap.get(top, "device_traces"),
                    self.heap.get(top, "allocator_settings"),
                    self.heap.get(top, "external_annotations"),
                )
            }
            other => {
                return Err(not_a_snapshot(format!(
                    "the pickle holds {}, not a dict",
                    type_name(other)
                )));
            }
        };
        let segments = self.segments(segments)?;
        let device_traces = match traces {
            Some(t) => self.device_traces(t)?,
            None => Vec::new(),
        };
        let allocator_settings = settings
            .filter(|v| matches!(v, Value::Dict(_)))
            .map(|s| self.settings(s));
        let annotation_count = annotations
            .and_then(|a| self.heap.seq(a))
            .map_or(0, <[Value]>::len);
        Ok(Parts {
            segments,
            device_traces,
            allocator_settings,
            annotation_count,
        })
    }

    fn list(&self, v: Value, path: &str) -> Result<&[Value], DecodeError> {
        self.visit(v)?;
        self.heap
            .seq(v)
            .ok_or_else(|| not_a_snapshot(format!("{path} is {}, not a list", type_name(v))))
    }

    /// A copy of a short list, for loops that also intern stacks.
    fn owned_list(&self, v: Value, path: &str) -> Result<Vec<Value>, DecodeError> {
        self.list(v, path).map(<[Value]>::to_vec)
    }

    fn required_u64(&self, d: Value, key: &str, path: &str) -> Result<u64, DecodeError> {
        match self.heap.get(d, key) {
            Some(v) => v.as_u64().ok_or_else(|| {
                not_a_snapshot(format!(
                    "{path}.{key} is {}, not a non-negative int",
                    type_name(v)
                ))
            }),
            None => Err(not_a_snapshot(format!("{path} has no '{key}'"))),
        }
    }

    fn optional_u64(&self, d: Value, key: &str) -> Option<u64> {
        self.heap.get(d, key).and_then(Value::as_u64)
    }

    fn segments(&mut self, v: Value) -> Result<Vec<Segment>, DecodeError> {
        let items = self.owned_list(v, "segments")?;
        let mut segments = Vec::with_capacity(items.len());
        for (i, &s) in items.iter().enumerate() {
            let path = format!("segments[{i}]");
            self.visit(s)?;
            if !matches!(s, Value::Dict(_)) {
                return Err(not_a_snapshot(format!(
                    "{path} is {}, not a dict",
                    type_name(s)
                )));
            }
            let address = self.required_u64(s, "address", &path)?;
            let total_size = self.required_u64(s, "total_size", &path)?;
            let blocks_value = self
                .heap
                .get(s, "blocks")
                .ok_or_else(|| not_a_snapshot(format!("{path} has no 'blocks'")))?;
            let blocks = self.blocks(blocks_value, address, &path)?;
            let sum = |f: fn(&Block) -> bool, size: fn(&Block) -> u64| -> u64 {
                blocks
                    .iter()
                    .filter(|b| f(b))
                    .map(size)
                    .fold(0u64, u64::saturating_add)
            };
            let allocated = sum(|b| b.state == BlockState::ActiveAllocated, |b| b.size);
            let active = sum(|b| b.state != BlockState::Inactive, |b| b.size);
            let requested = sum(|b| b.state != BlockState::Inactive, |b| b.requested_size);
            let is_large = match self
                .heap
                .get(s, "segment_type")
                .and_then(|t| self.heap.str(t))
            {
                Some("small") => false,
                Some(_) => true,
                None => total_size != crate::SMALL_SEGMENT_SIZE,
            };
            segments.push(Segment {
                device: self.optional_u64(s, "device").unwrap_or(0) as u32,
                address,
                total_size,
                allocated_size: self.optional_u64(s, "allocated_size").unwrap_or(allocated),
                active_size: self.optional_u64(s, "active_size").unwrap_or(active),
                requested_size: self.optional_u64(s, "requested_size").unwrap_or(requested),
                stream: self.optional_u64(s, "stream").unwrap_or(0),
                is_large,
                is_expandable: matches!(self.heap.get(s, "is_expandable"), Some(Value::Bool(true))),
                blocks,
            });
        }
        Ok(segments)
    }

    fn blocks(
        &mut self,
        v: Value,
        segment_address: u64,
        segment_path: &str,
    ) -> Result<Vec<Block>, DecodeError> {
        let items = self.owned_list(v, &format!("{segment_path}.blocks"))?;
        let mut blocks = Vec::with_capacity(items.len());
        let mut next_address = segment_address;
        for (j, &b) in items.iter().enumerate() {
            let path = format!("{segment_path}.blocks[{j}]");
            self.visit(b)?;
            if !matches!(b, Value::Dict(_)) {
                return Err(not_a_snapshot(format!(
                    "{path} is {}, not a dict",
                    type_name(b)
                )));
            }
            let size = self.required_u64(b, "size", &path)?;
            let state = match self.heap.get(b, "state").and_then(|s| self.heap.str(s)) {
                Some("active_allocated") => BlockState::ActiveAllocated,
                Some("active_pending_free" | "active_awaiting_free") => {
                    BlockState::ActivePendingFree
                }
                Some("inactive") => BlockState::Inactive,
                Some(other) => return Err(not_a_snapshot(format!("{path}.state is '{other}'"))),
                None => return Err(not_a_snapshot(format!("{path} has no 'state'"))),
            };
            let requested_size = match self.optional_u64(b, "requested_size") {
                Some(requested) => requested,
                None => self.legacy_requested(b)?.unwrap_or(size),
            };
            let address = self.optional_u64(b, "address").unwrap_or(next_address);
            next_address = address.saturating_add(size);
            let frames = match self.heap.get(b, "frames") {
                Some(f) => self.heap.intern_stack(f),
                None => NO_STACK,
            };
            blocks.push(Block {
                address,
                size,
                requested_size,
                state,
                frames,
            });
        }
        Ok(blocks)
    }

    /// Legacy blocks keep their request in history[0].real_size (MemoryViz.js does the same).
    fn legacy_requested(&self, block: Value) -> Result<Option<u64>, DecodeError> {
        let first = self
            .heap
            .get(block, "history")
            .and_then(|h| self.heap.seq(h))
            .and_then(|h| h.first().copied());
        let Some(first) = first else {
            return Ok(None);
        };
        self.visit(first)?;
        Ok(self.optional_u64(first, "real_size"))
    }

    fn device_traces(&self, v: Value) -> Result<Vec<Vec<TraceEvent>>, DecodeError> {
        let devices = self.list(v, "device_traces")?;
        let mut traces = Vec::with_capacity(devices.len());
        for (d, &device) in devices.iter().enumerate() {
            let entries = self.list(device, &format!("device_traces[{d}]"))?;
            let mut events = Vec::with_capacity(entries.len());
            for (i, &e) in entries.iter().enumerate() {
                match self.heap.dict(e) {
                    Some(DictBody::Event(index)) => events.push(self.heap.events[*index as usize]),
                    _ => {
                        return Err(not_a_snapshot(format!(
                            "device_traces[{d}][{i}] is not a trace entry (a dict with a string 'action' and int 'addr', 'size', 'stream')"
                        )));
                    }
                }
            }
            traces.push(events);
        }
        Ok(traces)
    }

    fn settings(&self, s: Value) -> AllocatorSettings {
        let conf = self
            .heap
            .get(s, "PYTORCH_CUDA_ALLOC_CONF")
            .and_then(|c| self.heap.str(c))
            .unwrap_or("");
        let divisions =
            self.heap
                .get(s, "roundup_power2_divisions")
                .and_then(|d| match self.heap.dict(d) {
                    Some(DictBody::Entries(entries)) => Some(
                        entries
                            .iter()
                            .filter_map(|(k, v)| {
                                Some((self.heap.str(*k)?.parse().ok()?, v.as_u64()?))
                            })
                            .collect::<Vec<(u64, u64)>>(),
                    ),
                    _ => None,
                });
        AllocatorSettings {
            conf: conf.to_string(),
            expandable_segments: matches!(
                self.heap.get(s, "expandable_segments"),
                Some(Value::Bool(true))
            ),
            max_split_size: self
                .heap
                .get(s, "max_split_size")
                .and_then(Value::as_i64)
                .unwrap_or(-1),
            roundup_power2_divisions: divisions.unwrap_or_default(),
        }
    }
}

fn type_name(v: Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "a bool",
        Value::Int(_) | Value::UInt(_) => "an int",
        Value::Float(_) => "a float",
        Value::Str(_) => "a str",
        Value::Bytes => "bytes",
        Value::List(_) => "a list",
        Value::Tuple(_) => "a tuple",
        Value::Dict(_) => "a dict",
    }
}
