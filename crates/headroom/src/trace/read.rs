//! From a file to a checked [`Trace`]: gunzip if need be, parse within the limits, then check
//! what the JSON shape cannot say (storages in range, each allocated once, phases in order).
//! A hostile file gets a message naming the entry, the value and what is allowed; never a
//! panic, and never more than [`MAX_TRACE_BYTES`] read.

use std::fmt;
use std::io::Read;
use std::marker::PhantomData;
use std::path::Path;

use serde::Deserialize;
use serde::de::{self, DeserializeOwned, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde_json::Value;
use smallvec::SmallVec;

use super::{
    AttentionBackward, AttentionKernel, Engine, Event, FORMAT, Phase, Storage, StorageKind, Thread,
    Trace, VERSION,
};
use crate::error::{Error, Result, SHOWN_CHARS, shown};
use crate::limits::{
    MAX_HEAD_DIM, MAX_HEADS, MAX_INSTANCES, MAX_POSITIONS, MAX_TOKENS, MAX_TRACE_BYTES,
    MAX_TRACE_ELEMENTS, MAX_TRACE_EVENTS, MAX_TRACE_PHASES, MAX_TRACE_STORAGE_BYTES,
    MAX_TRACE_STORAGES,
};

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Reads a `.json` or `.json.gz` trace (gzip is told by its magic bytes, not the name).
pub fn read(path: &Path) -> Result<Trace> {
    let io = |e: std::io::Error| Error::Io {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    if len > MAX_TRACE_BYTES {
        return Err(too_large(path, &format!("{len} bytes")));
    }
    let mut bytes = Vec::new();
    file.take(MAX_TRACE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    from_bytes(&bytes, path)
}

/// Parses and checks a trace held in memory (gzip-compressed or not); `path` names it in
/// messages.
pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Trace> {
    if bytes.len() as u64 > MAX_TRACE_BYTES {
        return Err(too_large(path, &format!("{} bytes", bytes.len())));
    }
    if bytes.starts_with(&GZIP_MAGIC) {
        let mut raw = Vec::new();
        flate2::read::MultiGzDecoder::new(bytes)
            .take(MAX_TRACE_BYTES + 1)
            .read_to_end(&mut raw)
            .map_err(|e| Error::Io {
                path: path.to_path_buf(),
                message: format!("not a whole gzip stream ({e})"),
            })?;
        if raw.len() as u64 > MAX_TRACE_BYTES {
            return Err(too_large(path, "more than that once gunzipped"));
        }
        parse(&raw, path)
    } else {
        parse(bytes, path)
    }
}

/// Whether the file holds JSON (a trace) rather than a pickle (a snapshot): its first byte
/// that is not blank, gunzipped if need be, opens an object. False when it cannot be read,
/// so that the snapshot reader reports why.
pub fn is_json(path: &Path) -> bool {
    const PEEK: u64 = 4096;
    let Ok(file) = std::fs::File::open(path) else {
        return false;
    };
    let mut head = Vec::new();
    if file.take(PEEK).read_to_end(&mut head).is_err() {
        return false;
    }
    if head.starts_with(&GZIP_MAGIC) {
        let Ok(file) = std::fs::File::open(path) else {
            return false;
        };
        head.clear();
        let decoder = flate2::read::MultiGzDecoder::new(std::io::BufReader::new(file));
        // A stream shorter than the peek, or cut short, still shows its start.
        let _ = decoder.take(PEEK).read_to_end(&mut head);
    }
    head.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

fn too_large(path: &Path, size: &str) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        message: format!(
            "{size}: a trace file has at most {MAX_TRACE_BYTES} bytes of JSON \
             (headroom::limits::MAX_TRACE_BYTES)"
        ),
    }
}

/// The file's top level before its checks: `format` and `version` come first in what is
/// reported, whatever the order of the keys.
#[derive(Deserialize)]
struct RawTrace {
    format: Option<Value>,
    version: Option<Value>,
    spec: Option<Value>,
    env: Option<Value>,
    phases: Option<List<Phase>>,
    storages: Option<Storages>,
    events: Option<List<Written>>,
    engines: Option<Vec<Engine>>,
}

fn parse(json: &[u8], path: &Path) -> Result<Trace> {
    let raw: RawTrace = serde_json::from_slice(json).map_err(|e| {
        let text = e.to_string();
        let position = format!(" at line {} column {}", e.line(), e.column());
        let message = text.strip_suffix(&position).unwrap_or(&text);
        Error::Syntax {
            path: path.to_path_buf(),
            line: (e.line() > 0).then_some(e.line()),
            column: (e.line() > 0).then_some(e.column()),
            message: shown(message, 4 * SHOWN_CHARS),
        }
    })?;
    check(raw).map_err(|e| e.in_file(&path.display().to_string()))
}

/// What the JSON shape does not say: the format, the version, every top-level list present,
/// phases covering the events in order, storage sizes, and each storage allocated once before
/// it is freed at most once.
fn check(raw: RawTrace) -> Result<Trace> {
    let is_trace = raw.format.as_ref().and_then(Value::as_str) == Some(FORMAT);
    if !is_trace {
        let value = raw.format.map_or("nothing".into(), |v| v.to_string());
        return Err(Error::field(
            "format",
            value,
            format!(
                "a trace file has \"format\": \"{FORMAT}\" (docs/trace-format.md; \
                 `headroom trace --save` writes one)"
            ),
        ));
    }
    let version = raw.version.unwrap_or(Value::Null);
    let compact = match version.as_u64() {
        Some(1) => false,
        Some(VERSION) => true,
        _ => {
            return Err(Error::field(
                "version",
                version,
                format!("this headroom reads versions 1 to {VERSION} of the trace format"),
            ));
        }
    };
    let env = match raw.env {
        None => serde_json::Map::new(),
        Some(Value::Object(env)) => env,
        Some(other) => {
            return Err(Error::field(
                "env",
                other,
                "use an object of versions ({\"torch\": \"2.11.0\", ...})",
            ));
        }
    };
    let missing = |key: &str| {
        Error::field(
            key,
            "nothing",
            format!("a trace file has a `{key}` list (docs/trace-format.md)"),
        )
    };
    let phases = raw.phases.ok_or_else(|| missing("phases"))?.0;
    let storages = match raw.storages.ok_or_else(|| missing("storages"))? {
        Storages::Listed(list) => list.0,
        Storages::Columns(_) if !compact => {
            return Err(Error::field(
                "storages",
                "an object of columns",
                "version 1 lists one object per storage; columns are version 2's",
            ));
        }
        Storages::Columns(columns) => columns.storages()?,
    };
    let events = unwritten(raw.events.ok_or_else(|| missing("events"))?.0, compact)?;
    check_phases(&phases, events.len())?;
    for (i, storage) in storages.iter().enumerate() {
        if storage.bytes > MAX_TRACE_STORAGE_BYTES {
            return Err(Error::field(
                format!("storages[{i}].bytes"),
                storage.bytes,
                format!(
                    "a storage has at most {MAX_TRACE_STORAGE_BYTES} bytes (1 PiB, \
                     headroom::limits::MAX_TRACE_STORAGE_BYTES)"
                ),
            ));
        }
    }
    check_lifetimes(&events, storages.len())?;
    let engines = raw.engines.unwrap_or_default();
    check_engines(&engines, &events)?;
    Ok(Trace {
        spec: raw.spec.unwrap_or(Value::Null),
        env,
        phases,
        storages,
        events,
        engines,
    })
}

/// At most [`MAX_INSTANCES`] engines, each a share of the device, and every `engine` event
/// naming one of them.
fn check_engines(engines: &[Engine], events: &[Event]) -> Result<()> {
    if engines.len() > MAX_INSTANCES {
        return Err(Error::field(
            "engines",
            format!("{} engines", engines.len()),
            format!(
                "a pipeline has at most {MAX_INSTANCES} instances (headroom::limits::MAX_INSTANCES)"
            ),
        ));
    }
    for (i, engine) in engines.iter().enumerate() {
        let share = engine.gpu_memory_utilization;
        if !(share > 0.0 && share <= 1.0) {
            return Err(Error::field(
                format!("engines[{i}].gpu_memory_utilization"),
                share,
                "use a share of the device above 0 and at most 1",
            ));
        }
    }
    for (i, event) in events.iter().enumerate() {
        if let Event::Engine { engine, awake } = *event
            && engine as usize >= engines.len()
        {
            return Err(Error::field(
                format!("events[{i}]"),
                format!("[\"engine\", {engine}, {awake}]"),
                format!(
                    "the trace lists {} engines: name one of them by its index",
                    engines.len()
                ),
            ));
        }
    }
    Ok(())
}

fn check_phases(phases: &[Phase], events: usize) -> Result<()> {
    let Some(first) = phases.first() else {
        return Err(Error::field(
            "phases",
            "[]",
            "a trace has at least one phase, `load` from event 0",
        ));
    };
    if first.event != 0 {
        return Err(Error::field(
            "phases[0].event",
            first.event,
            "the first phase begins at event 0, so that every event has a phase",
        ));
    }
    let mut previous = 0;
    for (i, phase) in phases.iter().enumerate() {
        if phase.name.is_empty() {
            return Err(Error::field(
                format!("phases[{i}].name"),
                "\"\"",
                "name the phase (`load`, `step 1 forward`, ...)",
            ));
        }
        if phase.event < previous || phase.event > events {
            return Err(Error::field(
                format!("phases[{i}].event"),
                phase.event,
                format!(
                    "phases begin in order, from {previous} to the number of events ({events})"
                ),
            ));
        }
        previous = phase.event;
    }
    Ok(())
}

/// Each storage goes from never allocated to live to freed, once, and is used on another
/// stream only while live.
fn check_lifetimes(events: &[Event], storages: usize) -> Result<()> {
    #[derive(Clone, Copy, PartialEq)]
    enum State {
        Unborn,
        Live(usize),
        Freed(usize),
    }
    let mut states = vec![State::Unborn; storages];
    for (i, event) in events.iter().enumerate() {
        let (id, shown) = match *event {
            Event::Alloc(id) => (id, format!("[\"alloc\", {id}]")),
            Event::Free(id) => (id, format!("[\"free\", {id}]")),
            Event::RecordStream { storage, stream } => {
                (storage, format!("[\"record_stream\", {storage}, {stream}]"))
            }
            _ => continue,
        };
        let alloc = matches!(event, Event::Alloc(_));
        let bad = |allowed: String| Error::field(format!("events[{i}]"), &shown, allowed);
        let Some(state) = states.get_mut(id as usize) else {
            return Err(bad(match storages {
                0 => "the trace has no storages".to_string(),
                n => format!(
                    "the trace has {n} storages: use an index from 0 to {}",
                    n - 1
                ),
            }));
        };
        if matches!(event, Event::RecordStream { .. }) {
            if !matches!(*state, State::Live(_)) {
                return Err(bad(format!(
                    "storage {id} is not live there; a stream uses only a live storage"
                )));
            }
            continue;
        }
        *state = match (*state, alloc) {
            (State::Unborn, true) => State::Live(i),
            (State::Live(_), false) => State::Freed(i),
            (State::Live(at), true) => {
                return Err(bad(format!(
                    "storage {id} is already allocated (at events[{at}]); free it first"
                )));
            }
            (State::Freed(at), true) => {
                return Err(bad(format!(
                    "storage {id} was freed at events[{at}]; a storage is allocated once"
                )));
            }
            (State::Unborn, false) => {
                return Err(bad(format!(
                    "storage {id} is not allocated before it; free only live storages"
                )));
            }
            (State::Freed(at), false) => {
                return Err(bad(format!(
                    "storage {id} was freed already, at events[{at}]"
                )));
            }
        };
    }
    Ok(())
}

/// `storages` as written: version 1's list of objects, or version 2's columns.
enum Storages {
    Listed(List<Storage>),
    Columns(Columns),
}

impl<'de> Deserialize<'de> for Storages {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StoragesVisitor;

        impl<'de> Visitor<'de> for StoragesVisitor {
            type Value = Storages;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of storages or an object of their columns")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Storages, A::Error> {
                ListVisitor(PhantomData)
                    .visit_seq(seq)
                    .map(Storages::Listed)
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Storages, A::Error> {
                Columns::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(Storages::Columns)
            }
        }

        deserializer.deserialize_any(StoragesVisitor)
    }
}

/// Version 2's storages: storage `i` is row `i` of every column, its kind, op and module
/// indices into `names` (a trace names a few hundred ops and modules over a million storages).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Columns {
    bytes: Column<u64>,
    kind: Column<u32>,
    op: Column<u32>,
    module: Column<u32>,
    stream: Option<Column<u32>>,
    names: Names,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Names {
    kind: Column<StorageKind>,
    op: Column<String>,
    module: Column<String>,
}

impl Columns {
    /// The storages, row by row: every column as long as `bytes`, every index naming a name.
    fn storages(self) -> Result<Vec<Storage>> {
        let rows = self.bytes.0.len();
        let streams = self.stream.map(|c| c.0);
        for (column, len) in [
            ("kind", self.kind.0.len()),
            ("op", self.op.0.len()),
            ("module", self.module.0.len()),
            ("stream", streams.as_ref().map_or(rows, Vec::len)),
        ] {
            if len != rows {
                return Err(Error::field(
                    format!("storages.{column}"),
                    format!("{len} entries"),
                    format!("every column has one entry per storage, as `bytes` has ({rows})"),
                ));
            }
        }
        let name = |column: &str, names: usize, indices: &[u32], i: usize| {
            let index = indices[i];
            if (index as usize) < names {
                Ok(index as usize)
            } else {
                Err(Error::field(
                    format!("storages.{column}[{i}]"),
                    index,
                    format!("use an index into storages.names.{column} ({names} names)"),
                ))
            }
        };
        let names = &self.names;
        // Written out once per storage, the names take what version 1's file would: bounded alike.
        let mut written_out: u64 = 0;
        let mut storages = Vec::with_capacity(rows);
        for i in 0..rows {
            let op = &names.op.0[name("op", names.op.0.len(), &self.op.0, i)?];
            let module = &names.module.0[name("module", names.module.0.len(), &self.module.0, i)?];
            written_out += (op.len() + module.len()) as u64;
            if written_out > MAX_TRACE_BYTES {
                return Err(Error::field(
                    "storages.names",
                    format!("more than {MAX_TRACE_BYTES} bytes of op and module names"),
                    format!(
                        "written out once per storage, as version 1 writes them, the names come \
                         to at most {MAX_TRACE_BYTES} bytes (headroom::limits::MAX_TRACE_BYTES)"
                    ),
                ));
            }
            storages.push(Storage {
                bytes: self.bytes.0[i],
                kind: names.kind.0[name("kind", names.kind.0.len(), &self.kind.0, i)?],
                op: op.clone(),
                module: module.clone(),
                stream: streams.as_ref().map_or(0, |s| s[i]),
            });
        }
        Ok(storages)
    }
}

/// A column of version 2's storages: at most [`MAX_TRACE_STORAGES`] entries.
struct Column<T>(Vec<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Column<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ColumnVisitor<T>(PhantomData<T>);

        impl<'de, T: Deserialize<'de>> Visitor<'de> for ColumnVisitor<T> {
            type Value = Column<T>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list, one entry per storage")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Column<T>, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    if items.len() == MAX_TRACE_STORAGES {
                        return Err(de::Error::custom(format!(
                            "a column of `storages` has at most {MAX_TRACE_STORAGES} entries \
                             (headroom::limits::MAX_TRACE_STORAGES)"
                        )));
                    }
                    items.push(item);
                }
                Ok(Column(items))
            }
        }

        deserializer.deserialize_seq(ColumnVisitor(PhantomData))
    }
}

