//! The device side of the timeline: every tensor allocation goes through the caching-allocator
//! simulator, so allocated bytes are block sizes (as `torch.cuda.max_memory_allocated` counts
//! them) and reserved bytes are segments. On top, it keeps what PyTorch does not: which
//! component each byte belongs to, and the breakdown at the peak.

mod record;
mod timeline;

use headroom_alloc::{BlockId, CachingAllocator, OutOfMemory};

use super::component::Component;
use record::Recording;
pub(crate) use record::Request;
pub use timeline::{PhaseStart, RecordedTimeline, Sample};

/// One live allocation. Its block's address and size are the allocator's (fixed while it is
/// allocated); kept to 16 bytes, it is returned in registers and keeps tensor records small.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Allocation {
    requested: u64,
    block: BlockId,
    component: Component,
}

impl Allocation {
    /// What the bytes are for, and how many were asked for.
    pub(crate) fn charge(&self) -> (Component, u64) {
        (self.component, self.requested)
    }
}

/// A recorded allocation or free, for comparing a timeline with a real trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimulatedEvent {
    pub alloc: bool,
    pub bytes: u64,
    /// The simulated block's address (frees name the block they return).
    pub address: u64,
    pub component: Component,
    pub label: &'static str,
}

/// The peak of one measured phase.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhasePeak {
    pub step: u32,
    pub phase: &'static str,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
}

/// The largest allocated total seen so far and what it was made of.
#[derive(Clone, Debug, Default)]
pub struct PeakRecord {
    pub allocated: u64,
    pub breakdown: [u64; Component::COUNT],
    /// Where the step was when the peak happened (phase and step number).
    pub phase: &'static str,
    pub step: u32,
}

/// The first allocation the device could not satisfy: where it happened and PyTorch's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimulatedOom {
    pub step: u32,
    pub phase: &'static str,
    /// What was being allocated (the timeline's label for the tensor).
    pub tensor: &'static str,
    pub requested_bytes: u64,
    /// The simulator's `torch.OutOfMemoryError`; its `Display` is PyTorch 2.11's message.
    pub error: OutOfMemory,
}

/// What a run does after its first out-of-memory error (which is recorded in any case).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnOom {
    /// Lift the device limit and go on: the timeline stays complete, if no longer physical.
    GoOn,
    /// Stop: nothing more reaches the allocator (the caller only wants to know where).
    Stop,
    /// Stop unless the run is still what it would be without a device limit
    /// ([`Memory::unlimited`]): then it goes on as that run, whose numbers the caller wants
    /// next, so that it need not be simulated again.
    StopUnlessUnlimited,
}

pub(crate) struct Memory {
    pub(crate) allocator: CachingAllocator,
    oom: Option<SimulatedOom>,
    /// What the first out-of-memory error does to the run.
    on_oom: OnOom,
    /// Stopped: from here on nothing reaches the allocator; allocations carry this block
    /// (the last one made, or [`BlockId::DETACHED`]) and are never freed.
    stopped: Option<BlockId>,
    /// A request the allocator refused even without a device limit; the run stopped there.
    refused: Option<SimulatedOom>,
    live: [u64; Component::COUNT],
    peak: PeakRecord,
    phase: &'static str,
    step: u32,
    phase_peak: u64,
    trace: Option<Vec<SimulatedEvent>>,
    /// The current CUDA stream: a block is served from, and returns to, the pool of the
    /// stream it was allocated on (collectives allocate on their own streams).
    pub(crate) stream: u32,
    recording: Option<Recording>,
    timeline: Option<RecordedTimeline>,
}

/// What a run keeps of its allocations beyond peaks and the breakdown.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Keep {
    /// Every allocation and free ([`SimulatedEvent`]).
    pub trace: bool,
    /// The component timeline ([`RecordedTimeline`]).
    pub timeline: bool,
}

impl Memory {
    pub(crate) fn new(allocator: CachingAllocator, keep: Keep) -> Self {
        Memory {
            allocator,
            oom: None,
            on_oom: OnOom::GoOn,
            stopped: None,
            refused: None,
            live: [0; Component::COUNT],
            peak: PeakRecord::default(),
            phase: "load",
            step: 0,
            phase_peak: 0,
            trace: keep.trace.then(Vec::new),
            stream: 0,
            recording: None,
            timeline: keep.timeline.then(RecordedTimeline::new),
        }
    }

    pub(crate) fn allocated(&self) -> u64 {
        self.allocator.stats().allocated_bytes.all.current as u64
    }

