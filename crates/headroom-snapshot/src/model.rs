//! What a memory snapshot holds (bench/shared/reference/allocator-spec.md §3), in typed form.

/// An interned call stack; `NO_STACK` when none was recorded.
pub type StackId = u32;
pub const NO_STACK: StackId = u32::MAX;

/// What a trace entry records (`TraceEntry::Action`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    Oom,
    Snapshot,
    /// `user_defined`, `annotate` and actions newer than this reader.
    Other,
}

impl Action {
    pub(crate) fn from_name(name: &str) -> Action {
        match name {
            "alloc" => Action::Alloc,
            "free_requested" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            "oom" => Action::Oom,
            "snapshot" => Action::Snapshot,
            _ => Action::Other,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
            Action::Snapshot => "snapshot",
            Action::Other => "other",
        }
    }

    /// A change to reserved memory.
    pub fn is_segment_event(self) -> bool {
        matches!(
            self,
            Action::SegmentAlloc | Action::SegmentFree | Action::SegmentMap | Action::SegmentUnmap
        )
    }
}

/// One entry of `device_traces[d]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceEvent {
    pub action: Action,
    /// Block or segment address; for `oom`, the free bytes `cudaMemGetInfo` reported.
    pub addr: u64,
    /// Requested bytes for block events, segment bytes for segment events.
    pub size: u64,
    /// The `cudaStream_t` value.
    pub stream: u64,
    pub time_us: i64,
    pub frames: StackId,
}

/// How a block of a segment is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    ActiveAllocated,
    /// Freed, waiting for streams that used it (`record_stream`).
    ActivePendingFree,
    Inactive,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub address: u64,
    pub size: u64,
    pub requested_size: u64,
    pub state: BlockState,
    pub frames: StackId,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    pub device: u32,
    pub address: u64,
    pub total_size: u64,
    pub allocated_size: u64,
    pub active_size: u64,
    pub requested_size: u64,
    pub stream: u64,
    pub is_large: bool,
    pub is_expandable: bool,
    pub blocks: Vec<Block>,
}

/// `allocator_settings` (2.4+).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AllocatorSettings {
    /// The last settings string (`""` when unset).
    pub conf: String,
    pub expandable_segments: bool,
    /// Bytes, `-1` for unlimited.
    pub max_split_size: i64,
    /// Divisions per interval start in MiB ("1", "2", ..., "32768").
    pub roundup_power2_divisions: Vec<(u64, u64)>,
}

/// A frame as the snapshot stores it, with strings in the frame table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct RawFrame {
    pub filename: u32,
    pub name: u32,
    pub line: i64,
}

/// One Python (or C++) frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    pub filename: &'a str,
    pub name: &'a str,
    pub line: i64,
}

/// The strings, frames and stacks of a snapshot, shared by all its events and blocks.
#[derive(Debug, Default)]
pub struct FrameTable {
    pub(crate) strings: Vec<Box<str>>,
    pub(crate) frames: Vec<RawFrame>,
    pub(crate) stacks: Vec<Box<[u32]>>,
}

impl FrameTable {
    /// The frames of a stack, innermost first; empty for `NO_STACK`.
    pub fn stack(&self, id: StackId) -> impl Iterator<Item = Frame<'_>> + '_ {
        let frames: &[u32] = self.stacks.get(id as usize).map_or(&[], |s| s);
        frames.iter().map(|&f| {
            let raw = self.frames[f as usize];
            Frame {
                filename: &self.strings[raw.filename as usize],
                name: &self.strings[raw.name as usize],
                line: raw.line,
            }
        })
    }
}

/// A loaded `torch.cuda.memory._snapshot()`.
#[derive(Debug)]
pub struct Snapshot {
    /// Segments of all devices, as `_snapshot()` lists them.
    pub segments: Vec<Segment>,
    /// Trace entries per device index (empty for devices without history).
    pub device_traces: Vec<Vec<TraceEvent>>,
    pub allocator_settings: Option<AllocatorSettings>,
    /// Number of `external_annotations` entries.
    pub annotation_count: usize,
    pub frames: FrameTable,
}