/// An event as written: a list (`["gemm", false]`), or in version 2 an allocation or a free
/// as a bare integer.
enum Written {
    Event(Event),
    /// `0`: the allocation of storage `next`, `next` the number of allocations before it.
    AllocNext,
    /// `d` > 0: the free of storage `next - d`.
    FreeBack(u64),
}

impl<'de> Deserialize<'de> for Written {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct WrittenVisitor;

        impl<'de> Visitor<'de> for WrittenVisitor {
            type Value = Written;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an event: [name, arguments...], or an integer (version 2)")
            }
            fn visit_u64<E>(self, v: u64) -> Result<Written, E> {
                Ok(if v == 0 {
                    Written::AllocNext
                } else {
                    Written::FreeBack(v)
                })
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Written, A::Error> {
                EventVisitor.visit_seq(seq).map(Written::Event)
            }
        }

        deserializer.deserialize_any(WrittenVisitor)
    }
}

impl Listed for Written {
    const FIELD: &'static str = "events";
    const MAX: usize = MAX_TRACE_EVENTS;
    const LIMIT: &'static str = "MAX_TRACE_EVENTS";
}

/// The events the integers of version 2 stand for, in order.
fn unwritten(written: Vec<Written>, compact: bool) -> Result<Vec<Event>> {
    let mut allocated: u64 = 0;
    let mut events = Vec::with_capacity(written.len());
    for (i, w) in written.into_iter().enumerate() {
        let event = match w {
            Written::Event(event) => event,
            Written::AllocNext | Written::FreeBack(_) if !compact => {
                return Err(Error::field(
                    format!("events[{i}]"),
                    "an integer",
                    "version 1 writes every event as [name, arguments...]; integers are version 2's",
                ));
            }
            Written::AllocNext => Event::Alloc(storage_id(allocated, i)?),
            Written::FreeBack(back) if back <= allocated => {
                Event::Free(storage_id(allocated - back, i)?)
            }
            Written::FreeBack(back) => {
                return Err(Error::field(
                    format!("events[{i}]"),
                    back,
                    format!(
                        "a free written as d frees storage {allocated} - d, {allocated} being the \
                         allocations before it: use 1 to {allocated}"
                    ),
                ));
            }
        };
        if matches!(event, Event::Alloc(_)) {
            allocated += 1;
        }
        events.push(event);
    }
    Ok(events)
}

