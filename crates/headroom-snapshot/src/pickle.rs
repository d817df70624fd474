//! A reader for the subset of the pickle format that `torch.cuda.memory._dump_snapshot` writes
//! (protocols 2 to 5, builtins only: dict, list, tuple, str, int, float, bool, None).
//!
//! Why not `serde-pickle`: snapshots share one Python list of frames between many trace
//! entries through the memo, which `serde-pickle` 1.2 rejects ("recursive structure found")
//! and which a value tree would copy per reference. Here containers are objects in a heap
//! referred to by index, so a memo reference costs 16 bytes, and trace entries (the bulk of a
//! large file) are turned into compact [`TraceEvent`]s as soon as their dict is filled, with
//! their stacks interned.
//!
//! Any input, however corrupt, ends in `Ok` or `Err` in time and memory proportional to its
//! length: every read is bounds-checked, lengths are checked against the bytes left, the stack
//! machine never recurses, and its stack and memo are bounded ([`crate::limits`]).

use std::collections::HashMap;

use crate::error::{DecodeError, Limit, PickleError};
use crate::limits::MAX_STACK;
use crate::model::{Action, NO_STACK, RawFrame, StackId, TraceEvent};

/// A pickled value. Containers and strings are indices into the [`Heap`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An int in `[2^63, 2^64)`: addresses and stream handles fit `u64`.
    UInt(u64),
    Float(f64),
    Str(u32),
    /// Bytes never carry snapshot data; only their presence is kept.
    Bytes,
    List(u32),
    Tuple(u32),
    Dict(u32),
}

impl Value {
    pub(crate) fn as_u64(self) -> Option<u64> {
        match self {
            Value::Int(i) => u64::try_from(i).ok(),
            Value::UInt(u) => Some(u),
            Value::Bool(b) => Some(u64::from(b)),
            _ => None,
        }
    }

    pub(crate) fn as_i64(self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(i),
            Value::Bool(b) => Some(i64::from(b)),
            _ => None,
        }
    }
}

/// What a dict object holds.
pub(crate) enum DictBody {
    Entries(Vec<(Value, Value)>),
    /// A trace entry, already converted (index into `Heap::events`).
    Event(u32),
}

/// Every object of one pickle.
#[derive(Default)]
pub(crate) struct Heap {
    pub strings: Vec<Box<str>>,
    /// Lists, tuples and sets.
    pub sequences: Vec<Vec<Value>>,
    pub dicts: Vec<DictBody>,
    pub events: Vec<TraceEvent>,
    pub frames: Vec<RawFrame>,
    pub stacks: Vec<Box<[u32]>>,
    /// Values the pickle made (pushed on its stack): what a converter of a pickle that shares
    /// nothing can visit at most.
    pub made: u64,
    frame_of_dict: HashMap<u32, u32>,
    stack_of_list: HashMap<u32, StackId>,
    stack_ids: HashMap<Box<[u32]>, StackId>,
}

impl Heap {
    pub(crate) fn str(&self, v: Value) -> Option<&str> {
        match v {
            Value::Str(i) => Some(&self.strings[i as usize]),
            _ => None,
        }
    }

    pub(crate) fn seq(&self, v: Value) -> Option<&[Value]> {
        match v {
            Value::List(i) | Value::Tuple(i) => Some(&self.sequences[i as usize]),
            _ => None,
        }
    }

    pub(crate) fn dict(&self, v: Value) -> Option<&DictBody> {
        match v {
            Value::Dict(i) => Some(&self.dicts[i as usize]),
            _ => None,
        }
    }

    /// `d[key]` for a dict with string keys.
    pub(crate) fn get(&self, d: Value, key: &str) -> Option<Value> {
        match self.dict(d)? {
            DictBody::Entries(entries) => entries
                .iter()
                .find(|(k, _)| self.str(*k) == Some(key))
                .map(|(_, v)| *v),
            DictBody::Event(_) => None,
        }
    }

