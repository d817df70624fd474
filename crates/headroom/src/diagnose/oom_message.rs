//! PyTorch's CUDA/HIP out-of-memory messages, every format from 1.x to 2.11
//! (bench/shared/reference/allocator-spec.md §2), found anywhere in a pasted log.
//!
//! The message is one line when PyTorch prints it, but people paste it wrapped by a terminal,
//! split per sentence, inside `OutOfMemoryError('…')`, coloured, with `[rankN]:` in front of
//! every line of a multi-rank traceback, or only from `Tried to allocate` on. So the text is
//! normalised first (terminal escapes and log prefixes dropped, whitespace runs collapsed) and
//! then read with a cursor that accepts each clause of the message in PyTorch's order and stops
//! at the first one that is missing: a truncated paste still yields the fields it has. Sizes
//! may be retyped (`2.00 GB` for `2.00 GiB`, see [`parse_size_prefix`]).

use std::collections::HashSet;
use std::fmt;

use serde::Serialize;

use crate::units::parse_size_prefix;

/// Which runtime raised it (`HIP out of memory` on ROCm builds).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    Cuda,
    Hip,
}

/// The message template, which dates the PyTorch that printed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// ≤1.3: `(GPU d; T total capacity; A already allocated; F free; C cached)`, where
    /// `cached` is "memory held by the allocator but not used by the program" (PyTorch's
    /// comment), i.e. reserved but unallocated.
    Cached,
    /// 1.4–2.0: `(GPU d; T total capacity; A already allocated; F free; [L allowed; ]R reserved
    /// in total by PyTorch)`.
    ReservedInTotal,
    /// 2.1+: `GPU d has a total capacity of T of which F is free. …`.
    Sentences,
    /// `Tried to allocate more than 1EB memory.`: a nonsensical size, refused before any
    /// accounting.
    MoreThanOneExabyte,
}

/// One `Process N has X memory in use` clause; `pid` is `None` for the
/// `Including non-PyTorch memory, this process has X memory in use` clause. Its fields are an
/// entry of `diagnose --json`'s `processes`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct ProcessMemory {
    pub pid: Option<u64>,
    pub bytes: u64,
}

/// What one OOM message says. Sizes are the bytes PyTorch's `format_size` rounded to two
/// decimals of their unit, so each is exact to within half a unit of its last digit.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OomMessage {
    pub backend: Backend,
    pub format: Format,
    /// `None` when the message leaves the index out (seen as `GPU  has` in 2.4-era logs).
    pub device: Option<u32>,
    /// The segment size the allocator asked the driver for, not the tensor size
    /// (`get_allocation_size(round_size(request))`).
    pub tried_to_allocate_bytes: Option<u64>,
    pub total_capacity_bytes: Option<u64>,
    /// `cudaMemGetInfo` free after the allocator returned its whole cache to the driver.
    pub free_bytes: Option<u64>,
    pub allocated_by_pytorch_bytes: Option<u64>,
    /// Printed by 2.1+ and (as `cached`) by ≤1.3; derived as reserved − allocated for
    /// 1.4–2.0, which print the reserved total instead.
    pub reserved_unallocated_bytes: Option<u64>,
    /// Printed by 1.4–2.0 (`reserved in total by PyTorch`); derived as allocated +
    /// unallocated otherwise.
    pub reserved_by_pytorch_bytes: Option<u64>,
    /// `set_per_process_memory_fraction`'s cap, when the process set one.
    pub allowed_bytes: Option<u64>,
    /// Free bytes cached in private pools (CUDA graphs, MemPool), 2.4+.
    pub private_pools_bytes: Option<u64>,
    /// NVML's per-process usage, in NVML's order; empty where NVML is unavailable.
    pub processes: Vec<ProcessMemory>,
    /// The PyTorch releases that print this exact template.
    pub torch_versions: &'static str,
}

impl OomMessage {
    /// The `this process` clause, if NVML printed one.
    pub fn this_process_bytes(&self) -> Option<u64> {
        self.processes
            .iter()
            .find(|p| p.pid.is_none())
            .map(|p| p.bytes)
    }
}

impl Format {
    pub fn key(self) -> &'static str {
        match self {
            Format::Cached => "cached",
            Format::ReservedInTotal => "reserved_in_total",
            Format::Sentences => "sentences",
            Format::MoreThanOneExabyte => "more_than_1eb",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Cuda => "CUDA",
            Backend::Hip => "HIP",
        })
    }
}

/// The first OOM message in `text`, if any.
pub fn parse(text: &str) -> Option<OomMessage> {
    parse_all(text).into_iter().next()
}