fn storage_id(id: u64, i: usize) -> Result<u32> {
    if id < MAX_TRACE_STORAGES as u64 {
        Ok(id as u32)
    } else {
        Err(Error::field(
            format!("events[{i}]"),
            id,
            format!("a trace has at most {MAX_TRACE_STORAGES} storages"),
        ))
    }
}

/// A top-level list of the file: at most `MAX` entries, and an entry's errors name it
/// (`events[12]`).
struct List<T>(Vec<T>);

/// How a list is named in messages and how long it may be.
trait Listed: DeserializeOwned {
    const FIELD: &'static str;
    const MAX: usize;
    const LIMIT: &'static str;
}

impl Listed for Phase {
    const FIELD: &'static str = "phases";
    const MAX: usize = MAX_TRACE_PHASES;
    const LIMIT: &'static str = "MAX_TRACE_PHASES";
}

impl Listed for Storage {
    const FIELD: &'static str = "storages";
    const MAX: usize = MAX_TRACE_STORAGES;
    const LIMIT: &'static str = "MAX_TRACE_STORAGES";
}

impl<'de, T: Listed> Deserialize<'de> for List<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_seq(ListVisitor(PhantomData))
    }
}

/// Reads a top-level list up to its `MAX` entries.
struct ListVisitor<T>(PhantomData<T>);