    /// The interned stack of a `frames` list: frame dicts become [`RawFrame`]s once, and equal
    /// stacks share one id. Anything that is not a list of frame dicts has no stack.
    pub(crate) fn intern_stack(&mut self, frames: Value) -> StackId {
        let Value::List(list) = frames else {
            return NO_STACK;
        };
        if let Some(&id) = self.stack_of_list.get(&list) {
            return id;
        }
        let mut stack = Vec::with_capacity(self.sequences[list as usize].len());
        for i in 0..self.sequences[list as usize].len() {
            if let Value::Dict(d) = self.sequences[list as usize][i]
                && let Some(frame) = self.frame(d)
            {
                stack.push(frame);
            }
        }
        let stack = stack.into_boxed_slice();
        let next = self.stacks.len() as StackId;
        let id = *self.stack_ids.entry(stack.clone()).or_insert(next);
        if id == next {
            self.stacks.push(stack);
        }
        self.stack_of_list.insert(list, id);
        id
    }

    fn frame(&mut self, dict: u32) -> Option<u32> {
        if let Some(&f) = self.frame_of_dict.get(&dict) {
            return Some(f);
        }
        let d = Value::Dict(dict);
        let filename = match self.get(d, "filename")? {
            Value::Str(s) => s,
            _ => return None,
        };
        let name = match self.get(d, "name") {
            Some(Value::Str(s)) => s,
            _ => return None,
        };
        let line = self.get(d, "line").and_then(Value::as_i64).unwrap_or(0);
        let index = self.frames.len() as u32;
        self.frames.push(RawFrame {
            filename,
            name,
            line,
        });
        self.frame_of_dict.insert(dict, index);
        Some(index)
    }

    /// Turns the items of a fresh dict into a [`TraceEvent`] if they are a trace entry
    /// (`action` is a string and `addr`/`size` are ints or absent).
    fn trace_event(&mut self, items: &[Value]) -> Option<TraceEvent> {
        let mut event = TraceEvent {
            action: Action::Other,
            addr: 0,
            size: 0,
            stream: 0,
            time_us: 0,
            frames: NO_STACK,
        };
        let mut has_action = false;
        let mut frames = None;
        for pair in items.chunks_exact(2) {
            let Value::Str(key) = pair[0] else { continue };
            let value = pair[1];
            match &*self.strings[key as usize] {
                "action" => {
                    event.action = Action::from_name(self.str(value)?);
                    has_action = true;
                }
                "addr" => event.addr = value.as_u64()?,
                "size" => event.size = value.as_u64()?,
                "stream" => event.stream = value.as_u64()?,
                "time_us" => event.time_us = value.as_i64().unwrap_or(0),
                // oom entries carry cudaMemGetInfo's free bytes instead of an address.
                "device_free" => event.addr = value.as_u64()?,
                "frames" => frames = Some(value),
                _ => {}
            }
        }
        if !has_action {
            return None;
        }
        if let Some(frames) = frames {
            event.frames = self.intern_stack(frames);
        }
        Some(event)
    }
}

const MARK: u8 = b'(';
const STOP: u8 = b'.';
const POP: u8 = b'0';
const POP_MARK: u8 = b'1';
const DUP: u8 = b'2';
const FLOAT: u8 = b'F';
const INT: u8 = b'I';
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const LONG: u8 = b'L';
const BININT2: u8 = b'M';
const NONE: u8 = b'N';
const BINSTRING: u8 = b'T';
const SHORT_BINSTRING: u8 = b'U';
const UNICODE: u8 = b'V';
const BINUNICODE: u8 = b'X';
const APPEND: u8 = b'a';
const DICT: u8 = b'd';
const EMPTY_DICT: u8 = b'}';
const APPENDS: u8 = b'e';
const GET: u8 = b'g';
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';
const LIST: u8 = b'l';
const EMPTY_LIST: u8 = b']';
const PUT: u8 = b'p';
const BINPUT: u8 = b'q';
const LONG_BINPUT: u8 = b'r';
const SETITEM: u8 = b's';
const TUPLE: u8 = b't';
const EMPTY_TUPLE: u8 = b')';
const SETITEMS: u8 = b'u';
const BINFLOAT: u8 = b'G';
const PROTO: u8 = 0x80;
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const LONG1: u8 = 0x8a;
const LONG4: u8 = 0x8b;
const BINBYTES: u8 = b'B';
const SHORT_BINBYTES: u8 = b'C';
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE8: u8 = 0x8d;
const BINBYTES8: u8 = 0x8e;
const EMPTY_SET: u8 = 0x8f;
const ADDITEMS: u8 = 0x90;
const FROZENSET: u8 = 0x91;
const MEMOIZE: u8 = 0x94;
const FRAME: u8 = 0x95;
const BYTEARRAY8: u8 = 0x96;
const READONLY_BUFFER: u8 = 0x98;