    /// `torch.cuda.reset_peak_memory_stats()` at the start of a measured phase.
    /// Name what is allocated from here on (and an out-of-memory error) after a phase.
    pub(crate) fn start_phase(&mut self, phase: &'static str, step: u32) {
        self.phase = phase;
        self.step = step;
        self.phase_peak = self.allocated();
        if let Some(timeline) = &mut self.timeline {
            timeline.start_phase(phase, step);
        }
    }

    /// After the live bytes or a segment changed: a sample of the timeline, when kept.
    #[inline]
    fn sample(&mut self) {
        if let Some(timeline) = &mut self.timeline {
            let reserved = self.allocator.stats().reserved_bytes.all.current as u64;
            timeline.push(self.live, reserved);
        }
    }

    /// A measured phase starts: [`Memory::start_phase`], then `reset_peak_memory_stats()`.
    pub(crate) fn begin_measured_phase(&mut self, phase: &'static str, step: u32) {
        self.start_phase(phase, step);
        self.allocator.reset_peak_stats();
    }

    /// The running phase's peaks, as `max_memory_allocated()` and `max_memory_reserved()`
    /// read them.
    pub(crate) fn phase_peak(&self) -> PhasePeak {
        PhasePeak {
            step: self.step,
            phase: self.phase,
            peak_allocated: self.phase_peak,
            peak_reserved: self.allocator.stats().reserved_bytes.all.peak as u64,
        }
    }

    pub(crate) fn malloc(
        &mut self,
        bytes: u64,
        component: Component,
        label: &'static str,
    ) -> Allocation {
        if let Some(block) = self.stopped {
            if let Some(r) = &mut self.recording {
                r.abandon();
            }
            return Allocation {
                block,
                requested: bytes,
                component,
            };
        }
        let block = match self.allocator.malloc(bytes, self.stream) {
            Ok(block) => block,
            Err(err) => {
                // PyTorch raises here. The rest of the run goes on without a limit so that the
                // caller still gets a complete (if no longer physical) timeline.
                if self.oom.is_none() {
                    if let Some(timeline) = &mut self.timeline {
                        timeline.mark_oom();
                    }
                    self.oom = Some(SimulatedOom {
                        step: self.step,
                        phase: self.phase,
                        tensor: label,
                        requested_bytes: bytes,
                        error: err,
                    });
                }
                self.allocator.set_capacity(None);
                let block = match self.allocator.malloc(bytes, self.stream) {
                    Ok(block) => block,
                    Err(error) => {
                        // No device holds it: a tensor of 1 EiB or more, or more bytes than
                        // a 64-bit device addresses. The run cannot go on.
                        self.refused = Some(SimulatedOom {
                            step: self.step,
                            phase: self.phase,
                            tensor: label,
                            requested_bytes: bytes,
                            error,
                        });
                        if let Some(r) = &mut self.recording {
                            r.abandon();
                        }
                        self.stopped = Some(BlockId::DETACHED);
                        return Allocation {
                            block: BlockId::DETACHED,
                            requested: bytes,
                            component,
                        };
                    }
                };
                let stop = match self.on_oom {
                    OnOom::GoOn => false,
                    OnOom::Stop => true,
                    OnOom::StopUnlessUnlimited => !self.unlimited(),
                };
                if stop {
                    self.stopped = Some(block);
                }
                block
            }
        };
        let block_size = self.allocator.block_size(block);
        if let Some(r) = &mut self.recording {
            r.malloc(block, bytes, self.stream, component, label);
        }
        self.live[component.index()] += bytes;
        self.live[Component::AllocatorRounding.index()] += block_size - bytes;
        if let Some(trace) = &mut self.trace {
            trace.push(SimulatedEvent {
                alloc: true,
                bytes,
                address: self.allocator.block_address(block),
                component,
                label,
            });
        }
        self.sample();
        let allocated = self.allocated();
        self.phase_peak = self.phase_peak.max(allocated);
        // The peak that matters is that of the measured steps; loading is a phase of its own.
        if self.phase != "load" && allocated > self.peak.allocated {
            self.peak = PeakRecord {
                allocated,
                breakdown: self.live,
                phase: self.phase,
                step: self.step,
            };
        }
        Allocation {
            block,
            requested: bytes,
            component,
        }
    }

    /// What a live allocation is, block handles aside: (block address, requested bytes,
    /// block size, component).
    pub(crate) fn signature(&self, a: &Allocation) -> (u64, u64, u64, Component) {
        (
            self.allocator.block_address(a.block),
            a.requested,
            self.allocator.block_size(a.block),
            a.component,
        )
    }