/// Every distinct OOM message in `text`, in order (multi-rank logs repeat the same one). A
/// log without a whole message may still hold its fragment, the `Tried to allocate X (GPU N;
/// …)` or `Tried to allocate X. GPU N has …` clause alone; fragments are read only then.
pub fn parse_all(text: &str) -> Vec<OomMessage> {
    let norm = normalize(text);
    let (whole, fragments) = anchors(&norm);
    let starts = if whole.is_empty() { fragments } else { whole };
    let mut seen = HashSet::new();
    let mut out: Vec<OomMessage> = Vec::new();
    for (i, &(start, backend)) in starts.iter().enumerate() {
        let end = starts.get(i + 1).map_or(norm.len(), |&(next, _)| next);
        if let Some(msg) = parse_one(&norm[start..end], backend)
            && seen.insert(msg.clone())
        {
            out.push(msg);
        }
    }
    out
}

const TRIED: &str = "Tried to allocate ";

/// Where a message's text starts in the normalised log, and the runtime that raised it.
type Anchor = (usize, Backend);

/// Byte offsets just past each `Tried to allocate `, with the backend: those of whole
/// messages (`CUDA out of memory. ` or `HIP …` before it), and those of fragments (no other
/// runtime's `… out of memory. ` before it, and [`is_fragment`]), taken for CUDA.
/// Other runtimes' messages (`XPU out of memory.`, MPS's `… Tried to allocate 256 bytes on
/// private pool`) are neither.
fn anchors(norm: &str) -> (Vec<Anchor>, Vec<Anchor>) {
    let (mut whole, mut fragments) = (Vec::new(), Vec::new());
    for (at, _) in norm.match_indices(TRIED) {
        let before = &norm[..at];
        let start = at + TRIED.len();
        if before.ends_with("CUDA out of memory. ") {
            whole.push((start, Backend::Cuda));
        } else if before.ends_with("HIP out of memory. ") {
            whole.push((start, Backend::Hip));
        } else if !before.ends_with("out of memory. ") && is_fragment(&norm[start..]) {
            fragments.push((start, Backend::Cuda));
        }
    }
    (whole, fragments)
}

/// A size that ends the text or is followed by the pre-2.1 ` (GPU ` clause or by the full
/// stop of the 2.1+ sentences, as in PyTorch's message; what other text says after "Tried to
/// allocate X" (MPS's `on private pool`) does not count.
fn is_fragment(rest: &str) -> bool {
    let mut c = Cursor { s: rest, pos: 0 };
    c.size().is_some()
        && (c.rest().is_empty() || c.rest().starts_with('.') || c.rest().starts_with(" (GPU "))
}

