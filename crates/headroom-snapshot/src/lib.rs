//! Reader and analyzer of `torch.cuda.memory._dump_snapshot` files.
//!
//! - [`load`] reads `.pickle` / `.pickle.gz` snapshots (pickle protocols 2 to 5) into a typed
//!   [`Snapshot`].
//! - [`summarize`] computes what `torch/cuda/_memory_viz.py` and `MemoryViz.js` show:
//!   reserved/allocated/active bytes, fragmentation, the peak of active memory over the trace
//!   and who held it.
//! - [`replay`] feeds the trace through the `headroom-alloc` simulator and measures how many
//!   of the recorded segment events it reproduces.
//! - [`report`]: the `--json` output of `headroom snapshot` and `headroom replay`.

mod address_map;
mod error;
mod lcs;
pub mod limits;
mod mapped_pages;
mod model;
mod pickle;
mod read;
mod replay;
pub mod report;
mod sites;
mod summary;

pub use error::{DecodeError, Limit, PickleError, SnapshotError};
pub use model::{
    Action, AllocatorSettings, Block, BlockState, Frame, FrameTable, NO_STACK, Segment, Snapshot,
    StackId, TraceEvent,
};
pub use read::{from_bytes, load};
pub use replay::{
    Divergence, REPLAY_POINTS, ReplayOptions, ReplayPoint, ReplayReport, SegmentStep,
    config_from_settings, replay,
};
pub use summary::{
    ActionCounts, Fragmentation, SegmentCounts, Site, Summary, SummaryOptions, TimelinePoint,
    TraceSummary, summarize,
};

/// `kSmallBuffer`: small-pool segments are exactly this size.
const SMALL_SEGMENT_SIZE: u64 = headroom_alloc::SMALL_BUFFER;