/// Opcodes that build objects of classes (`GLOBAL`, `REDUCE`, ...): a snapshot never has them.
fn unsupported_name(op: u8) -> Option<&'static str> {
    Some(match op {
        b'c' => "GLOBAL",
        0x93 => "STACK_GLOBAL",
        b'R' => "REDUCE",
        b'b' => "BUILD",
        b'i' => "INST",
        b'o' => "OBJ",
        0x81 => "NEWOBJ",
        0x92 => "NEWOBJ_EX",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        0x82..=0x84 => "EXT",
        0x97 => "NEXT_BUFFER",
        b'S' => "STRING",
        _ => return None,
    })
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.data.len());
        let Some(end) = end else {
            return Err(PickleError::Truncated { offset: self.pos });
        };
        let bytes = &self.data[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn byte(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, PickleError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }

    fn u32(&mut self) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }

    /// A length field, checked against the bytes that are left.
    fn len(&self, n: u64) -> Result<usize, PickleError> {
        let left = (self.data.len() - self.pos) as u64;
        if n > left {
            return Err(PickleError::Truncated { offset: self.pos });
        }
        Ok(n as usize)
    }

    fn line(&mut self) -> Result<&'a [u8], PickleError> {
        let rest = &self.data[self.pos..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return Err(PickleError::Truncated { offset: self.pos });
        };
        self.pos += n + 1;
        Ok(&rest[..n])
    }
}

struct Machine {
    heap: Heap,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: Vec<Value>,
    /// Where the current opcode starts: the bound on memo slots.
    offset: usize,
}