/// Drop terminal escapes (colours), `[rankN]:` prefixes (torchrun's per-rank log tags, which
/// also start wrapped lines) and Markdown bold (`**`, never in PyTorch's text), and collapse
/// whitespace, so that coloured, wrapped and re-indented pastes read as PyTorch printed them.
/// U+FFFD, what a byte that is not UTF-8 reads as, counts as whitespace: such a byte is most
/// often a Latin-1 non-breaking space.
fn normalize(text: &str) -> String {
    let plain = strip_escapes(text);
    let mut out = String::with_capacity(plain.len());
    for word in plain.split(|c: char| c.is_whitespace() || c == char::REPLACEMENT_CHARACTER) {
        let word = word.replace("**", "");
        if word.is_empty() || is_rank_tag(&word) {
            continue;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(&word);
    }
    out
}

/// Introducers of an ANSI control sequence: the ESC byte itself, and the forms a paste turns it
/// into (`^[` from `cat -v` and editors, `␛` from some web views, `\x1b`, `\033` and `\u001b`
/// from a `repr` or a JSON log).
const ESCAPES: [&str; 6] = ["\u{1b}", "^[", "\u{241b}", "\\x1b", "\\033", "\\u001b"];

/// `text` without ANSI escape sequences: CSI (`ESC [ … final`, colours and cursor moves), OSC
/// (`ESC ] … BEL` or `ESC \\`, hyperlinks and titles), and the short `ESC X`. A spelled-out
/// introducer counts only before `[`, where it cannot be ordinary text.
fn strip_escapes(text: &str) -> std::borrow::Cow<'_, str> {
    if !ESCAPES.iter().any(|e| text.contains(e)) {
        return text.into();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(['\u{1b}', '^', '\u{241b}', '\\']) {
        out.push_str(&rest[..at]);
        let here = &rest[at..];
        let Some(intro) = ESCAPES.iter().find(|e| here.starts_with(*e)) else {
            let c = here.chars().next().map_or(1, char::len_utf8);
            out.push_str(&here[..c]);
            rest = &here[c..];
            continue;
        };
        let after = &here[intro.len()..];
        rest = match (*intro, after.as_bytes().first()) {
            (_, Some(b'[')) => skip_csi(&after[1..]),
            ("\u{1b}", Some(b']')) => skip_osc(&after[1..]),
            ("\u{1b}", _) => skip_short_escape(after),
            _ => {
                out.push_str(intro);
                after
            }
        };
    }
    out.push_str(rest);
    out.into()
}

/// Past a CSI's parameter and intermediate bytes and its final byte; a sequence cut short ends
/// at the first byte that cannot belong to it.
fn skip_csi(s: &str) -> &str {
    let body = s.bytes().take_while(|b| (0x20..=0x3f).contains(b)).count();
    match s.as_bytes().get(body) {
        Some(0x40..=0x7e) => &s[body + 1..],
        _ => &s[body..],
    }
}

/// Past the rest of a two- or three-byte escape (`ESC 7`, `ESC ( B`); anything else after an
/// ESC is text.
fn skip_short_escape(s: &str) -> &str {
    let bytes = s.as_bytes();
    match bytes.first() {
        Some(0x20..=0x2f) if bytes.get(1).is_some_and(|b| (0x30..=0x7e).contains(b)) => &s[2..],
        Some(0x30..=0x7e) => &s[1..],
        _ => s,
    }
}

/// Past an OSC's text and its terminator (BEL or `ESC \\`); one left open ends with its line.
fn skip_osc(s: &str) -> &str {
    match s.find(['\u{7}', '\u{1b}', '\n']) {
        Some(at) if s[at..].starts_with("\u{1b}\\") => &s[at + 2..],
        Some(at) if s.as_bytes()[at] == 0x07 => &s[at + 1..],
        Some(at) => &s[at..],
        None => "",
    }
}

fn is_rank_tag(word: &str) -> bool {
    word.strip_prefix("[rank")
        .and_then(|w| w.strip_suffix("]:"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A cursor over one message: each `eat` either consumes its literal or leaves the position.
struct Cursor<'a> {
    s: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.pos..]
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.rest().starts_with(lit) {
            self.pos += lit.len();
            true
        } else {
            false
        }
    }

    fn uint(&mut self) -> Option<u64> {
        let digits = self.rest().bytes().take_while(u8::is_ascii_digit).count();
        let value = self.rest()[..digits].parse().ok()?;
        self.pos += digits;
        Some(value)
    }

    /// `{size}{suffix}`, or nothing consumed.
    fn size_then(&mut self, suffix: &str) -> Option<u64> {
        let start = self.pos;
        let value = self.size().filter(|_| self.eat(suffix));
        if value.is_none() {
            self.pos = start;
        }
        value
    }

    /// A `format_size` string: `N bytes` or `X.YY KiB|MiB|GiB` (any number of decimals).
    fn size(&mut self) -> Option<u64> {
        let start = self.pos;
        let parsed = parse_size_prefix(self.rest());
        match parsed {
            Some((bytes, len)) => {
                self.pos += len;
                Some(bytes)
            }
            None => {
                self.pos = start;
                None
            }
        }
    }
}

fn empty(backend: Backend, format: Format) -> OomMessage {
    OomMessage {
        backend,
        format,
        device: None,
        tried_to_allocate_bytes: None,
        total_capacity_bytes: None,
        free_bytes: None,
        allocated_by_pytorch_bytes: None,
        reserved_unallocated_bytes: None,
        reserved_by_pytorch_bytes: None,
        allowed_bytes: None,
        private_pools_bytes: None,
        processes: Vec::new(),
        torch_versions: "",
    }
}

/// Parse the text that follows `… out of memory. Tried to allocate `.
fn parse_one(region: &str, backend: Backend) -> Option<OomMessage> {
    let mut c = Cursor { s: region, pos: 0 };
    if c.eat("more than 1EB memory") {
        let mut m = empty(backend, Format::MoreThanOneExabyte);
        m.torch_versions = "1.x–2.11";
        return Some(m);
    }
    let request = c.size()?;
    if c.eat(" (GPU ") {
        return Some(parse_parenthesised(&mut c, backend, request));
    }
    if !c.eat(".") {
        // `Tried to allocate 62.02 GiB` and nothing else: still the request.
        let mut m = empty(backend, Format::Sentences);
        m.tried_to_allocate_bytes = Some(request);
        m.torch_versions = "2.1+";
        return Some(m);
    }
    Some(parse_sentences(&mut c, backend, request))
}

/// ≤2.0: `(GPU d; T total capacity; A already allocated; F free; [L allowed; ]R reserved in
/// total by PyTorch)` or, ≤1.3, `… C cached)`.
fn parse_parenthesised(c: &mut Cursor, backend: Backend, request: u64) -> OomMessage {
    let mut m = empty(backend, Format::ReservedInTotal);
    m.tried_to_allocate_bytes = Some(request);
    m.torch_versions = "1.4–2.0";
    m.device = c.uint().and_then(|d| u32::try_from(d).ok());
    if !c.eat("; ") {
        return m;
    }
    m.total_capacity_bytes = c.size_then(" total capacity; ");
    if m.total_capacity_bytes.is_none() {
        return m;
    }
    m.allocated_by_pytorch_bytes = c.size_then(" already allocated; ");
    if m.allocated_by_pytorch_bytes.is_none() {
        return m;
    }
    m.free_bytes = c.size_then(" free; ");
    if m.free_bytes.is_none() {
        return m;
    }
    m.allowed_bytes = c.size_then(" allowed; ");
    let allocated = m.allocated_by_pytorch_bytes.unwrap_or(0);
    if let Some(reserved) = c.size_then(" reserved in total by PyTorch)") {
        m.reserved_by_pytorch_bytes = Some(reserved);
        m.reserved_unallocated_bytes = Some(reserved.saturating_sub(allocated));
    } else if let Some(cached) = c.size_then(" cached)") {
        m.format = Format::Cached;
        m.torch_versions = "≤1.3";
        m.reserved_unallocated_bytes = Some(cached);
        m.reserved_by_pytorch_bytes = Some(allocated.saturating_add(cached));
    }
    if m.format == Format::ReservedInTotal && c.rest().contains("max_split_size_mb") {
        m.torch_versions = "1.10–2.0";
    }
    m
}

/// 2.1+: the sentence form, with NVML process clauses, the fraction cap and private pools.
fn parse_sentences(c: &mut Cursor, backend: Backend, request: u64) -> OomMessage {
    let mut m = empty(backend, Format::Sentences);
    m.tried_to_allocate_bytes = Some(request);
    let mut typo = false;
    m.torch_versions = sentence_versions(c.rest(), false, false);
    if !c.eat(" GPU ") {
        return m;
    }
    m.device = c.uint().and_then(|d| u32::try_from(d).ok());
    c.eat(" ");
    if c.eat("has a total capacty of ") {
        typo = true;
    } else if !c.eat("has a total capacity of ") {
        return m;
    }
    m.total_capacity_bytes = c.size_then(" of which ");
    m.free_bytes = m.total_capacity_bytes.and(c.size_then(" is free."));
    if m.free_bytes.is_some() {
        parse_accounting(c, &mut m);
    }
    m.torch_versions = sentence_versions(c.rest(), typo, m.private_pools_bytes.is_some());
    m
}

/// Everything after `… of which F is free.`.
fn parse_accounting(c: &mut Cursor, m: &mut OomMessage) {
    loop {
        let start = c.pos;
        if c.eat(" Process ") {
            let pid = c.uint();
            if let Some(bytes) = pid
                .filter(|_| c.eat(" has "))
                .and_then(|_| c.size_then(" memory in use."))
            {
                m.processes.push(ProcessMemory { pid, bytes });
                continue;
            }
        } else if c.eat(" Including non-PyTorch memory, this process has ")
            && let Some(bytes) = c.size_then(" memory in use.")
        {
            m.processes.push(ProcessMemory { pid: None, bytes });
            continue;
        }
        c.pos = start;
        break;
    }
    let start = c.pos;
    if c.eat(" ") {
        m.allowed_bytes = c.size_then(" allowed;");
    }
    if m.allowed_bytes.is_none() {
        c.pos = start;
    }
    if !c.eat(" Of the allocated memory ") {
        return;
    }
    m.allocated_by_pytorch_bytes = c.size_then(" is allocated by PyTorch,");
    if m.allocated_by_pytorch_bytes.is_none() {
        return;
    }
    let start = c.pos;
    if c.eat(" with ") {
        m.private_pools_bytes = c.size_then(" allocated in private pools (e.g., ");
        if m.private_pools_bytes.is_some() && !(c.eat("CUDA Graphs),") || c.eat("HIP Graphs),")) {
            m.private_pools_bytes = None;
        }
    }
    if m.private_pools_bytes.is_none() {
        c.pos = start;
    }
    if c.eat(" and ") {
        m.reserved_unallocated_bytes = c.size_then(" is reserved by PyTorch but unallocated.");
    }
    if let (Some(a), Some(u)) = (m.allocated_by_pytorch_bytes, m.reserved_unallocated_bytes) {
        m.reserved_by_pytorch_bytes = Some(a.saturating_add(u));
    }
}

/// The releases a sentence-form message comes from, read from its typo and its tail
/// (bench/shared/reference/allocator-spec.md §2.2).
fn sentence_versions(tail: &str, typo: bool, private_pools: bool) -> &'static str {
    if typo || tail.contains("max_split_size_mb") {
        "2.1"
    } else if tail.contains("optimizing-memory-usage-with-pytorch-cuda-alloc-conf") {
        "2.11+"
    } else if tail.contains("PYTORCH_ALLOC_CONF=") {
        "2.10"
    } else if tail.contains("expandable_segments") {
        if private_pools {
            "2.4–2.9"
        } else {
            "2.2–2.9"
        }
    } else if private_pools {
        "2.4+"
    } else {
        "2.1+"
    }
}