impl<'de, T: Listed> Visitor<'de> for ListVisitor<T> {
    type Value = List<T>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a list of {}", T::FIELD)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<List<T>, A::Error> {
        let mut items = Vec::new();
        loop {
            if items.len() == T::MAX {
                if seq.next_element::<IgnoredAny>()?.is_some() {
                    return Err(de::Error::custom(format!(
                        "`{}`: more than {} entries is not allowed; a trace has at most \
                                 {} (headroom::limits::{})",
                        T::FIELD,
                        T::MAX,
                        T::MAX,
                        T::LIMIT
                    )));
                }
                return Ok(List(items));
            }
            let index = items.len();
            match seq.next_element_seed(Entry::<T>(index, PhantomData))? {
                Some(item) => items.push(item),
                None => return Ok(List(items)),
            }
        }
    }
}

/// Entry `.0` of a list: its errors are prefixed with where it is. serde_json reads the
/// position back from the inner message's end, so the line and column stay the entry's.
struct Entry<T>(usize, PhantomData<T>);

impl<'de, T: Listed> de::DeserializeSeed<'de> for Entry<T> {
    type Value = T;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<T, D::Error> {
        T::deserialize(deserializer)
            .map_err(|e| de::Error::custom(format!("`{}[{}]`: {e}", T::FIELD, self.0)))
    }
}

/// An element of an event, as much of it as a message needs: a list or an object inside an
/// event is skipped unread.
#[derive(Debug)]
enum Scalar {
    Bool(bool),
    Unsigned(u64),
    Negative(i64),
    Float(f64),
    Text(String),
    Null,
    List,
    Object,
}

impl fmt::Display for Scalar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Bool(b) => write!(f, "{b}"),
            Scalar::Unsigned(n) => write!(f, "{n}"),
            Scalar::Negative(n) => write!(f, "{n}"),
            Scalar::Float(x) => write!(f, "{x}"),
            Scalar::Text(s) => write!(f, "{:?}", shown(s, SHOWN_CHARS)),
            Scalar::Null => f.write_str("null"),
            Scalar::List => f.write_str("a list"),
            Scalar::Object => f.write_str("an object"),
        }
    }
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ScalarVisitor;

        impl<'de> Visitor<'de> for ScalarVisitor {
            type Value = Scalar;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar::Bool(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar::Unsigned(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Scalar, E> {
                Ok(u64::try_from(v).map_or(Scalar::Negative(v), Scalar::Unsigned))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar::Float(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Scalar, E> {
                // Event names are short; a long string only needs its start in a message.
                Ok(Scalar::Text(shown(v, SHOWN_CHARS)))
            }
            fn visit_unit<E>(self) -> Result<Scalar, E> {
                Ok(Scalar::Null)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Scalar::List)
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Scalar::Object)
            }
        }

        deserializer.deserialize_any(ScalarVisitor)
    }
}

/// The events the format has: name, fewest and most arguments, and how they are written.
const EVENTS: [(&str, usize, usize, &str); 9] = [
    ("alloc", 1, 1, "[\"alloc\", storage]"),
    ("free", 1, 1, "[\"free\", storage]"),
    ("empty_cache", 0, 0, "[\"empty_cache\"]"),
    (
        "caching_allocator_warmup",
        1,
        1,
        "[\"caching_allocator_warmup\", weight_bytes]",
    ),
    (
        "gemm",
        1,
        2,
        "[\"gemm\", bias_epilogue] or [\"gemm\", bias_epilogue, thread]",
    ),
    ("reduce", 2, 2, "[\"reduce\", outputs, inputs]"),
    (
        "attention_backward",
        7,
        8,
        "[\"attention_backward\", kernel, batch, heads, seq, head_dim, gqa, dtype_bytes] or \
         [..., dtype_bytes, key_seq]",
    ),
    ("engine", 2, 2, "[\"engine\", index, awake]"),
    (
        "record_stream",
        2,
        2,
        "[\"record_stream\", storage, stream]",
    ),
];