/// Unpickles `data` into a heap and the top-level value. The stack and the marks hold at most
/// [`MAX_STACK`] entries and the memo at most one slot per byte read, so memory stays
/// proportional to `data`.
pub(crate) fn unpickle(data: &[u8]) -> Result<(Heap, Value), DecodeError> {
    let mut r = Reader { data, pos: 0 };
    let mut m = Machine {
        heap: Heap::default(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
        offset: 0,
    };
    loop {
        let offset = r.pos;
        m.offset = offset;
        let op = r.byte()?;
        match op {
            PROTO => {
                let version = r.byte()?;
                if version > 5 {
                    return Err(PickleError::Protocol(version).into());
                }
            }
            FRAME => {
                r.u64()?;
            }
            STOP => {
                let top = m.pop(offset)?;
                return Ok((m.heap, top));
            }
            MARK => {
                if m.marks.len() >= MAX_STACK {
                    return Err(Limit::Stack { offset }.into());
                }
                m.marks.push(m.stack.len());
            }
            POP => {
                m.pop(offset)?;
            }
            POP_MARK => {
                let start = m.pop_mark(offset)?;
                m.stack.truncate(start);
            }
            DUP => {
                let top = *m
                    .stack
                    .last()
                    .ok_or(PickleError::StackUnderflow { offset })?;
                m.push(top)?;
            }
            NONE => m.push(Value::None)?,
            NEWTRUE => m.push(Value::Bool(true))?,
            NEWFALSE => m.push(Value::Bool(false))?,
            BININT => m.push(Value::Int(i64::from(r.u32()? as i32)))?,
            BININT1 => m.push(Value::Int(i64::from(r.byte()?)))?,
            BININT2 => m.push(Value::Int(i64::from(r.u16()?)))?,
            LONG1 => {
                let n = usize::from(r.byte()?);
                let bytes = r.take(n)?;
                m.push(long_from_le(bytes, offset)?)?;
            }
            LONG4 => {
                let n = r.u32()? as i32;
                let n = usize::try_from(n).map_err(|_| PickleError::Malformed {
                    offset,
                    what: "negative LONG4 length",
                })?;
                let n = r.len(n as u64)?;
                let bytes = r.take(n)?;
                m.push(long_from_le(bytes, offset)?)?;
            }
            INT => {
                let text = r.line()?;
                let value = match text {
                    b"01" => Value::Bool(true),
                    b"00" => Value::Bool(false),
                    _ => Value::Int(parse_text(text, offset)?),
                };
                m.push(value)?;
            }
            LONG => {
                let text = r.line()?;
                let text = text.strip_suffix(b"L").unwrap_or(text);
                m.push(Value::Int(parse_text(text, offset)?))?;
            }
            FLOAT => {
                let text = r.line()?;
                m.push(Value::Float(parse_text(text, offset)?))?;
            }
            BINFLOAT => m.push(Value::Float(f64::from_be_bytes(
                r.take(8)?.try_into().expect("8 bytes"),
            )))?,
            SHORT_BINUNICODE => {
                let n = usize::from(r.byte()?);
                let text = r.take(n)?;
                m.push_str(text, offset)?;
            }
            BINUNICODE => {
                let n = r.u32()?;
                let n = r.len(u64::from(n))?;
                let text = r.take(n)?;
                m.push_str(text, offset)?;
            }
            BINUNICODE8 => {
                let n = r.u64()?;
                let n = r.len(n)?;
                let text = r.take(n)?;
                m.push_str(text, offset)?;
            }
            UNICODE => {
                let text = r.line()?;
                m.push_str(text, offset)?;
            }
            SHORT_BINSTRING => {
                let n = usize::from(r.byte()?);
                let bytes = r.take(n)?;
                m.push_latin1(bytes)?;
            }
            BINSTRING => {
                let n = r.u32()?;
                let n = r.len(u64::from(n))?;
                let bytes = r.take(n)?;
                m.push_latin1(bytes)?;
            }
            SHORT_BINBYTES => {
                let n = usize::from(r.byte()?);
                r.take(n)?;
                m.push(Value::Bytes)?;
            }
            BINBYTES => {
                let n = r.u32()?;
                let n = r.len(u64::from(n))?;
                r.take(n)?;
                m.push(Value::Bytes)?;
            }
            BINBYTES8 | BYTEARRAY8 => {
                let n = r.u64()?;
                let n = r.len(n)?;
                r.take(n)?;
                m.push(Value::Bytes)?;
            }
            READONLY_BUFFER => {
                m.stack
                    .last()
                    .ok_or(PickleError::StackUnderflow { offset })?;
            }
            EMPTY_LIST => {
                let v = m.new_sequence(Vec::new(), Value::List);
                m.push(v)?;
            }
            EMPTY_TUPLE => {
                let v = m.new_sequence(Vec::new(), Value::Tuple);
                m.push(v)?;
            }
            EMPTY_SET => {
                let v = m.new_sequence(Vec::new(), Value::List);
                m.push(v)?;
            }
            EMPTY_DICT => {
                let index = m.heap.dicts.len() as u32;
                m.heap.dicts.push(DictBody::Entries(Vec::new()));
                m.push(Value::Dict(index))?;
            }
            LIST | TUPLE | FROZENSET => {
                let start = m.pop_mark(offset)?;
                let items = m.stack.split_off(start);
                let v = m.new_sequence(
                    items,
                    if op == TUPLE {
                        Value::Tuple
                    } else {
                        Value::List
                    },
                );
                m.push(v)?;
            }
            TUPLE1 | TUPLE2 | TUPLE3 => {
                let n = usize::from(op - TUPLE1 + 1);
                if m.stack.len() < n {
                    return Err(PickleError::StackUnderflow { offset }.into());
                }
                let items = m.stack.split_off(m.stack.len() - n);
                let v = m.new_sequence(items, Value::Tuple);
                m.push(v)?;
            }
            DICT => {
                let start = m.pop_mark(offset)?;
                let index = m.heap.dicts.len() as u32;
                m.heap.dicts.push(DictBody::Entries(Vec::new()));
                m.set_items(index, start, offset)?;
                m.push(Value::Dict(index))?;
            }
            APPEND => {
                let item = m.pop(offset)?;
                let list = m.sequence_on_top(offset)?;
                m.heap.sequences[list as usize].push(item);
            }
            APPENDS | ADDITEMS => {
                let start = m.pop_mark(offset)?;
                if start == 0 {
                    return Err(PickleError::StackUnderflow { offset }.into());
                }
                let Value::List(list) = m.stack[start - 1] else {
                    return Err(PickleError::Malformed {
                        offset,
                        what: "APPENDS to something that is not a list",
                    }
                    .into());
                };
                let items = m.stack.drain(start..);
                m.heap.sequences[list as usize].extend(items);
            }
            SETITEM => {
                if m.stack.len() < 3 {
                    return Err(PickleError::StackUnderflow { offset }.into());
                }
                let start = m.stack.len() - 2;
                let Value::Dict(d) = m.stack[start - 1] else {
                    return Err(PickleError::Malformed {
                        offset,
                        what: "SETITEM on something that is not a dict",
                    }
                    .into());
                };
                m.set_items(d, start, offset)?;
            }
            SETITEMS => {
                let start = m.pop_mark(offset)?;
                if start == 0 {
                    return Err(PickleError::StackUnderflow { offset }.into());
                }
                let Value::Dict(d) = m.stack[start - 1] else {
                    return Err(PickleError::Malformed {
                        offset,
                        what: "SETITEMS on something that is not a dict",
                    }
                    .into());
                };
                m.set_items(d, start, offset)?;
            }
            MEMOIZE => {
                let top = *m
                    .stack
                    .last()
                    .ok_or(PickleError::StackUnderflow { offset })?;
                m.memo.push(top);
            }
            BINPUT => {
                let i = usize::from(r.byte()?);
                m.put(i, offset)?;
            }
            LONG_BINPUT => {
                let i = r.u32()? as usize;
                m.put(i, offset)?;
            }
            PUT => {
                let i: u64 = parse_text(r.line()?, offset)?;
                m.put(i as usize, offset)?;
            }
            BINGET => {
                let i = usize::from(r.byte()?);
                m.get(i, offset)?;
            }
            LONG_BINGET => {
                let i = r.u32()? as usize;
                m.get(i, offset)?;
            }
            GET => {
                let i: u64 = parse_text(r.line()?, offset)?;
                m.get(i as usize, offset)?;
            }
            _ => {
                return Err(DecodeError::Pickle(match unsupported_name(op) {
                    Some(name) => PickleError::Unsupported {
                        opcode: name,
                        offset,
                    },
                    None => PickleError::UnknownOpcode { opcode: op, offset },
                }));
            }
        }
    }
}

impl Machine {
    /// Pushes a value the pickle made; the heap counts them for the converter's budget.
    fn push(&mut self, v: Value) -> Result<(), Limit> {
        if self.stack.len() >= MAX_STACK {
            return Err(Limit::Stack {
                offset: self.offset,
            });
        }
        self.stack.push(v);
        self.heap.made += 1;
        Ok(())
    }

    fn pop(&mut self, offset: usize) -> Result<Value, PickleError> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return Err(PickleError::StackUnderflow { offset });
        }
        self.stack
            .pop()
            .ok_or(PickleError::StackUnderflow { offset })
    }

    fn pop_mark(&mut self, offset: usize) -> Result<usize, PickleError> {
        let start = self.marks.pop().ok_or(PickleError::Malformed {
            offset,
            what: "no MARK",
        })?;
        if start > self.stack.len() {
            return Err(PickleError::StackUnderflow { offset });
        }
        Ok(start)
    }

    fn sequence_on_top(&self, offset: usize) -> Result<u32, PickleError> {
        match self.stack.last() {
            Some(Value::List(i)) => Ok(*i),
            Some(_) => Err(PickleError::Malformed {
                offset,
                what: "APPEND to something that is not a list",
            }),
            None => Err(PickleError::StackUnderflow { offset }),
        }
    }

    fn new_sequence(&mut self, items: Vec<Value>, kind: fn(u32) -> Value) -> Value {
        let index = self.heap.sequences.len() as u32;
        self.heap.sequences.push(items);
        kind(index)
    }

    fn push_str(&mut self, text: &[u8], offset: usize) -> Result<(), DecodeError> {
        let text = std::str::from_utf8(text).map_err(|_| PickleError::Malformed {
            offset,
            what: "invalid UTF-8 in a string",
        })?;
        let index = self.heap.strings.len() as u32;
        self.heap.strings.push(text.into());
        Ok(self.push(Value::Str(index))?)
    }

    /// Python 2 `str` (protocol-2 pickles from the C++ side): Latin-1.
    fn push_latin1(&mut self, bytes: &[u8]) -> Result<(), Limit> {
        let index = self.heap.strings.len() as u32;
        self.heap.strings.push(
            bytes
                .iter()
                .map(|&b| char::from(b))
                .collect::<String>()
                .into(),
        );
        self.push(Value::Str(index))
    }

    /// Moves the key/value pairs above `start` into dict `d`; a fresh dict that turns out to
    /// be a trace entry becomes a [`TraceEvent`] instead.
    fn set_items(&mut self, d: u32, start: usize, offset: usize) -> Result<(), PickleError> {
        if !(self.stack.len() - start).is_multiple_of(2) {
            return Err(PickleError::Malformed {
                offset,
                what: "odd number of items for a dict",
            });
        }
        let fresh = matches!(&self.heap.dicts[d as usize], DictBody::Entries(e) if e.is_empty());
        if fresh && let Some(event) = self.heap.trace_event(&self.stack[start..]) {
            let index = self.heap.events.len() as u32;
            self.heap.events.push(event);
            self.heap.dicts[d as usize] = DictBody::Event(index);
            self.stack.truncate(start);
            return Ok(());
        }
        let items = self.stack.drain(start..);
        match &mut self.heap.dicts[d as usize] {
            DictBody::Entries(entries) => {
                let mut items = items;
                while let (Some(k), Some(v)) = (items.next(), items.next()) {
                    entries.push((k, v));
                }
            }
            DictBody::Event(_) => {
                drop(items);
                return Err(PickleError::Malformed {
                    offset,
                    what: "items added to a trace entry twice",
                });
            }
        }
        Ok(())
    }

    /// Stores the top of the stack in memo slot `index`. `pickle.dump` numbers slots in order,
    /// one per memoized object, so a slot past the opcodes read so far is refused: otherwise a
    /// 5-byte `LONG_BINPUT` could allocate gigabytes of empty slots.
    fn put(&mut self, index: usize, offset: usize) -> Result<(), DecodeError> {
        let top = *self
            .stack
            .last()
            .ok_or(PickleError::StackUnderflow { offset })?;
        if index < self.memo.len() {
            self.memo[index] = top;
        } else if index <= offset {
            self.memo.resize(index, Value::None);
            self.memo.push(top);
        } else {
            return Err(Limit::Memo { index, offset }.into());
        }
        Ok(())
    }

    fn get(&mut self, index: usize, offset: usize) -> Result<(), DecodeError> {
        let v = *self
            .memo
            .get(index)
            .ok_or(PickleError::BadMemo { index, offset })?;
        Ok(self.push(v)?)
    }
}