/// Why the allocation failed, as far as the message alone tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// One request larger than the whole device: a wrong shape or an unchunked computation.
    ImpossibleRequest,
    /// `set_per_process_memory_fraction` capped the process below the device.
    FractionCap,
    /// Other processes hold the memory this one needed.
    OtherProcesses,
    /// The allocator held more free bytes than requested (and a real share of what it
    /// reserved), but in no block large enough.
    Fragmentation,
    /// The device reported more free memory than the request: the failing `cudaMalloc` saw
    /// less than the message's later reading.
    FreeExceedsRequest,
    /// The live tensors plus the request exceed what this process can get.
    Shortage,
    /// Too little of the message survived to tell.
    Unknown,
}

impl Cause {
    pub fn key(self) -> &'static str {
        match self {
            Cause::ImpossibleRequest => "impossible_request",
            Cause::FractionCap => "memory_fraction_cap",
            Cause::OtherProcesses => "other_processes",
            Cause::Fragmentation => "fragmentation",
            Cause::FreeExceedsRequest => "free_exceeds_request",
            Cause::Shortage => "shortage",
            Cause::Unknown => "unknown",
        }
    }
}

/// Where the device's memory was when the allocation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Accounting {
    pub total: u64,
    pub free: u64,
    pub allocated: u64,
    pub reserved_unallocated: u64,
    /// This process outside the caching allocator (CUDA context, library handles, NCCL):
    /// its NVML usage minus what PyTorch reserved.
    pub this_process_non_pytorch: Option<u64>,
    /// Other processes (NVML); `None` when the message has no NVML clauses at all.
    pub other_processes: Option<u64>,
    /// total − free − reserved − the two above: memory the message does not attribute (the
    /// CUDA context and other processes, when NVML printed nothing).
    pub unattributed: u64,
    /// A `Process N` clause taken for this process: inside a container's PID namespace NVML
    /// prints the own process that way.
    pub presumed_self_pid: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub cause: Cause,
    pub text: String,
}