/// The message of a value that cannot be used: `what value is not allowed; allowed`.
fn refuse<E: de::Error>(what: &str, value: impl fmt::Display, allowed: impl fmt::Display) -> E {
    let value = shown(&value.to_string(), SHOWN_CHARS);
    E::custom(format!("{what}{value} is not allowed; {allowed}"))
}

/// Reads an event written as a list: its name, then its arguments, each checked.
struct EventVisitor;

impl<'de> Visitor<'de> for EventVisitor {
    type Value = Event;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an event: [name, arguments...]")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Event, A::Error> {
        let names = || {
            let names: Vec<&str> = EVENTS.iter().map(|(name, ..)| *name).collect();
            format!(
                "an event is [name, arguments...], named {}",
                names.join(", ")
            )
        };
        let name = match seq.next_element::<Scalar>()? {
            Some(Scalar::Text(name)) => name,
            Some(other) => return Err(refuse("the name ", other, names())),
            None => return Err(refuse("", "[]", names())),
        };
        let Some(&(name, fewest, most, usage)) = EVENTS.iter().find(|(n, ..)| *n == name) else {
            return Err(refuse("", Scalar::Text(name), names()));
        };
        let mut args = SmallVec::<[Scalar; 7]>::new();
        let mut given = 0;
        while given < most {
            match seq.next_element::<Scalar>()? {
                Some(arg) => args.push(arg),
                None => break,
            }
            given += 1;
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {
            given += 1;
        }
        if !(fewest..=most).contains(&given) {
            let takes = if fewest == most {
                fewest.to_string()
            } else {
                format!("{fewest} or {most}")
            };
            return Err(refuse(
                &format!("`{name}` with "),
                format!("{given} arguments"),
                format!("it takes {takes}: {usage}"),
            ));
        }
        event(name, &args)
    }
}

/// The event `name` of the right number of `args`, each checked.
fn event<E: de::Error>(name: &str, args: &[Scalar]) -> Result<Event, E> {
    Ok(match name {
        "alloc" => Event::Alloc(storage(&args[0])?),
        "free" => Event::Free(storage(&args[0])?),
        "empty_cache" => Event::EmptyCache,
        "caching_allocator_warmup" => Event::CachingAllocatorWarmup {
            weight_bytes: storage_bytes("weight_bytes", &args[0])?,
        },
        "gemm" => Event::Gemm {
            bias_epilogue: flag("bias_epilogue", &args[0])?,
            thread: args.get(1).map(thread).transpose()?,
        },
        "reduce" => Event::Reduce {
            outputs: elements("outputs", &args[0])?,
            inputs: elements("inputs", &args[1])?,
        },
        "engine" => Event::Engine {
            engine: engine_index(&args[0])?,
            awake: flag("awake", &args[1])?,
        },
        "record_stream" => Event::RecordStream {
            storage: storage(&args[0])?,
            stream: stream(&args[1])?,
        },
        _ => Event::AttentionBackward(Box::new(attention(args)?)),
    })
}

fn storage<E: de::Error>(arg: &Scalar) -> Result<u32, E> {
    match *arg {
        Scalar::Unsigned(id) if id < MAX_TRACE_STORAGES as u64 => Ok(id as u32),
        _ => Err(refuse(
            "storage ",
            arg,
            format!(
                "use a storage's index, an integer from 0 (a trace has at most {MAX_TRACE_STORAGES} \
                 storages)"
            ),
        )),
    }
}

fn stream<E: de::Error>(arg: &Scalar) -> Result<u32, E> {
    match *arg {
        Scalar::Unsigned(n) if n <= u64::from(u32::MAX) => Ok(n as u32),
        _ => Err(refuse(
            "stream ",
            arg,
            format!(
                "use a stream's number, an integer from 0 (the default stream) to {}",
                u32::MAX
            ),
        )),
    }
}

fn engine_index<E: de::Error>(arg: &Scalar) -> Result<u32, E> {
    match *arg {
        Scalar::Unsigned(k) if k < MAX_INSTANCES as u64 => Ok(k as u32),
        _ => Err(refuse(
            "engine ",
            arg,
            format!(
                "use an index into `engines`, an integer from 0 to {}",
                MAX_INSTANCES - 1
            ),
        )),
    }
}

fn thread<E: de::Error>(arg: &Scalar) -> Result<Thread, E> {
    match *arg {
        Scalar::Unsigned(0) => Ok(Thread::Main),
        Scalar::Unsigned(1) => Ok(Thread::Autograd),
        _ => Err(refuse(
            "thread ",
            arg,
            "use 0 (the Python thread) or 1 (autograd's device thread)",
        )),
    }
}

fn flag<E: de::Error>(what: &str, arg: &Scalar) -> Result<bool, E> {
    match *arg {
        Scalar::Bool(b) => Ok(b),
        _ => Err(refuse(&format!("{what} "), arg, "use true or false")),
    }
}

fn elements<E: de::Error>(what: &str, arg: &Scalar) -> Result<u64, E> {
    at_most(
        what,
        arg,
        MAX_TRACE_ELEMENTS,
        "elements of a tensor, headroom::limits::MAX_TRACE_ELEMENTS",
    )
}

fn storage_bytes<E: de::Error>(what: &str, arg: &Scalar) -> Result<u64, E> {
    at_most(
        what,
        arg,
        MAX_TRACE_STORAGE_BYTES,
        "bytes, headroom::limits::MAX_TRACE_STORAGE_BYTES",
    )
}

/// An integer argument within `0..=max`; `why` says what it counts and names the limit.
fn at_most<E: de::Error>(what: &str, arg: &Scalar, max: u64, why: &str) -> Result<u64, E> {
    match *arg {
        Scalar::Unsigned(n) if n <= max => Ok(n),
        _ => Err(refuse(
            &format!("{what} "),
            arg,
            format!("use an integer from 0 to {max} ({why})"),
        )),
    }
}