/// `LONG1`/`LONG4`: little-endian two's complement.
fn long_from_le(bytes: &[u8], offset: usize) -> Result<Value, PickleError> {
    if bytes.is_empty() {
        return Ok(Value::Int(0));
    }
    let negative = bytes[bytes.len() - 1] & 0x80 != 0;
    // Strip sign-extension bytes beyond 8 (or beyond 9 for an unsigned 64-bit value).
    let significant = {
        let fill = if negative { 0xff } else { 0x00 };
        let mut n = bytes.len();
        while n > 8 && bytes[n - 1] == fill {
            n -= 1;
        }
        &bytes[..n]
    };
    if significant.len() > 8 {
        return Err(PickleError::Malformed {
            offset,
            what: "integer beyond 64 bits",
        });
    }
    let mut buf = if negative { [0xffu8; 8] } else { [0u8; 8] };
    buf[..significant.len()].copy_from_slice(significant);
    let unsigned = u64::from_le_bytes(buf);
    if negative {
        Ok(Value::Int(unsigned as i64))
    } else if unsigned > i64::MAX as u64 {
        Ok(Value::UInt(unsigned))
    } else {
        Ok(Value::Int(unsigned as i64))
    }
}

fn parse_text<T: std::str::FromStr>(text: &[u8], offset: usize) -> Result<T, PickleError> {
    std::str::from_utf8(text)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .ok_or(PickleError::Malformed {
            offset,
            what: "bad number in a text opcode",
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(bytes: &[u8]) -> Value {
        long_from_le(bytes, 0).unwrap()
    }

    #[test]
    fn long1_decodes_twos_complement() {
        assert_eq!(ints(&[]), Value::Int(0));
        assert_eq!(ints(&[0xff]), Value::Int(-1));
        assert_eq!(ints(&[0x00, 0x80]), Value::Int(-32768));
        assert_eq!(ints(&[0x00, 0x80, 0x00]), Value::Int(32768));
        // an address: 0x7f47b7e00000 (six bytes + sign byte)
        assert_eq!(
            ints(&[0x00, 0x00, 0xe0, 0xb7, 0x47, 0x7f]),
            Value::Int(0x7f47b7e00000)
        );
        // 2^64 - 1 needs a ninth, zero byte
        assert_eq!(
            ints(&[0xff; 8].iter().copied().chain([0]).collect::<Vec<_>>()),
            Value::UInt(u64::MAX)
        );
        assert!(long_from_le(&[0, 0, 0, 0, 0, 0, 0, 0, 1], 0).is_err());
    }

    #[test]
    fn reads_a_protocol_2_dict_with_memo() {
        // pickle.dumps({'a': [1, 'x'], 'b': True}, protocol=2)
        let data = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01X\x01\x00\x00\x00xq\x03eX\x01\x00\x00\x00bq\x04\x88u.";
        let (heap, top) = unpickle(data).unwrap();
        let a = heap.get(top, "a").unwrap();
        let items = heap.seq(a).unwrap();
        assert_eq!(items[0], Value::Int(1));
        assert_eq!(heap.str(items[1]), Some("x"));
        assert_eq!(heap.get(top, "b"), Some(Value::Bool(true)));
    }

    #[test]
    fn rejects_classes_and_garbage() {
        assert!(matches!(
            unpickle(b"\x80\x04cos\nsystem\n."),
            Err(DecodeError::Pickle(PickleError::Unsupported {
                opcode: "GLOBAL",
                ..
            }))
        ));
        assert!(matches!(
            unpickle(b""),
            Err(DecodeError::Pickle(PickleError::Truncated { .. }))
        ));
        assert!(matches!(
            unpickle(b"\x80\x04]"),
            Err(DecodeError::Pickle(PickleError::Truncated { .. }))
        ));
        assert!(matches!(
            unpickle(b"."),
            Err(DecodeError::Pickle(PickleError::StackUnderflow { .. }))
        ));
        assert!(matches!(
            unpickle(b"\x80\x04h\x05."),
            Err(DecodeError::Pickle(PickleError::BadMemo { .. }))
        ));
        assert!(matches!(
            unpickle(b"\xff"),
            Err(DecodeError::Pickle(PickleError::UnknownOpcode { .. }))
        ));
        assert!(matches!(
            unpickle(b"\x80\x09."),
            Err(DecodeError::Pickle(PickleError::Protocol(9)))
        ));
    }
}