    #[inline]
    pub(crate) fn free(&mut self, a: Allocation, label: &'static str) {
        if self.stopped.is_some() {
            return;
        }
        if let Some(r) = &mut self.recording {
            r.free(a.block, label);
        }
        let block_size = self.allocator.block_size(a.block);
        let address = self.allocator.block_address(a.block);
        self.allocator.free(a.block);
        self.live[a.component.index()] -= a.requested;
        self.live[Component::AllocatorRounding.index()] -= block_size - a.requested;
        if let Some(trace) = &mut self.trace {
            trace.push(SimulatedEvent {
                alloc: false,
                bytes: a.requested,
                address,
                component: a.component,
                label,
            });
        }
        self.sample();
    }

    /// Move an allocation's bytes to another component (a gradient that becomes `.grad`).
    pub(crate) fn recategorize(&mut self, a: &mut Allocation, component: Component) {
        if self.stopped.is_some() {
            return;
        }
        if let Some(r) = &mut self.recording
            && let Some(index) = r.index_of(a.block, false)
        {
            r.requests.push(Request::Recategorize { index, component });
        }
        self.live[a.component.index()] -= a.requested;
        self.live[component.index()] += a.requested;
        a.component = component;
        self.sample();
    }

    /// Bytes requested by live allocations, per component.
    pub(crate) fn live(&self) -> [u64; Component::COUNT] {
        self.live
    }

    /// Events recorded so far (when recording).
    pub(crate) fn trace_len(&self) -> usize {
        self.trace.as_ref().map_or(0, Vec::len)
    }

    /// Records again the events `range` recorded earlier (a step that repeats another).
    pub(crate) fn repeat_trace(&mut self, range: std::ops::Range<usize>) {
        if let Some(trace) = &mut self.trace {
            trace.extend_from_within(range);
        }
    }

    pub(crate) fn peak(&self) -> &PeakRecord {
        &self.peak
    }

    /// What the first out-of-memory error does from now on.
    pub(crate) fn on_oom(&mut self, policy: OnOom) {
        self.on_oom = policy;
    }

    /// Whether the allocator is where the same requests would have left it without a device
    /// limit, and so allocated and reserved bytes, peaks, breakdown and trace too (a limit
    /// lifted at an out-of-memory error that changed nothing included).
    pub(crate) fn unlimited(&self) -> bool {
        !self.allocator.limit_has_acted()
    }

    /// Memory taken outside the caching allocator (a rollout engine's pool) on a device of
    /// `device_total` allocator bytes, after the allocator was limited to what is left: when
    /// what the allocator holds does not leave room for it, that is where the run runs out.
    /// The rest of the run goes on without a limit.
    pub(crate) fn outside_allocation(
        &mut self,
        bytes: u64,
        device_total: u64,
        label: &'static str,
    ) {
        let stats = self.allocator.stats();
        let reserved = stats.reserved_bytes.all.current as u64;
        if reserved + bytes <= device_total || self.oom.is_some() {
            return;
        }
        if let Some(timeline) = &mut self.timeline {
            timeline.mark_oom();
        }
        self.oom = Some(SimulatedOom {
            step: self.step,
            phase: self.phase,
            tensor: label,
            requested_bytes: bytes,
            error: OutOfMemory::Device(headroom_alloc::DeviceOutOfMemory {
                requested: bytes,
                alloc_size: bytes,
                device: 0,
                device_total,
                device_free: device_total.saturating_sub(reserved),
                allocated_bytes: stats.allocated_bytes.all.current as u64,
                reserved_bytes: reserved,
            }),
        });
        self.allocator.set_capacity(None);
    }

    /// Whether the run stopped at an out-of-memory error.
    pub(crate) fn stopped(&self) -> bool {
        self.stopped.is_some()
    }

    pub(crate) fn oom(&self) -> Option<&SimulatedOom> {
        self.oom.as_ref()
    }

    /// The request no device could serve, where the run stopped.
    pub(crate) fn refused(&self) -> Option<&SimulatedOom> {
        self.refused.as_ref()
    }

    /// Whether a component timeline is kept ([`Keep::timeline`]).
    pub(crate) fn keeps_timeline(&self) -> bool {
        self.timeline.is_some()
    }

    /// The live bytes, per component, of models the running phase does not run.
    pub(crate) fn set_idle(&mut self, idle: [u64; Component::COUNT]) {
        if let Some(timeline) = &mut self.timeline {
            timeline.set_idle(idle);
        }
    }

    pub(crate) fn take_timeline(&mut self) -> Option<RecordedTimeline> {
        self.timeline.take()
    }

    pub(crate) fn take_trace(&mut self) -> Vec<SimulatedEvent> {
        self.trace.take().unwrap_or_default()
    }
}