/// An integer argument within `1..=max`; `why` names the limit.
fn within<E: de::Error>(what: &str, arg: &Scalar, max: u64, why: &str) -> Result<u64, E> {
    match *arg {
        Scalar::Unsigned(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(refuse(
            &format!("{what} "),
            arg,
            format!("use an integer from 1 to {max} ({why})"),
        )),
    }
}

fn attention<E: de::Error>(args: &[Scalar]) -> Result<AttentionBackward, E> {
    let kernel = match &args[0] {
        Scalar::Text(k) if k == "flash" => AttentionKernel::Flash,
        Scalar::Text(k) if k == "cudnn" => AttentionKernel::Cudnn,
        Scalar::Text(k) if k == "efficient" => AttentionKernel::Efficient,
        other => return Err(refuse("kernel ", other, "use flash, cudnn or efficient")),
    };
    let batch = within(
        "batch",
        &args[1],
        MAX_TOKENS,
        "headroom::limits::MAX_TOKENS",
    )?;
    let heads = within("heads", &args[2], MAX_HEADS, "headroom::limits::MAX_HEADS")?;
    let seq = within(
        "seq",
        &args[3],
        MAX_POSITIONS,
        "headroom::limits::MAX_POSITIONS",
    )?;
    let head_dim = within(
        "head_dim",
        &args[4],
        MAX_HEAD_DIM,
        "headroom::limits::MAX_HEAD_DIM",
    )?;
    if batch * seq > MAX_TOKENS {
        return Err(refuse(
            "batch × seq ",
            batch * seq,
            format!("use at most {MAX_TOKENS} tokens (headroom::limits::MAX_TOKENS)"),
        ));
    }
    let gqa = flag("gqa", &args[5])?;
    let dtype_bytes = match args[6] {
        Scalar::Unsigned(n @ (1 | 2 | 4 | 8)) => n,
        ref other => return Err(refuse("dtype_bytes ", other, "use 1, 2, 4 or 8")),
    };
    let key_seq = match args.get(7) {
        Some(arg) => within(
            "key_seq",
            arg,
            MAX_POSITIONS,
            "headroom::limits::MAX_POSITIONS",
        )?,
        None => seq,
    };
    Ok(AttentionBackward {
        kernel,
        batch,
        heads,
        seq,
        head_dim,
        gqa,
        dtype_bytes,
        key_seq,
    })
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use serde_json::json;

    use super::*;

    /// A valid trace of two storages, with `key` replaced by `value`.
    fn with(key: &str, value: Value) -> Vec<u8> {
        let mut doc = json!({
            "format": "headroom-trace", "version": 1,
            "spec": {"model": "tiny", "mode": "train"},
            "env": {"torch": "2.11.0"},
            "phases": [{"name": "load", "event": 0}, {"name": "step 1 forward", "event": 0}],
            "storages": [
                {"bytes": 4096, "kind": "parameter", "op": "aten.empty", "module": "lm_head"},
                {"bytes": 512, "kind": "activation", "op": "aten.mm", "module": ""},
            ],
            "events": [["alloc", 0], ["gemm", true], ["alloc", 1], ["reduce", 8, 64], ["free", 1]],
        });
        doc[key] = value;
        doc.to_string().into_bytes()
    }

    fn error(bytes: &[u8]) -> String {
        from_bytes(bytes, Path::new("t.json"))
            .expect_err("refused")
            .to_string()
    }

    fn event_error(event: Value) -> String {
        let mut events = vec![json!(["alloc", 0])];
        events.push(event);
        error(&with("events", Value::Array(events)))
    }

    #[test]
    fn a_trace_reads_plain_or_gzipped() {
        let plain = with("version", json!(1));
        let trace = from_bytes(&plain, Path::new("t.json")).expect("valid");
        assert_eq!(trace.model(), Some("tiny"));
        assert_eq!(trace.storages[0].kind, super::super::StorageKind::Parameter);
        assert_eq!(
            trace.events[3],
            Event::Reduce {
                outputs: 8,
                inputs: 64
            }
        );
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&plain).expect("compressed");
        let gz = gz.finish().expect("compressed");
        assert_eq!(
            from_bytes(&gz, Path::new("t.json.gz")).expect("valid"),
            trace
        );
        let cut = error(&gz[..gz.len() / 2]);
        assert!(cut.starts_with("t.json: not a whole gzip stream"), "{cut}");
    }

    #[test]
    fn a_file_that_is_not_a_trace_says_what_it_lacks() {
        let cases = [
            (b"not json".to_vec(), "t.json:1:2: expected ident"),
            (
                b"{\"model\": \"qwen\"}".to_vec(),
                "`t.json: format`: nothing is not allowed",
            ),
            (
                with("format", json!("x")),
                "`t.json: format`: \"x\" is not allowed",
            ),
            (
                with("version", json!(3)),
                "`t.json: version`: 3 is not allowed",
            ),
            (
                with("storages", Value::Null),
                "`t.json: storages`: nothing is not allowed",
            ),
            (with("env", json!([1])), "`t.json: env`: [1] is not allowed"),
        ];
        for (bytes, message) in cases {
            let err = error(&bytes);
            assert!(err.starts_with(message), "{err}");
        }
    }

    /// `with`'s trace as version 2 writes it, with `key` of its storage columns replaced.
    fn compact(key: &str, value: Value) -> Vec<u8> {
        let mut columns = json!({
            "bytes": [4096, 512], "kind": [0, 1], "op": [0, 1], "module": [0, 1],
            "names": {"kind": ["parameter", "activation"], "op": ["aten.empty", "aten.mm"],
                      "module": ["lm_head", ""]},
        });
        if !key.is_empty() {
            columns[key] = value;
        }
        let mut doc: Value = serde_json::from_slice(&with("version", json!(2))).expect("json");
        doc["storages"] = columns;
        doc["events"] = json!([0, ["gemm", true], 0, ["reduce", 8, 64], 1]);
        doc.to_string().into_bytes()
    }

    #[test]
    fn version_2_columns_and_integers_read_as_version_1_lists() {
        let listed = from_bytes(&with("version", json!(1)), Path::new("t.json")).expect("v1");
        let compacted = from_bytes(&compact("", Value::Null), Path::new("t.json")).expect("v2");
        assert_eq!(listed, compacted);
        // A stream's use of a storage is written as a list in both versions.
        let mut doc: Value = serde_json::from_slice(&compact("", Value::Null)).expect("json");
        doc["events"] = json!([0, ["record_stream", 0, 2], 1]);
        let trace = from_bytes(doc.to_string().as_bytes(), Path::new("t.json")).expect("v2");
        assert_eq!(
            trace.events[1],
            Event::RecordStream {
                storage: 0,
                stream: 2
            }
        );
        let mut streams = compact("stream", json!([0, 2]));
        let trace = from_bytes(&streams, Path::new("t.json")).expect("streams");
        assert_eq!(trace.storages[1].stream, 2);
        streams = compact("stream", json!([0]));
        assert!(
            error(&streams).contains("storages.stream"),
            "{}",
            error(&streams)
        );
    }

    #[test]
    fn version_2_refuses_what_its_columns_and_integers_cannot_mean() {
        let cases = [
            (
                compact("op", json!([0])),
                "`t.json: storages.op`: 1 entries",
            ),
            (
                compact("module", json!([0, 2])),
                "`t.json: storages.module[1]`: 2",
            ),
            (
                compact("kind", json!([0, 7])),
                "`t.json: storages.kind[1]`: 7",
            ),
            (
                compact("names", json!({"kind": ["parameter"]})),
                "missing field `op`",
            ),
            (compact("extra", json!([])), "unknown field `extra`"),
        ];
        for (bytes, message) in cases {
            let err = error(&bytes);
            assert!(err.contains(message), "{message}: {err}");
        }
        let rows = 300;
        let mut names = compact("module", json!(vec![0; rows]));
        let mut doc: Value = serde_json::from_slice(&names).expect("json");
        let storages = &mut doc["storages"];
        storages["names"]["module"] = json!(["x".repeat(1 << 20)]);
        for column in ["bytes", "kind", "op"] {
            storages[column] = json!(vec![0; rows]);
        }
        names = doc.to_string().into_bytes();
        let err = error(&names);
        assert!(err.contains("`t.json: storages.names`"), "{err}");
        let mut doc: Value = serde_json::from_slice(&compact("", Value::Null)).expect("json");
        doc["events"] = json!([0, 2]);
        let err = error(doc.to_string().as_bytes());
        assert!(
            err.contains("`t.json: events[1]`: 2 is not allowed; a free written as d"),
            "{err}"
        );
        let mut v1: Value = serde_json::from_slice(&with("version", json!(1))).expect("json");
        v1["events"] = json!([0]);
        let err = error(v1.to_string().as_bytes());
        assert!(err.contains("integers are version 2's"), "{err}");
        v1["storages"] = doc["storages"].clone();
        let err = error(v1.to_string().as_bytes());
        assert!(err.contains("columns are version 2's"), "{err}");
    }

    #[test]
    fn a_bad_event_names_its_index_value_and_what_is_allowed() {
        let cases = [
            (
                json!(["frob", 1]),
                "`events[1]`: \"frob\" is not allowed; an event is",
            ),
            (
                json!([]),
                "`events[1]`: [] is not allowed; an event is [name, arguments...]",
            ),
            (json!([3]), "`events[1]`: the name 3 is not allowed"),
            (
                json!("alloc"),
                "`events[1]`: invalid type: string \"alloc\", expected an event",
            ),
            (
                json!(["alloc"]),
                "`events[1]`: `alloc` with 0 arguments is not allowed; it takes 1",
            ),
            (
                json!(["empty_cache", 1]),
                "`empty_cache` with 1 arguments is not allowed",
            ),
            (
                json!(["reduce", 1, 2, 3, 4]),
                "`reduce` with 4 arguments is not allowed",
            ),
            (
                json!(["alloc", -1]),
                "`events[1]`: storage -1 is not allowed",
            ),
            (
                json!(["free", "0"]),
                "`events[1]`: storage \"0\" is not allowed",
            ),
            (
                json!(["gemm", 1]),
                "`events[1]`: bias_epilogue 1 is not allowed; use true or false",
            ),
            (
                json!(["reduce", 1.5, 2]),
                "`events[1]`: outputs 1.5 is not allowed",
            ),
            (
                json!(["reduce", 1, 1u64 << 49]),
                "inputs 562949953421312 is not allowed",
            ),
            (
                json!(["attention_backward", "math", 1, 1, 1, 1, false, 2]),
                "kernel \"math\" is not allowed; use flash, cudnn or efficient",
            ),
            (
                json!(["attention_backward", "flash", 0, 1, 1, 1, false, 2]),
                "batch 0 is not allowed; use an integer from 1 to 16777216",
            ),
            (
                json!(["attention_backward", "flash", 1024, 1, 1 << 20, 1, false, 2]),
                "batch × seq 1073741824 is not allowed",
            ),
            (
                json!(["attention_backward", "flash", 1, 1, 1, 1, false, 3]),
                "dtype_bytes 3 is not allowed; use 1, 2, 4 or 8",
            ),
            (
                json!(["gemm", [[[[[[1]]]]]]]),
                "bias_epilogue a list is not allowed",
            ),
            (
                json!(["record_stream", 0]),
                "`record_stream` with 1 arguments is not allowed; it takes 2: \
                 [\"record_stream\", storage, stream]",
            ),
            (
                json!(["record_stream", 0, -1]),
                "stream -1 is not allowed; use a stream's number",
            ),
            (
                json!(["record_stream", 0, 1u64 << 32]),
                "stream 4294967296 is not allowed",
            ),
        ];
        for (event, message) in cases {
            let err = event_error(event);
            assert!(err.contains(message), "{err}\nwants: {message}");
            assert!(err.starts_with("t.json:1:"), "{err}");
        }
        // Skipped without recursion, however deep.
        let deep = format!("[\"gemm\", {}{}]", "[".repeat(100_000), "]".repeat(100_000));
        let text = String::from_utf8(with("events", json!([]))).unwrap();
        let text = text.replace("\"events\":[]", &format!("\"events\":[{deep}]"));
        let err = error(text.as_bytes());
        assert!(err.contains("bias_epilogue a list is not allowed"), "{err}");
    }

    #[test]
    fn storages_must_be_allocated_once_before_they_are_freed() {
        let cases = [
            (
                json!([["alloc", 2]]),
                "[\"alloc\", 2] is not allowed; the trace has 2 storages",
            ),
            (
                json!([["alloc", 0], ["alloc", 0]]),
                "storage 0 is already allocated (at events[0])",
            ),
            (json!([["free", 1]]), "storage 1 is not allocated before it"),
            (
                json!([["alloc", 1], ["free", 1], ["alloc", 1]]),
                "storage 1 was freed at events[1]; a storage is allocated once",
            ),
            (
                json!([["alloc", 1], ["free", 1], ["free", 1]]),
                "storage 1 was freed already, at events[1]",
            ),
            (
                json!([["record_stream", 0, 1]]),
                "[\"record_stream\", 0, 1] is not allowed; storage 0 is not live there",
            ),
            (
                json!([["alloc", 0], ["free", 0], ["record_stream", 0, 1]]),
                "storage 0 is not live there; a stream uses only a live storage",
            ),
            (
                json!([["record_stream", 5, 1]]),
                "[\"record_stream\", 5, 1] is not allowed; the trace has 2 storages",
            ),
        ];
        for (events, message) in cases {
            let err = error(&with("events", events));
            assert!(err.starts_with("`t.json: events["), "{err}");
            assert!(err.contains(message), "{err}\nwants: {message}");
        }
    }

    #[test]
    fn rollout_engines_are_checked() {
        let engines = |share: Value, index: u64| {
            let mut doc: Value = serde_json::from_slice(&with(
                "engines",
                json!([
                    {"name": "rollout", "gpu_memory_utilization": share}
                ]),
            ))
            .unwrap();
            doc["events"]
                .as_array_mut()
                .unwrap()
                .push(json!(["engine", index, true]));
            doc.to_string().into_bytes()
        };
        let t = from_bytes(&engines(json!(0.5), 0), Path::new("t.json")).expect("valid");
        assert_eq!(t.engines[0].gpu_memory_utilization, 0.5);
        assert_eq!(
            t.events[5],
            Event::Engine {
                engine: 0,
                awake: true
            }
        );
        for (bytes, message) in [
            (
                engines(json!(1.5), 0),
                "`t.json: engines[0].gpu_memory_utilization`: 1.5 is not allowed; use a share of the device above 0 and at most 1",
            ),
            (
                engines(json!(0.5), 1),
                "`t.json: events[5]`: [\"engine\", 1, true] is not allowed; the trace lists 1 engines",
            ),
            (
                engines(json!(0.5), 99),
                "`events[5]`: engine 99 is not allowed",
            ),
        ] {
            let err = error(&bytes);
            assert!(err.contains(message), "{err}\nwants: {message}");
        }
    }

    #[test]
    fn storages_and_phases_are_checked() {
        let storage = |bytes: Value, kind: &str| json!([{"bytes": bytes, "kind": kind, "op": "x", "module": ""}, {"bytes": 1, "kind": "temporary", "op": "x", "module": ""}]);
        let cases = [
            (
                with("storages", storage(json!(1u64 << 51), "activation")),
                "`t.json: storages[0].bytes`: 2251799813685248 is not allowed",
            ),
            (
                with("storages", storage(json!(-1), "activation")),
                "`storages[0]`: invalid value: integer `-1`, expected u64",
            ),
            (
                with("storages", storage(json!(1), "weights")),
                "`storages[0]`: unknown variant `weights`, expected one of `parameter`",
            ),
            (
                with("phases", json!([])),
                "`t.json: phases`: [] is not allowed",
            ),
            (
                with("phases", json!([{"name": "load", "event": 1}])),
                "`t.json: phases[0].event`: 1 is not allowed",
            ),
            (
                with(
                    "phases",
                    json!([{"name": "load", "event": 0}, {"name": "x", "event": 6}]),
                ),
                "`t.json: phases[1].event`: 6 is not allowed; phases begin in order, from 0 to the number of events (5)",
            ),
            (
                with("phases", json!([{"name": "", "event": 0}])),
                "`t.json: phases[0].name`",
            ),
        ];
        for (bytes, message) in cases {
            let err = error(&bytes);
            assert!(err.contains(message), "{err}\nwants: {message}");
        }
        let phases: Vec<Value> = (0..=MAX_TRACE_PHASES)
            .map(|_| json!({"name": "load", "event": 0}))
            .collect();
        let err = error(&with("phases", Value::Array(phases)));
        assert!(
            err.contains("`phases`: more than 4096 entries is not allowed"),
            "{err}"
        );
    }

    #[test]
    fn json_is_told_from_a_pickle_by_its_first_byte() {
        let dir = tempfile_dir();
        let json_path = dir.join("t.json");
        std::fs::write(&json_path, b"  \n{\"format\": 1}").unwrap();
        assert!(is_json(&json_path));
        let pickle = dir.join("s.pickle");
        std::fs::write(&pickle, b"\x80\x04\x95").unwrap();
        assert!(!is_json(&pickle));
        assert!(!is_json(&dir.join("missing")));
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(b"{}").unwrap();
        let gz_path = dir.join("t.json.gz");
        std::fs::write(&gz_path, gz.finish().unwrap()).unwrap();
        assert!(is_json(&gz_path));
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("headroom-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