/// The diagnosis of one message: a primary cause, its explanation, and what else it shows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Explanation {
    pub cause: Cause,
    pub summary: String,
    pub findings: Vec<Finding>,
    pub accounting: Option<Accounting>,
}

fn sz(bytes: u64) -> String {
    headroom_alloc::format_size(bytes)
}

/// Explain `m`: genuine shortage, fragmentation, or memory held elsewhere, with its numbers.
pub fn explain(m: &OomMessage) -> Explanation {
    let unknown = |summary: String| Explanation {
        cause: Cause::Unknown,
        summary,
        findings: Vec::new(),
        accounting: None,
    };
    let Some(request) = m.tried_to_allocate_bytes else {
        if m.format == Format::MoreThanOneExabyte {
            return Explanation {
                cause: Cause::ImpossibleRequest,
                summary: "The request was for more than 1 EiB: the size was computed from \
                          garbage (an overflowed or negative shape), not a memory shortage."
                    .into(),
                findings: Vec::new(),
                accounting: None,
            };
        }
        return unknown("The message has no request size.".into());
    };
    let Some(total) = m.total_capacity_bytes else {
        return unknown(format!(
            "Only the request survived ({}); paste the whole message for a diagnosis.",
            sz(request)
        ));
    };
    if request > total {
        return Explanation {
            cause: Cause::ImpossibleRequest,
            summary: format!(
                "One request of {} is larger than the whole GPU ({}): a wrong shape or a \
                 computation that must be chunked (attention or a matmul over a huge flattened \
                 batch), not something a memory setting fixes.",
                sz(request),
                sz(total)
            ),
            findings: Vec::new(),
            accounting: None,
        };
    }
    let (Some(free), Some(allocated), Some(unallocated)) = (
        m.free_bytes,
        m.allocated_by_pytorch_bytes,
        m.reserved_unallocated_bytes,
    ) else {
        let free = m
            .free_bytes
            .map_or(String::new(), |f| format!(" with {} free", sz(f)));
        return unknown(format!(
            "The message is cut short: {} requested on a {} GPU{free}; paste the whole message \
             for a diagnosis.",
            sz(request),
            sz(total)
        ));
    };
    let reserved = allocated.saturating_add(unallocated);
    let mut findings = Vec::new();

    // NVML: drop clauses it could not measure (0 bytes in containers, 2^64 − 1 for "not
    // available"), and take a `Process N` clause for this process when none is labelled so.
    let valid = |b: u64| b > 0 && b <= total;
    let own_clause = m.this_process_bytes();
    let own = own_clause.filter(|&b| valid(b));
    if let Some(b) = own_clause.filter(|&b| !valid(b)) {
        findings.push(Finding {
            cause: Cause::Unknown,
            text: format!(
                "NVML reported {} for this process, which it cannot have measured (usual in \
                 containers); the process lines are ignored for it.",
                sz(b)
            ),
        });
    }
    let others_list: Vec<&ProcessMemory> = m
        .processes
        .iter()
        .filter(|p| p.pid.is_some() && valid(p.bytes))
        .collect();
    let presumed_self = if own.is_none() {
        let candidates: Vec<&&ProcessMemory> =
            others_list.iter().filter(|p| p.bytes >= reserved).collect();
        (candidates.len() == 1).then(|| *candidates[0])
    } else {
        None
    };
    let others: Vec<&ProcessMemory> = others_list
        .into_iter()
        .filter(|p| presumed_self.is_none_or(|s| s.pid != p.pid))
        .collect();
    // Sizes come from pasted text: every sum and product saturates rather than overflow.
    let other_bytes: u64 = others.iter().fold(0, |sum, p| sum.saturating_add(p.bytes));
    let self_bytes = own.or(presumed_self.map(|p| p.bytes));
    let non_pytorch = self_bytes.map(|b| b.saturating_sub(reserved));
    let nvml_printed = !m.processes.is_empty();
    let accounting = Accounting {
        total,
        free,
        allocated,
        reserved_unallocated: unallocated,
        this_process_non_pytorch: non_pytorch,
        other_processes: nvml_printed.then_some(other_bytes),
        unattributed: total
            .saturating_sub(free)
            .saturating_sub(reserved)
            .saturating_sub(non_pytorch.unwrap_or(0))
            .saturating_sub(other_bytes),
        presumed_self_pid: presumed_self.and_then(|p| p.pid),
    };
    if let Some(pid) = accounting.presumed_self_pid {
        findings.push(Finding {
            cause: Cause::Unknown,
            text: format!(
                "Process {pid} is taken for this process: NVML labels it by PID inside \
                 containers, and it is the only one holding at least the {} PyTorch reserved.",
                sz(reserved)
            ),
        });
    }
    if allocated > total {
        findings.push(Finding {
            cause: Cause::Unknown,
            text: format!(
                "PyTorch has {} allocated on a {} GPU: the driver spills to system memory \
                 (Windows' sysmem fallback), which is slow; treat the total as the real limit.",
                sz(allocated),
                sz(total)
            ),
        });
    }

    // Bytes missing even if the allocator's free blocks were one block next to the free
    // device memory (what expandable segments approximate).
    let short_by = request.saturating_sub(free.saturating_add(unallocated));
    // The cap prints rounded like every size: allow for that before calling it the limit.
    let capped = |c: u64| reserved.saturating_add(request) > c - c / 100;
    let (cause, summary) = if let Some(cap) = m.allowed_bytes.filter(|&c| capped(c)) {
        (
            Cause::FractionCap,
            format!(
                "The per-process memory fraction caps this process at {}: it had {} reserved and \
                 asked for {} more, while the device still had {} free. Raise \
                 torch.cuda.set_per_process_memory_fraction (or the framework setting that \
                 calls it).",
                sz(cap),
                sz(reserved),
                sz(request),
                sz(free)
            ),
        )
    } else if other_bytes > allocated
        && other_bytes >= short_by
        && other_bytes.saturating_mul(10) >= total
    {
        let pids: Vec<String> = others
            .iter()
            .map(|p| format!("{} ({})", p.pid.unwrap_or(0), sz(p.bytes)))
            .collect();
        (
            Cause::OtherProcesses,
            format!(
                "Memory held by other processes: {} in {} other process{} ({}) against this \
                 process's {} of tensors. Without them the {} request would have fit; find them \
                 with nvidia-smi (another run, a notebook kernel, an inference server, or ranks \
                 placed on the same GPU).",
                sz(other_bytes),
                others.len(),
                if others.len() == 1 { "" } else { "es" },
                pids.join(", "),
                sz(allocated),
                sz(request)
            ),
        )
    } else if free >= request {
        (
            Cause::FreeExceedsRequest,
            format!(
                "The device reported {} free, more than the {} requested: when cudaMalloc \
                 failed there was less. Memory that comes and goes outside this process \
                 (another process allocating at the same moment, a driver reservation, an MPS \
                 or MIG or container limit) or a device in a bad state after an earlier error; \
                 check nvidia-smi while the job runs.",
                sz(free),
                sz(request)
            ),
        )
    } else if unallocated >= request && unallocated.saturating_mul(20) >= reserved {
        (
            Cause::Fragmentation,
            format!(
                "Fragmentation: the allocator held {} reserved but unallocated, more than the {} \
                 requested, yet no free block was large enough, and the device had only {} \
                 free. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets freed memory serve \
                 any size.",
                sz(unallocated),
                sz(request),
                sz(free)
            ),
        )
    } else {
        let margin = if unallocated >= request {
            format!(
                "The {} request could only have come from the {} cached, had it been one \
                 block, and that is all the room left: the next allocations would fail too.",
                sz(request),
                sz(unallocated)
            )
        } else if short_by == 0 {
            format!(
                "Only the {} free and the {} cached together could have served the {} \
                 request: the GPU is full to within {}, so the next allocations would fail \
                 too.",
                sz(free),
                sz(unallocated),
                sz(request),
                sz(free.saturating_add(unallocated).saturating_sub(request))
            )
        } else {
            format!(
                "The {} request exceeds the {} free plus the {} cached by {}.",
                sz(request),
                sz(free),
                sz(unallocated),
                sz(short_by)
            )
        };
        (
            Cause::Shortage,
            format!(
                "Genuine shortage: PyTorch's live tensors take {} of the {} GPU, with {} free. \
                 {margin} The run needs less memory (see the remedies) or a larger GPU.",
                sz(allocated),
                sz(total),
                sz(free)
            ),
        )
    };
    if cause != Cause::Fragmentation && unallocated >= (1 << 30).max(reserved / 10) {
        findings.push(Finding {
            cause: Cause::Fragmentation,
            text: format!(
                "Fragmentation adds to it: {} ({:.0}% of what PyTorch reserved) sat in cached \
                 blocks; expandable_segments would return most of it.",
                sz(unallocated),
                100.0 * unallocated as f64 / reserved.max(1) as f64
            ),
        });
    }
    if cause != Cause::OtherProcesses && other_bytes >= (1 << 30).max(total / 20) {
        findings.push(Finding {
            cause: Cause::OtherProcesses,
            text: format!(
                "Other processes hold {} of this GPU as well.",
                sz(other_bytes)
            ),
        });
    }
    if let Some(pools) = m.private_pools_bytes.filter(|&b| b >= 1 << 30) {
        findings.push(Finding {
            cause: Cause::Fragmentation,
            text: format!(
                "{} of what PyTorch calls allocated is free memory in private pools (CUDA graphs, \
                 MemPool): only graph replays can use it. Capture fewer shapes or release unused \
                 graphs.",
                sz(pools)
            ),
        });
    }
    if let Some(np) = non_pytorch.filter(|&b| b >= 2 << 30) {
        findings.push(Finding {
            cause: Cause::Unknown,
            text: format!(
                "This process holds {} outside PyTorch's allocator: more than a CUDA context \
                 (0.3–0.7 GiB). NCCL's communicators are the usual cause: under NCCL 2.28 each \
                 process group's holds about 0.2 GiB over NVLinked peers (0.4 GiB for a group of \
                 one rank) and about 0.5 GiB more once a collective connects it; Megatron-core \
                 makes 20 groups a rank, about 8 GiB when init_process_group(device_id=...) \
                 makes them all at once (without device_id only the groups a step uses are made; \
                 bench/nccl-comms). Otherwise a second allocator (vLLM's KV cache, cuDNN, \
                 TensorRT) or a leak.",
                sz(np)
            ),
        });
    }
    Explanation {
        cause,
        summary,
        findings,
        accounting: Some(accounting),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_tags_are_dropped_but_other_brackets_kept() {
        assert!(is_rank_tag("[rank12]:"));
        assert!(!is_rank_tag("[rank]:"));
        assert!(!is_rank_tag("[W330"));
        assert_eq!(normalize("[rank0]: a\n[rank0]:   b  c"), "a b c");
        assert_eq!(normalize("**[rank1]:** **a**\u{fffd}b"), "a b");
    }

    #[test]
    fn escapes_are_stripped_and_text_kept() {
        assert_eq!(strip_escapes("\u{1b}[1;31mred\u{1b}[0m plain"), "red plain");
        assert_eq!(
            strip_escapes("a\u{1b}]8;;http://x\u{7}link\u{1b}]8;;\u{1b}\\b"),
            "alinkb"
        );
        // An OSC left open ends with its line; a lone ESC before text removes nothing.
        assert_eq!(strip_escapes("\u{1b}]0;title\nnext"), "\nnext");
        assert_eq!(strip_escapes("\u{1b}\nnext"), "\nnext");
        assert_eq!(strip_escapes("^[[33mwarn^[[0m x^2 ^[a"), "warn x^2 ^[a");
        assert_eq!(strip_escapes("C:\\x1b[0mdir \\x1bz"), "C:dir \\x1bz");
        assert_eq!(strip_escapes("no escapes"), "no escapes");
    }

    #[test]
    fn many_escapes_strip_in_linear_time() {
        let text = "\u{1b}[0m^x\\y".repeat(200_000);
        let start = std::time::Instant::now();
        assert_eq!(strip_escapes(&text).len(), 200_000 * 4);
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn many_distinct_fragments_are_deduplicated_quickly() {
        let text: String = (0..50_000)
            .map(|i| format!("Tried to allocate {i} bytes (GPU 0; x\n"))
            .collect();
        let start = std::time::Instant::now();
        assert_eq!(parse_all(&text).len(), 50_000);
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn reads_the_simulators_own_message() {
        // headroom-alloc prints PyTorch 2.11's message; the parser must read it back exactly.
        let oom = headroom_alloc::DeviceOutOfMemory {
            requested: 3 << 30,
            alloc_size: 3 << 30,
            device: 0,
            device_total: 150_109_880_320,
            device_free: 1 << 30,
            allocated_bytes: 140 << 30,
            reserved_bytes: (145 << 30) + (5 << 20),
        };
        let m = parse(&format!("torch.OutOfMemoryError: {oom}")).expect("parses");
        assert_eq!(m.format, Format::Sentences);
        assert_eq!(m.torch_versions, "2.11+");
        assert_eq!(m.tried_to_allocate_bytes, Some(3 << 30));
        assert_eq!(m.allocated_by_pytorch_bytes, Some(140 << 30));
        // 5 GiB + 5 MiB prints as 5.00 GiB: the message keeps two decimals only.
        assert_eq!(m.reserved_unallocated_bytes, Some(5 << 30));
        // 139.80 GiB as printed, not the exact byte count.
        assert_eq!(m.total_capacity_bytes, Some(150_109_106_995));
    }

    #[test]
    fn exabyte_requests_and_absent_messages() {
        let m = parse("RuntimeError: CUDA out of memory. Tried to allocate more than 1EB memory.")
            .expect("parses");
        assert_eq!(m.format, Format::MoreThanOneExabyte);
        assert_eq!(m.tried_to_allocate_bytes, None);
        assert!(parse("RuntimeError: CUDA error: out of memory").is_none());
        assert!(parse("").is_none());
    }

    #[test]
    fn eight_gib_outside_the_allocator_points_at_nccls_communicators() {
        // A Megatron-core rank of 4 H200s that bound its device: its 21 communicators' 8 GiB.
        let text = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 \
                    has a total capacity of 139.80 GiB of which 1.50 GiB is free. Including \
                    non-PyTorch memory, this process has 138.30 GiB memory in use. Of the \
                    allocated memory 126.00 GiB is allocated by PyTorch, and 3.00 GiB is reserved \
                    by PyTorch but unallocated.";
        let m = parse(text).expect("parses");
        let e = explain(&m);
        let finding = e
            .findings
            .iter()
            .find(|f| f.text.contains("outside PyTorch's allocator"))
            .expect("the non-PyTorch finding");
        assert!(finding.text.contains("9.30 GiB"), "{}", finding.text);
        assert!(
            finding.text.contains("Megatron-core makes 20 groups"),
            "{}",
            finding.text
        );
    }

    #[test]
    fn repeated_messages_are_reported_once() {
        let one = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 8.00 GiB of which 0 bytes is free.";
        let two = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 MiB. GPU 1 has a total capacity of 8.00 GiB of which 0 bytes is free.";
        let all = parse_all(&format!("{one}\n{one}\n{two}"));
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].device, Some(1));
    }
}
